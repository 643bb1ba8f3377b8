"""Where a checkpoint serves (qfp8.checkpoint.compat): the save warnings and ``qfp8 inspect``'s "serves on" line.

What vLLM's CPU engine really does with each scheme is checked against the same table in tests/vllm.
"""

from __future__ import annotations

import warnings

import pytest

import qfp8
from qfp8.checkpoint import compat
from qfp8.checkpoint.inspect import describe, format_description
from qfp8.checkpoint.stream import stream_quantize
from qfp8.nn.scheme import QuantizationScheme

# Every dimension a multiple of 128, so that block and group schemes break no vLLM shape rule.
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)
CPU_WARNING = "vLLM's CPU engine"


def saved(tiny, path, **kwargs) -> list[str]:
    """Quantizes and saves the aligned tiny Llama; returns the save warnings' messages."""
    model = tiny.model(**ALIGNED)
    qfp8.quantize(model, **kwargs)
    if kwargs.get("activations") == "static" or kwargs.get("kv_cache"):
        with qfp8.calibrate(model):
            model(tiny.tokens())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, path)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    "kwargs, cpu",
    [
        (dict(), "no"),
        (dict(activations="dynamic"), "yes"),
        (dict(activations="dynamic", activation_scale="tensor"), "yes"),
        (dict(weight_scale="block", activations="dynamic", activation_scale="group"), "only on CPUs with AMX"),
        (dict(activations="static"), "no"),
        (dict(weight_scale="tensor", activations="dynamic"), "yes"),
        (dict(weight_scale="tensor", activations="static"), "no"),
        (dict(weight_scale="tensor"), "no"),
    ],
    ids=[
        "w8a16",
        "w8a8-token",
        "w8a8-tensor-act",
        "w8a8-block-group",
        "w8a8-static",
        "w8a8-tensor-weights",
        "w8a8-static-tensor-weights",
        "w8a16-tensor",
    ],  # fmt: skip
)
def test_serves_on_and_the_save_warning_follow_the_table(tiny, tmp_path, kwargs, cpu):
    messages = saved(tiny, tmp_path, **kwargs)
    cpu_messages = [m for m in messages if m.startswith(CPU_WARNING)]
    verdict = compat.VLLM_CPU[compat.cpu_kind(QuantizationScheme.from_args(**kwargs))]
    if cpu == "yes":
        assert messages == []
    else:
        assert len(messages) == 1 and len(cpu_messages) == 1, messages
        assert verdict.why in cpu_messages[0] and "14 modules" in cpu_messages[0]
        assert f"For vLLM's CPU engine use {verdict.remedy}" in cpu_messages[0]
    info = describe(tmp_path)
    assert info["serves_on"] == {"qfp8": "yes", "transformers": "yes", "vLLM GPU": "yes", "vLLM CPU": cpu}
    assert f"serves on: qfp8 yes, transformers yes, vLLM GPU yes, vLLM CPU {cpu}" in format_description(info)
    assert len(info["vllm_cpu"]) == (cpu != "yes")


def test_an_fp8_kv_cache_serves_on_cpus_with_avx512(tiny, tmp_path):
    assert saved(tiny, tmp_path, activations="dynamic", kv_cache="float8_e4m3fn") == []
    assert describe(tmp_path)["serves_on"]["vLLM CPU"] == "only on CPUs with AVX-512 or AMX"


def test_a_checkpoint_vllm_refuses_serves_on_neither_vllm_engine(tiny, tmp_path):
    model = tiny.model(**ALIGNED)
    qfp8.quantize(model, activations="dynamic", exclude=())  # a quantized lm_head: vLLM's loader fails
    with pytest.warns(UserWarning, match="vLLM cannot load or run"):
        qfp8.save_pretrained(model, tmp_path)
    assert describe(tmp_path)["serves_on"] == {"qfp8": "yes", "transformers": "yes", "vLLM GPU": "no", "vLLM CPU": "no"}


def test_a_qfp8_only_checkpoint_serves_on_qfp8_only(tiny, tmp_path):
    messages = saved(tiny, tmp_path, weights="float8_e5m2", activations="dynamic")
    assert len(messages) == 1 and "qfp8_method" in messages[0]  # no CPU line: no other reader takes it at all
    assert describe(tmp_path)["serves_on"] == {"qfp8": "yes", "transformers": "no", "vLLM GPU": "no", "vLLM CPU": "no"}


def test_qfp8_quantize_warns_what_vllm_cpu_cannot_run(tiny, tmp_path):
    tiny.model(**ALIGNED).save_pretrained(tmp_path / "float")
    with pytest.warns(UserWarning, match="(?s)vLLM's CPU engine.*no FP8 weight-only"):
        stream_quantize(tmp_path / "float", tmp_path / "w8a16", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream_quantize(tmp_path / "float", tmp_path / "w8a8", activations="dynamic", progress=False)
    assert describe(tmp_path / "w8a8")["serves_on"]["vLLM CPU"] == "yes"
