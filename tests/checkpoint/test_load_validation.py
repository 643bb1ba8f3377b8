"""Scales, KV-cache scales and config types are checked at load: refused by name, never loaded into NaN or zeros."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import qfp8
from qfp8.checkpoint.validate import largest_scale


def _rewrite(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _calibrated(tiny, folder, **kwargs):
    model = tiny.model()
    qfp8.quantize(model, **kwargs)
    with qfp8.calibrate(model):
        model(tiny.tokens())
    qfp8.save_pretrained(model, folder)
    return model


@pytest.fixture
def saved_static(tiny, tmp_path):
    _calibrated(tiny, tmp_path, weight_scale="channel", activations="static", kv_cache="float8_e4m3fn")
    return tmp_path


def test_the_bound_is_float32_max_over_fmax():
    assert largest_scale(torch.float8_e4m3fn) == pytest.approx(3.4028234663852886e38 / 448)
    assert 7.5e35 < largest_scale(torch.float8_e4m3fn) < 7.6e35
    assert largest_scale(torch.float8_e5m2) == pytest.approx(3.4028234663852886e38 / 57344)


LARGE = ["model.layers.0.mlp.up_proj.weight_scale", "model.layers.1.self_attn.k_scale", "model.layers.0.mlp.down_proj.input_scale",
         "model.layers.1.self_attn.v_scale"]  # fmt: skip


@pytest.mark.parametrize("key", LARGE, ids=["weight", "k", "input", "v"])
def test_a_scale_above_the_bound_is_refused_naming_tensor_and_file(saved_static, key):
    def change(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][0] = 1e37

    _rewrite(saved_static, change)
    with pytest.raises(ValueError, match=rf"model\.safetensors: {re.escape(key)} holds 1 value\(s\) above 7\.6e\+35"):
        qfp8.from_pretrained(saved_static)


def test_the_largest_scales_qfp8_writes_load(tiny, tmp_path):
    """Weights near the float32 maximum give scales just under the bound: they load, and dequantize finite."""
    model = tiny.model()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0] = 3.0e38
    qfp8.quantize(model, weight_scale="channel")
    scale = model.model.layers[0].mlp.up_proj.weight_scale
    assert scale.max() > 0.8 * largest_scale(torch.float8_e4m3fn)
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight_scale, scale)


@pytest.mark.parametrize("missing", [["model.layers.1.self_attn.k_scale"], ["model.layers.0.self_attn.v_scale"]])
def test_one_missing_kv_scale_is_refused_naming_it(saved_static, missing):
    _rewrite(saved_static, lambda tensors: [tensors.pop(key) for key in missing])
    with pytest.raises(ValueError, match=rf"lacks 1 scale\(s\) although it stores 3 of them: {re.escape(missing[0])}"):
        qfp8.from_pretrained(saved_static)


def test_a_static_kv_scheme_with_no_scales_is_refused(saved_static):
    _rewrite(saved_static, lambda t: [t.pop(k) for k in list(t) if k.endswith(("k_scale", "v_scale"))])
    with pytest.raises(ValueError, match=r"lacks 4 scale\(s\) although its kv_cache_scheme is static"):
        qfp8.from_pretrained(saved_static)


def test_a_dynamic_kv_scheme_without_scales_still_loads(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="channel", kv_cache="float8_e4m3fn")
    with pytest.warns(UserWarning, match="not calibrated"):
        qfp8.save_pretrained(model, tmp_path)
    assert qfp8.from_pretrained(tmp_path).qfp8_kv_cache_dtype == torch.float8_e4m3fn


def test_an_e5m2_cache_whose_dtype_key_is_dropped_is_refused(tiny, tmp_path):
    with pytest.warns(UserWarning, match="float8_e5m2"):
        _calibrated(tiny, tmp_path, weight_scale="channel", kv_cache="float8_e5m2")
    assert qfp8.from_pretrained(tmp_path).qfp8_kv_cache_dtype == torch.float8_e5m2
    _edit_config(tmp_path, lambda c: c["quantization_config"].pop("qfp8_kv_cache_dtype"))
    with pytest.raises(ValueError, match=r"config\.json: .*no qfp8_kv_cache_dtype key"):
        qfp8.from_pretrained(tmp_path)


def test_a_qfp8_marked_config_always_names_its_kv_dtype(tiny, tmp_path):
    with pytest.warns(UserWarning, match="e5m2"):
        _calibrated(tiny, tmp_path, weights="float8_e5m2", weight_scale="channel", kv_cache="float8_e4m3fn")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["qfp8_method"] == "qfp8" and qc["qfp8_kv_cache_dtype"] == "float8_e4m3fn"


def _group(config):
    return next(iter(config["quantization_config"]["config_groups"].values()))


WRONG_TYPES = {
    "dynamic-string": (lambda c: _group(c)["input_activations"].__setitem__("dynamic", "false"),
                       r"input_activations\.dynamic must be true, false or 'local', got 'false'"),
    "num-bits-string": (lambda c: _group(c)["weights"].__setitem__("num_bits", "8"), r"weights\.num_bits must be an int"),
    "num-bits-bool": (lambda c: _group(c)["weights"].__setitem__("num_bits", True), r"weights\.num_bits must be an int"),
    "symmetric-string": (lambda c: _group(c)["weights"].__setitem__("symmetric", "true"), r"symmetric must be true or"),
    "strategy-list": (lambda c: _group(c)["weights"].__setitem__("strategy", ["channel"]), r"strategy must be a string"),
    "kv-dynamic-int": (lambda c: c["quantization_config"]["kv_cache_scheme"].__setitem__("dynamic", 0),
                       r"kv_cache_scheme\.dynamic must be"),
    "format-int": (lambda c: c["quantization_config"].__setitem__("format", 3), r"quantization_config\.format must be"),
    "kv-dtype-list": (lambda c: c["quantization_config"].__setitem__("qfp8_kv_cache_dtype", ["float8_e5m2"]),
                      r"qfp8_kv_cache_dtype must be a string"),
    "architectures-string": (lambda c: c.__setitem__("architectures", "LlamaForCausalLM"), r"architectures must be a list"),
}  # fmt: skip


@pytest.mark.parametrize("edit, match", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_config_values_of_the_wrong_type_are_refused_naming_file_and_key(saved_static, edit, match):
    _edit_config(saved_static, edit)
    with pytest.raises(ValueError, match=rf"config\.json: .*{match}"):
        qfp8.from_pretrained(saved_static)


def test_dynamic_false_as_a_string_is_refused_as_compressed_tensors_does(saved_static):
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    _edit_config(saved_static, WRONG_TYPES["dynamic-string"][0])
    qc = json.loads((saved_static / "config.json").read_text())["quantization_config"]
    with pytest.raises(ValidationError, match="not a valid DynamicType"):
        QuantizationConfig.model_validate(qc)
    with pytest.raises(ValueError, match="dynamic must be true, false or 'local'"):
        qfp8.from_pretrained(saved_static)


@pytest.mark.parametrize("edit", ["drop", "dynamic"])
def test_stored_static_input_scales_are_never_dropped_silently(saved_static, edit):
    """A config that no longer says static (input_activations removed, or dynamic) while the file holds the
    calibrated input scales: refused, rather than run without them."""

    def change(config):
        if edit == "drop":
            _group(config)["input_activations"] = None
        else:
            _group(config)["input_activations"].update(dynamic=True, strategy="token")

    _edit_config(saved_static, change)
    with pytest.raises(ValueError, match=r"config\.json: module '.*' \(and \d+ more\) stores a static input_scale"):
        qfp8.from_pretrained(saved_static)
