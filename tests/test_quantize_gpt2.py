"""GPT-2's linear layers are transformers' ``Conv1D`` (weight stored ``[in, out]``): ``qfp8.quantize``, transformers'
``Qfp8Config`` loading and ``qfp8 quantize`` take them as linear layers (a QLinear of the transposed weight), with
the schemes, exclude patterns and report entries of ``nn.Linear``; what they write loads in qfp8 only, and says so."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import qfp8
from qfp8 import QLinear
from tests.conftest import sqnr
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers", reason="GPT-2 is a transformers model")
from safetensors.torch import load_file  # noqa: E402

CONV1D_NAMES = [
    f"transformer.h.{i}.{part}" for i in range(2) for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
# The warning every checkpoint with such layers gets, once.
LOADS_IN_QFP8_ONLY = r"Conv1D layers \(.*8 modules\) are written as qfp8 linear layers"


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def fp8_equal(a: dict, b: dict) -> bool:
    """Same tensor names and the same bytes for each."""
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(as_bytes(a[k]), as_bytes(b[k])) for k in a
    )


def converted_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "are written as qfp8 linear layers" in str(w.message)]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"activations": "dynamic"}, {"weight_scale": "block", "block_size": (32, 32)}],
    ids=["w8a16-channel", "w8a8-dynamic", "w8a16-block"],
)
@torch.no_grad()
def test_quantize_takes_conv1d_as_linear_layers_and_reloads_bit_identical(tmp_path, kwargs):
    model = tiny_gpt2()
    ids = token_ids()
    reference = copy.deepcopy(model).double()(ids).logits
    _, report = qfp8.quantize(model, **kwargs)
    entries = {entry.name: entry for entry in report.entries}
    assert [name for name in entries if name != "lm_head"] == CONV1D_NAMES
    assert all(entries[name].quantized and entries[name].kernel for name in CONV1D_NAMES)
    assert (entries["transformer.h.0.mlp.c_fc"].out_features, entries["transformer.h.0.mlp.c_fc"].in_features) == (
        256,
        64,
    )
    assert not report.others  # no float matrix weight left outside the linear layers
    assert "excluded by pattern 'lm_head'" in entries["lm_head"].reason  # tied to wte: float, as for any model
    assert isinstance(model.transformer.h[0].attn.c_attn, QLinear)
    out = model(ids).logits
    assert sqnr(reference, out.double()) > 20
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, tmp_path)
    assert len(converted_warnings(record)) == 1
    message = converted_warnings(record)[0]
    assert "vLLM" in message and "transformers without qfp8" in message and "'c_attn'" in message
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["transformer.h.0.mlp.c_fc.weight"].shape == (256, 64)  # [out, in], as every qfp8 linear layer
    assert stored["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float8_e4m3fn
    loaded = qfp8.from_pretrained(tmp_path)
    assert isinstance(loaded.transformer.h[1].mlp.c_proj, QLinear)
    assert torch.equal(loaded(ids).logits, out)


def test_exclude_patterns_keep_conv1d_layers_float_as_linears():
    model = tiny_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'c_attn' matches: no "matches nothing" warning
        _, report = qfp8.quantize(model, exclude=("lm_head", "c_attn"))
    skipped = {entry.name: entry.reason for entry in report.skipped}
    assert skipped == {
        "transformer.h.0.attn.c_attn": "excluded by pattern 'c_attn'",
        "transformer.h.1.attn.c_attn": "excluded by pattern 'c_attn'",
        "lm_head": "excluded by pattern 'lm_head'",
    }
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    assert isinstance(model.transformer.h[0].mlp.c_fc, QLinear)
    assert not report.others  # an excluded Conv1D counts with the linear layers, as an excluded nn.Linear


@torch.no_grad()
def test_transformers_loading_with_qfp8_config_quantizes_conv1d_as_quantize_does(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path / "float")
    in_memory = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "float").eval()
    qfp8.quantize(in_memory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=qfp8.Qfp8Config()
    )
    assert isinstance(loaded.transformer.h[0].attn.c_attn, QLinear)
    assert [entry.name for entry in loaded.qfp8_report.quantized] == CONV1D_NAMES
    assert fp8_equal(in_memory.state_dict(), loaded.state_dict())  # the same FP8 bytes and scales
    ids = token_ids()
    assert torch.equal(loaded(ids).logits, in_memory(ids).logits)
    with pytest.warns(UserWarning, match=LOADS_IN_QFP8_ONLY):
        qfp8.save_pretrained(in_memory, tmp_path / "fp8")
    config = qfp8.Qfp8Config().for_checkpoint(tmp_path / "fp8")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", config=config)
    assert isinstance(reloaded.transformer.h[1].mlp.c_fc, QLinear)
    assert torch.equal(reloaded(ids).logits, in_memory(ids).logits)


@pytest.mark.parametrize("options", [{}, {"weight_scale": "tensor", "exclude": ()}], ids=["default", "tensor-all"])
def test_stream_quantize_reads_conv1d_transposed_and_writes_what_quantize_saves(tmp_path, options):
    """The CLI refused GPT-2 as "nothing to quantize"; it writes the tensors qfp8.quantize + save_pretrained write
    (with nothing excluded: the tied lm_head too, and the embedding as its rows), and reports the same layers."""
    from qfp8.checkpoint.stream import stream_quantize

    tiny_gpt2(dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    cli_options = {("weight_scale_granularity" if k == "weight_scale" else k): v for k, v in options.items()}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        summary = stream_quantize(tmp_path / "float", tmp_path / "stream", progress=False, **cli_options)
    assert len(converted_warnings(record)) == 1
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "float").eval()
    _, report = qfp8.quantize(model, **options)
    qfp8.save_pretrained(model, tmp_path / "memory")
    as_rows = lambda r: [(e.name, e.quantized, e.out_features, e.in_features, e.scheme) for e in r.entries]  # noqa: E731
    assert as_rows(summary["report"]) == as_rows(report)
    streamed = load_file(tmp_path / "stream" / "model.safetensors")
    assert fp8_equal(streamed, load_file(tmp_path / "memory" / "model.safetensors"))
    assert streamed["transformer.h.0.attn.c_attn.weight"].shape == (192, 64)
    assert ("lm_head.weight_scale" in streamed) == bool(options)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("stream", "memory")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    loaded = qfp8.from_pretrained(tmp_path / "stream")
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
