"""qfp8.evaluate: perplexity / KL / top-1 against hand computation, text slices, layer reports."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import evaluate
from tests.models import save_tiny_llama


class FixedLogits(nn.Module):
    """A 'language model' whose logits at position t are a fixed table row chosen by the token at t."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, ids):
        return self.table[ids]


def hand_log_softmax(row):
    top = max(row)
    total = sum(math.exp(v - top) for v in row)
    return [v - top - math.log(total) for v in row]


def test_perplexity_kl_top1_match_hand_computation():
    table = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0], [1.5, 1.5, 0.0]])
    other = torch.tensor([[1.0, 0.9, -1.0], [0.2, 1.0, 2.0], [1.0, 2.0, 0.5]])
    ids = torch.tensor([[0, 2, 1, 1, 0], [2, 2, 0, 1, 2]])
    results = evaluate.evaluate({"ref": FixedLogits(table), "q": FixedLogits(other)}, ids, reference="ref")

    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for window in ids.tolist():
        for t in range(len(window) - 1):
            p = hand_log_softmax(table[window[t]].tolist())
            q = hand_log_softmax(other[window[t]].tolist())
            nll += -q[window[t + 1]]
            kl += sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))
            agree += p.index(max(p)) == q.index(max(q))
            count += 1
    assert results["q"].positions == count == 8
    assert results["q"].perplexity == pytest.approx(math.exp(nll / count), rel=1e-6)
    assert results["q"].kl == pytest.approx(kl / count, rel=1e-5)
    assert results["q"].top1 == pytest.approx(agree / count)
    assert results["ref"].kl == pytest.approx(0.0, abs=1e-7) and results["ref"].top1 == 1.0


def test_a_token_both_models_rule_out_adds_no_kl_and_batch_size_is_checked():
    table = torch.tensor([[2.0, 0.5, float("-inf")], [0.0, 1.0, float("-inf")], [1.5, 1.5, float("-inf")]])
    other = torch.tensor([[1.0, 0.9, float("-inf")], [0.2, 1.0, float("-inf")], [1.0, 2.0, float("-inf")]])
    ids = torch.tensor([[0, 1, 1, 0]])
    results = evaluate.evaluate({"ref": FixedLogits(table), "q": FixedLogits(other)}, ids, reference="ref")
    kl = 0.0
    for t in range(3):
        p = torch.log_softmax(table[ids[0, t]], -1)[:2].tolist()
        q = torch.log_softmax(other[ids[0, t]], -1)[:2].tolist()
        kl += sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))
    assert results["q"].kl == pytest.approx(kl / 3, rel=1e-5) and math.isfinite(results["ref"].kl)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        evaluate.evaluate({"q": FixedLogits(other)}, ids, batch_size=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return evaluate.load_model(folder)


def test_perplexity_matches_transformers_loss(tiny):
    model, tokenizer = tiny
    windows = evaluate.evaluation_windows(tokenizer, 2, length=64)
    with torch.no_grad():
        losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    assert evaluate.perplexity(model, windows) == pytest.approx(math.exp(sum(losses) / 2), rel=1e-5)


def test_evaluation_and_calibration_slices_are_fixed_and_disjoint(tiny):
    _, tokenizer = tiny
    ids = evaluate.token_ids(tokenizer)
    evaluation = evaluate.evaluation_windows(tokenizer, 4)
    calibration = evaluate.calibration_windows(tokenizer, 2)
    assert torch.equal(evaluation.flatten(), ids[: 4 * evaluate.WINDOW])
    assert torch.equal(calibration.flatten(), ids[evaluate.CALIBRATION_OFFSET :][: 2 * evaluate.WINDOW])
    assert 192 * evaluate.WINDOW <= evaluate.CALIBRATION_OFFSET  # up to 192 evaluation windows stay disjoint
    assert evaluate.token_ids(tokenizer, "docstrings").numel() > 4 * evaluate.WINDOW
    with pytest.raises(ValueError, match="need .* tokens; the text has"):
        evaluate.windows(ids, 10_000)
    with pytest.raises(ValueError, match="unknown text"):
        evaluate.token_ids(tokenizer, "wikitext")


def test_weight_sqnr_and_per_layer_report(tiny):
    import copy

    model, tokenizer = tiny
    quantized = copy.deepcopy(model)
    qfp8.quantize(quantized, weight_scale="channel")
    # e4m3 round to nearest on Gaussian-like weights: about 31 dB.
    assert 28 < evaluate.weight_sqnr(model, quantized) < 36
    scheme = qfp8.nn.QuantizationScheme.from_args(activations="dynamic", activation_scale="token")
    report = evaluate.layer_output_sqnr(
        model,
        lambda name, linear: qfp8.QLinear.from_linear(linear, scheme, name),
        evaluate.evaluation_windows(tokenizer, 1, length=32),
    )
    names = [name for name in evaluate.linear_names(model)]
    assert sorted(name for name, _ in report) == sorted(names)
    values = [value for _, value in report]
    assert values == sorted(values) and all(18 < v < 40 for v in values)


def test_load_model_refuses_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a .gguf"):
        evaluate.load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        evaluate.load_model(tmp_path)
