"""qfp8 checkpoints in vLLM's real CPU engine: each scheme qfp8 writes, served by vLLM, against qfp8's own run.

One tiny random Llama (every dimension a multiple of 128, as vLLM's block path needs) is quantized with each
scheme and saved; one vLLM process (tests/vllm/serve.py, in the python conftest.py finds) starts its offline
engine on each checkpoint in turn and feeds it one prompt teacher-forced. What vLLM does must be what
qfp8.checkpoint.compat.VLLM_CPU says (which docs/vllm.md's matrix is written from):

- a scheme that serves agrees with ``qfp8.from_pretrained`` running what vLLM computes (the same checkpoint, or
  the scheme compat's ``runs_as`` names): at every position where qfp8's top-1 log-probability exceeds its top-2
  by ``RULE.margin`` nats, vLLM's top-1 token is qfp8's, and the log-probabilities vLLM gives that token differ
  from qfp8's by at most ``RULE.mean`` on average and ``RULE.worst`` anywhere (``KV_RULE`` with an FP8 KV
  cache). The lm_head is scaled up so that most positions have such a margin (random weights give near-ties
  everywhere); at least half of them must.
- a scheme that does not fails at the stage and with the message the table says;
- where the fault is vLLM's, an expected-to-fail (strict) test asserts that it serves, so that the day a vLLM
  release runs it, the test flips and the table must change.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import qfp8
from qfp8.checkpoint import compat
from qfp8.checkpoint.naming import KV_ROUNDING_FILE
from qfp8.nn.scheme import QuantizationScheme

transformers = pytest.importorskip("transformers", reason="builds a transformers model")

SIZES = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip
HEAD_GAIN = 10.0  # lm_head weights scaled so that top-1 margins are clear (logit spread of a few nats)
PROMPT_LENGTH = 48
SERVE_TIMEOUT_S = 900

# test id -> qfp8.quantize arguments; every kind of compat.VLLM_CPU is among them (test_every_kind_is_run)
SCHEMES = {
    "w8a16-channel": dict(),
    "w8a16-tensor": dict(weight_scale="tensor"),
    "w8a16-block": dict(weight_scale="block"),
    "w8a8-token": dict(activations="dynamic"),
    "w8a8-tensor-act": dict(activations="dynamic", activation_scale="tensor"),
    "w8a8-channel-group": dict(activations="dynamic", activation_scale="group"),
    "w8a8-block-group": dict(weight_scale="block", activations="dynamic", activation_scale="group"),
    "w8a8-static": dict(activations="static"),
    "w8a8-tensor-weights": dict(weight_scale="tensor", activations="dynamic"),
    "w8a8-static-tensor-weights": dict(weight_scale="tensor", activations="static"),
    "kv-cache-fp8": compat.VLLM_CPU_KV_CACHE.example,
}
# e5m2 weights: compressed-tensors cannot say them, so qfp8 writes the checkpoint without quant_method, for qfp8
# only; vLLM then builds a float model and its loader finds no parameter for the scales.
QFP8_ONLY = "e5m2-qfp8-only"
QFP8_ONLY_ARGUMENTS = dict(weights="float8_e5m2", activations="dynamic")
NEAREST_KEYS = "kv-cache-fp8-keys-rounded-to-nearest"  # qfp8's reference for the FP8 KV cache: keys as vLLM rounds them


def scheme_arguments(test_id: str) -> dict:
    """SCHEMES[test_id] without the KV cache: the QuantizationScheme.from_args arguments."""
    return {k: v for k, v in SCHEMES[test_id].items() if k != "kv_cache"}


def verdict(test_id: str) -> compat.CpuVerdict:
    if test_id == "kv-cache-fp8":
        return compat.VLLM_CPU_KV_CACHE
    return compat.VLLM_CPU[compat.cpu_kind(QuantizationScheme.from_args(**scheme_arguments(test_id)))]


def build_checkpoint(path: Path, kwargs: dict) -> list[str]:
    """Quantizes the tiny Llama with ``kwargs`` and saves it to ``path``; returns the save warnings' messages."""
    config = transformers.LlamaConfig(**SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_GAIN)
    qfp8.quantize(model, **kwargs)
    if kwargs.get("activations") == "static" or kwargs.get("kv_cache"):
        with qfp8.calibrate(model), torch.no_grad():
            model(torch.randint(0, SIZES["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, path)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def checkpoint_kv_scales(path: Path) -> list[list[float]]:
    """[k_scale, v_scale] per layer of a checkpoint, as vLLM reports them."""
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        layers = range(SIZES["num_hidden_layers"])
        name = "model.layers.{}.self_attn.{}"
        return [
            [f.get_tensor(name.format(i, "k_scale")).item(), f.get_tensor(name.format(i, "v_scale")).item()]
            for i in layers
        ]


def reference_checkpoint(test_id: str, result: dict) -> str:
    """The checkpoint whose qfp8 run vLLM's ``result`` is compared with: the scheme vLLM computes (compat's
    runs_as), or the checkpoint's own where vLLM picked a kernel that computes it (W8A8 block on AMX-FP8)."""
    if test_id == "kv-cache-fp8":
        return NEAREST_KEYS
    runs_as = verdict(test_id).runs_as
    if runs_as is None or any("W8A8BlockScaledMM" in kernel for kernel in result.get("kernels", [])):
        return test_id
    (match,) = [other for other, kwargs in SCHEMES.items() if kwargs == runs_as]
    return match


def qfp8_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """qfp8's teacher-forced log-probabilities: row i predicts prompt token i + 1."""
    model = qfp8.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def served(vllm_python_or_skip, tmp_path_factory):
    """test id -> (qfp8's log-probabilities, vLLM's result); vLLM's version under "vllm", and each checkpoint's
    save warnings under "warned"."""
    root = tmp_path_factory.mktemp("vllm")
    prompt = torch.randint(0, SIZES["vocab_size"], (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    warned = {test_id: build_checkpoint(root / test_id, kwargs) for test_id, kwargs in SCHEMES.items()}
    build_checkpoint(root / QFP8_ONLY, QFP8_ONLY_ARGUMENTS)
    # vLLM rounds keys to nearest: qfp8's compensated key rounding (a file beside the weights) is qfp8's own
    shutil.copytree(root / "kv-cache-fp8", root / NEAREST_KEYS, ignore=shutil.ignore_patterns(KV_ROUNDING_FILE))
    names = list(SCHEMES)
    served_names = [*names, QFP8_ONLY]
    job = {"prompt": prompt, "logprobs": 2, "checkpoints": [{"name": n, "path": str(root / n)} for n in served_names]}
    (root / "job.json").write_text(json.dumps(job))
    serve = Path(__file__).with_name("serve.py")
    done = subprocess.run(
        [vllm_python_or_skip, str(serve), str(root / "job.json")],
        capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, cwd=root,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"serve.py exited with {done.returncode}:\n{done.stderr[-4000:]}")
    output = json.loads(done.stdout.strip().splitlines()[-1])
    (root / "results.json").write_text(json.dumps(output))  # for a reader of a failure
    results = output["results"]
    reference = {n: qfp8_logprobs(root / reference_checkpoint(n, results[n]), prompt) for n in names}
    return {
        "vllm": output["vllm"],
        "kv_scales": checkpoint_kv_scales(root / "kv-cache-fp8"),
        "warned": warned,
        **{n: (reference[n], results[n]) for n in names},
        QFP8_ONLY: (None, results[QFP8_ONLY]),
    }


@dataclass(frozen=True)
class Rule:
    """How closely vLLM's teacher-forced log-probabilities must follow qfp8's (nats)."""

    margin: float  # positions compared: qfp8's top-1 minus top-2 log-probability at least this
    mean: float  # mean |vLLM - qfp8| of the top-1 token's log-probability over compared positions, at most
    worst: float  # and at most this at any compared position


# Both engines quantize activations per token with the same scales; they differ by bf16 rounding and the odd FP8
# activation code rounded the other way (measured: mean 0.02, max 0.16 nats, logits spread by HEAD_GAIN).
RULE = Rule(margin=0.25, mean=0.06, worst=0.3)
# An FP8 KV cache is rounded by each engine its own way (vLLM's CPU attention kernel, qfp8's cache): each moves
# log-probabilities by ~0.06 nats on average from its bf16-cache run, so they differ by about 0.1 between them.
KV_RULE = Rule(margin=1.0, mean=0.15, worst=0.6)


def agreement(reference: torch.Tensor, result: dict, rule: Rule) -> tuple[list[float], list[str]]:
    """(|vLLM - qfp8| per compared position, top-1 disagreements) of vLLM's prompt log-probabilities."""
    differences, wrong = [], []
    for position, entries in enumerate(result["prompt_logprobs"]):
        if entries is None:
            continue  # the first token has no prediction
        top = reference[position - 1].topk(2)
        if top.values[0] - top.values[1] < rule.margin:
            continue
        token, logprob = entries[0]
        if int(token) != int(top.indices[0]):
            wrong.append(f"position {position}: vLLM top-1 {token}, qfp8 {int(top.indices[0])}")
        differences.append(abs(logprob - float(reference[position - 1, int(token)])))
    return differences, wrong


def assert_agrees(reference: torch.Tensor, result: dict, rule: Rule = RULE) -> None:
    assert result["stage"] == "ok", (
        f"vLLM failed at {result['stage']}: {result.get('error')}\n{result.get('traceback')}"
    )
    differences, wrong = agreement(reference, result, rule)
    assert len(differences) >= (PROMPT_LENGTH - 1) // 2, f"{len(differences)} positions with a margin >= {rule.margin}"
    assert not wrong, f"{len(wrong)} of {len(differences)} clear-margin positions disagree: " + "; ".join(wrong)
    mean, worst = sum(differences) / len(differences), max(differences)
    assert mean <= rule.mean and worst <= rule.worst, f"|vLLM - qfp8| log-probability: mean {mean:.4f}, max {worst:.4f}"


def test_vllm_is_the_version_the_table_describes(served):
    assert served["vllm"] == compat.VLLM_CPU_VERSION, (
        f"vLLM {served['vllm']} runs these tests; qfp8.checkpoint.compat describes {compat.VLLM_CPU_VERSION}: "
        "install that version (docs/vllm.md), or check the table against this one and update VLLM_CPU_VERSION"
    )


@pytest.mark.parametrize("test_id", list(SCHEMES))
def test_vllm_cpu_does_what_the_table_says(served, test_id):
    reference, result = served[test_id]
    expected = verdict(test_id)
    if compat.serves_here(expected):
        assert_agrees(reference, result, KV_RULE if test_id == "kv-cache-fp8" else RULE)
    else:
        assert result["stage"] == expected.stage, f"expected a failure at {expected.stage}, got {result['stage']}"
        assert expected.error in result["error"], result["error"]


VLLM_FAULTS = [test_id for test_id in SCHEMES if verdict(test_id).vllm_fault]


@pytest.mark.parametrize(
    "test_id",
    [pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=verdict(t).why)) for t in VLLM_FAULTS],
)
def test_vllm_cpu_serves_what_it_should(served, test_id):
    """Checkpoints vLLM on GPU runs, which the CPU engine of this vLLM version does not (its fault, not qfp8's)."""
    assert_agrees(*served[test_id])


@pytest.mark.parametrize("test_id", list(SCHEMES))
def test_save_warns_what_vllm_cpu_cannot_run(served, test_id):
    """save_pretrained warns about vLLM's CPU engine exactly for the layer schemes it does not serve on every CPU
    (an FP8 KV cache's need for AVX-512 goes to qfp8 inspect's "serves on" line only)."""
    expected = compat.VLLM_CPU[compat.cpu_kind(QuantizationScheme.from_args(**scheme_arguments(test_id)))]
    warned = [m for m in served["warned"][test_id] if m.startswith("vLLM's CPU engine")]
    if expected.serves == "yes":
        assert warned == []
    else:
        assert len(warned) == 1 and expected.why in warned[0], served["warned"][test_id]


def test_every_kind_of_the_table_is_run():
    """Each kind of scheme compat.VLLM_CPU describes is among the checkpoints served, with its example."""
    kinds = {compat.cpu_kind(QuantizationScheme.from_args(**kwargs)) for kwargs in map(scheme_arguments, SCHEMES)}
    assert kinds == set(compat.VLLM_CPU)
    examples = [scheme_arguments(test_id) for test_id in SCHEMES]
    for kind, entry in compat.VLLM_CPU.items():
        assert entry.example in examples, kind
        assert compat.cpu_kind(QuantizationScheme.from_args(**entry.example)) == kind
        assert entry.runs_as is None or entry.runs_as in SCHEMES.values(), kind
        assert entry.serves == "yes" or entry.remedy, f"{kind}: the save warning names no remedy"
    assert compat.VLLM_CPU_KV_CACHE.example == SCHEMES["kv-cache-fp8"]


def test_docs_matrix_is_the_table():
    """docs/vllm.md's matrix, between its markers, is compat.markdown_matrix()'s output."""
    text = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    start = text.index("<!-- vllm-cpu-matrix")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end vllm-cpu-matrix -->")
    assert text[start:end].strip() == compat.markdown_matrix()


def test_vllm_cpu_fp8_kv_cache_reads_qfp8_scales(served):
    """vLLM stores K and V in FP8 with the checkpoint's calibrated scales, and its FP8 cache costs about what
    qfp8's does: its log-probabilities move from its own bf16-cache run (the same weights) by at most twice what
    qfp8's move from qfp8's bf16-cache run."""
    if not compat.serves_here(compat.VLLM_CPU_KV_CACHE):
        pytest.skip("vLLM's FP8 KV cache needs AVX-512 or AMX (test_vllm_cpu_does_what_the_table_says checks it fails)")
    reference, result = served["kv-cache-fp8"]
    assert result["kv_cache_dtypes"] == ["fp8"], result["kv_cache_dtypes"]
    assert result["kv_scales"] == served["kv_scales"], (result["kv_scales"], served["kv_scales"])
    bf16_reference, bf16_result = served["w8a8-token"]
    vllm_moved, qfp8_moved = [], []
    for position, (entries, bf16_entries) in enumerate(
        zip(result["prompt_logprobs"], bf16_result["prompt_logprobs"], strict=True)
    ):
        if entries is None:
            continue
        token, logprob = entries[0]
        (bf16_logprob,) = [lp for t, lp in bf16_entries if t == token] or [None]
        if bf16_logprob is None:
            continue  # the other run's top-2 lacks this token
        vllm_moved.append(abs(logprob - bf16_logprob))
        qfp8_moved.append(abs(float(reference[position - 1, token] - bf16_reference[position - 1, token])))
    assert len(vllm_moved) >= (PROMPT_LENGTH - 1) // 2
    vllm_mean, qfp8_mean = sum(vllm_moved) / len(vllm_moved), sum(qfp8_moved) / len(qfp8_moved)
    assert 0 < vllm_mean <= 2 * qfp8_mean, (
        f"FP8 KV cache moves log-probabilities: vLLM {vllm_mean:.4f}, qfp8 {qfp8_mean:.4f}"
    )


def test_vllm_refuses_a_qfp8_only_checkpoint(served):
    """A checkpoint marked qfp8_method 'qfp8' (here e5m2 weights) fails to load in vLLM instead of running wrong."""
    _, result = served[QFP8_ONLY]
    assert result["stage"] == "load" and "weight_scale" in result["error"], result.get("error")
