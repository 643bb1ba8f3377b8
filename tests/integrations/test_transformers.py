"""qfp8 inside transformers: ``from_pretrained(..., quantization_config=qfp8.Qfp8Config(...))`` on a float checkpoint,
``config=Qfp8Config().for_checkpoint(path)`` on pre-quantized ones, and transformers' own ``save_pretrained``.

Runs on the installed transformers (5.x) and, unchanged, on 4.57 (the integration supports both hook sets).
"""

from __future__ import annotations

import json
import warnings

import pytest
import safetensors.torch
import torch

import qfp8
from qfp8 import formats
from qfp8.nn import QLinear

transformers = pytest.importorskip("transformers", reason="the integration tests load transformers models")

SCHEMES = {
    "w-channel": dict(),
    "w-tensor-a-dynamic": dict(weight_scale="tensor", activations="dynamic"),
    "w-block-a-group": dict(weight_scale="block", block_size=(32, 32), activations="dynamic", activation_scale="group"),
}


def qlinears(model) -> dict[str, QLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QLinear)}


def assert_same_fp8(a, b):
    """Same QLinears, same FP8 bytes and scales (canonical form), bit for bit."""
    first, second = qlinears(a), qlinears(b)
    assert first.keys() == second.keys() and len(first) == 14
    for name, module in first.items():
        other = second[name]
        assert torch.equal(module.canonical_weight().view(torch.uint8), other.canonical_weight().view(torch.uint8))
        assert torch.equal(module.weight_scale, other.weight_scale), name


@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_quantizing_while_loading_equals_quantize_of_the_loaded_model(helpers, float_checkpoint, scheme):
    bf16 = helpers.dtype_argument(torch.bfloat16)
    reference = helpers.load(float_checkpoint, **bf16)
    qfp8.quantize(reference, **scheme)
    loaded = helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(**scheme), **bf16)
    assert_same_fp8(loaded, reference)
    assert type(loaded.lm_head) is torch.nn.Linear  # the default exclude
    assert all(m.packing == reference.get_submodule(n).packing for n, m in qlinears(loaded).items())
    assert torch.equal(helpers.logits(loaded), helpers.logits(reference))
    report = loaded.qfp8_report
    assert len(report.quantized) == 14 and [e.name for e in report.skipped] == ["lm_head"]


@pytest.mark.parametrize("device_map", ["auto", "cpu", {"": "cpu"}], ids=["auto", "cpu", "dict"])
def test_a_device_map_on_one_device_loads_the_same_model(helpers, float_checkpoint, device_map):
    bf16 = helpers.dtype_argument(torch.bfloat16)
    plain = helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(), **bf16)
    mapped = helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(), device_map=device_map, **bf16)
    assert_same_fp8(mapped, plain)
    assert torch.equal(helpers.logits(mapped), helpers.logits(plain))


def test_a_quantization_config_dict_naming_qfp8_works(helpers, float_checkpoint):
    loaded = helpers.load(float_checkpoint, quantization_config={"quant_method": "qfp8", "weight_scale": "tensor"})
    assert len(qlinears(loaded)) == 14
    assert all(m.weight_scale.shape == (1,) for m in qlinears(loaded).values())


def write_vllm_fp8(model, path, block=None):
    """An AutoFP8 / vLLM ``quant_method: "fp8"`` checkpoint of ``model`` (0-dim per-tensor scales), or with ``block``
    a DeepSeek-V3 / Qwen3-FP8 style one (``weight_scale_inv`` per block)."""
    model.save_pretrained(path)
    state = safetensors.torch.load_file(path / "model.safetensors")
    for key in [k for k in state if k.endswith("proj.weight")]:
        if block:
            q, scale = formats.quantize_weight(state[key].float(), torch.float8_e4m3fn, "block", block)
            state[key], state[key + "_scale_inv"] = q, scale
        else:
            q, scale = formats.quantize_weight(state[key].float(), torch.float8_e4m3fn, "tensor")
            state[key], state[key + "_scale"] = q, scale.reshape(())
    safetensors.torch.save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block:
        config["quantization_config"]["weight_block_size"] = list(block)
    (path / "config.json").write_text(json.dumps(config))
    return state


@pytest.mark.filterwarnings("ignore:.*weight_block_size .*differ by that rounding")
@pytest.mark.parametrize("kind", ["qfp8", "llm-compressor-fp8-dynamic", "vllm-fp8", "block-fp8"])
def test_a_pre_quantized_checkpoint_keeps_its_bytes_and_matches_qfp8_from_pretrained(helpers, tmp_path, kind):
    model = helpers.float_model()
    folder = tmp_path / kind
    if kind == "qfp8":
        qfp8.quantize(model, weight_scale="tensor")
        qfp8.save_pretrained(model, folder)
    elif kind == "llm-compressor-fp8-dynamic":  # FP8_DYNAMIC: channel weights, dynamic per-token activations
        qfp8.quantize(model, activations="dynamic")
        qfp8.save_pretrained(model, folder)
    else:
        write_vllm_fp8(model, folder, block=(32, 32) if kind == "block-fp8" else None)
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    bf16 = helpers.dtype_argument(torch.bfloat16)
    config = qfp8.Qfp8Config().for_checkpoint(folder)
    through_transformers = helpers.load(folder, config=config, **bf16)
    through_qfp8 = qfp8.from_pretrained(folder, dtype=torch.bfloat16)
    assert_same_fp8(through_transformers, through_qfp8)
    q_proj = through_transformers.model.layers[1].self_attn.q_proj
    key = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(q_proj.canonical_weight().view(torch.uint8), stored[key].view(torch.uint8))
    scale = stored.get(key + "_scale", stored.get(key + "_scale_inv")).float().reshape(-1)
    # qfp8 stores a per-tensor scale in every row of a channel scale: the loaded one value is each row's
    assert torch.equal(q_proj.weight_scale.reshape(-1).expand_as(scale), scale)
    assert torch.equal(helpers.logits(through_transformers), helpers.logits(through_qfp8))


def test_transformers_save_pretrained_writes_the_compressed_tensors_checkpoint(helpers, tmp_path):
    model = helpers.float_model()
    qfp8.quantize(model, weight_scale="tensor", activations="dynamic")
    model.save_pretrained(tmp_path / "transformers")
    qfp8.save_pretrained(model, tmp_path / "qfp8")
    config = helpers.read_config(tmp_path / "transformers")
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc == helpers.read_config(tmp_path / "qfp8")["quantization_config"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    theirs = safetensors.torch.load_file(tmp_path / "transformers" / "model.safetensors")
    ours = safetensors.torch.load_file(tmp_path / "qfp8" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        assert theirs[key].dtype == value.dtype and torch.equal(theirs[key].view(torch.uint8), value.view(torch.uint8))

    expected = helpers.logits(model)
    by_qfp8 = qfp8.from_pretrained(tmp_path / "transformers")
    bf16 = helpers.dtype_argument(torch.bfloat16)
    by_transformers = helpers.load(
        tmp_path / "transformers", config=qfp8.Qfp8Config().for_checkpoint(tmp_path / "transformers"), **bf16
    )
    assert torch.equal(helpers.logits(by_qfp8), expected)
    assert torch.equal(helpers.logits(by_transformers), expected)
    # transformers' compressed-tensors loader reads it too (dequantizing: close, not bit for bit).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = helpers.load(tmp_path / "transformers", **bf16)
    assert formats.sqnr(helpers.logits(plain).float(), expected.float()) > 25


def test_a_model_loaded_through_qfp8config_saves_and_reloads(helpers, float_checkpoint, tmp_path):
    bf16 = helpers.dtype_argument(torch.bfloat16)
    loaded = helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(weight_scale="tensor"), **bf16)
    loaded.save_pretrained(tmp_path / "saved")
    assert helpers.read_config(tmp_path / "saved")["quantization_config"]["format"] == "float-quantized"
    assert torch.equal(helpers.logits(qfp8.from_pretrained(tmp_path / "saved")), helpers.logits(loaded))


def test_saving_the_model_around_a_quantized_submodel_writes_its_config(helpers, tmp_path):
    """quantize(m.model) and then m.save_pretrained: the two share one config, which carries the quantization."""
    model = helpers.float_model()
    qfp8.quantize(model.model)
    model.save_pretrained(tmp_path / "outer")
    assert helpers.read_config(tmp_path / "outer")["quantization_config"]["format"] == "float-quantized"
    assert torch.equal(helpers.logits(qfp8.from_pretrained(tmp_path / "outer")), helpers.logits(model))


def test_static_activations_without_calibration_warn_and_refuse_to_save(helpers, float_checkpoint, tmp_path):
    bf16 = helpers.dtype_argument(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"needs calibration data .*qfp8\.calibrate\(model\)"):
        loaded = helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(activations="static"), **bf16)
    with pytest.raises(RuntimeError, match="never calibrated"):
        loaded.save_pretrained(tmp_path / "uncalibrated")
    assert not list((tmp_path / "uncalibrated").glob("*.safetensors"))
    with qfp8.calibrate(loaded):  # the documented two-step
        loaded(helpers.tokens(seed=3))
    qfp8.freeze(loaded)
    loaded.save_pretrained(tmp_path / "calibrated")
    assert torch.equal(helpers.logits(qfp8.from_pretrained(tmp_path / "calibrated")), helpers.logits(loaded))


def test_the_calibration_argument_calibrates_as_qfp8_calibrate_does(helpers, float_checkpoint):
    bf16 = helpers.dtype_argument(torch.bfloat16)
    batches = [helpers.tokens(seed=3), {"input_ids": helpers.tokens(seed=4)}]
    config = qfp8.Qfp8Config(activations="static", kv_cache="float8_e4m3fn", calibration=batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "needs calibration" warning
        loaded = helpers.load(float_checkpoint, quantization_config=config, **bf16)
    reference = helpers.load(float_checkpoint, **bf16)
    qfp8.quantize(reference, activations="static", kv_cache="float8_e4m3fn")
    with torch.no_grad(), qfp8.calibrate(reference):
        reference(batches[0])
        reference(**batches[1])
    qfp8.freeze(reference)
    assert all(m.input_scale is not None for m in qlinears(loaded).values())
    assert torch.equal(helpers.logits(loaded), helpers.logits(reference))
    assert "calibration" not in loaded.config.to_dict().get("quantization_config", {})


# ---------------------------------------------------------------- bad input


def test_an_unknown_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['weight'\]"):
        qfp8.Qfp8Config(weight="float8_e4m3fn")
    with pytest.raises(ValueError, match="Qfp8Config: unknown FP8 dtype 'int8'"):
        qfp8.Qfp8Config(weights="int8")
    with pytest.raises(ValueError, match="kv_cache"):
        qfp8.Qfp8Config(kv_cache="int8")
    with pytest.raises(TypeError, match="calibration must be an iterable"):
        qfp8.Qfp8Config(activations="static", calibration=3)


def test_a_scheme_the_checkpoint_cannot_give_names_the_argument_and_file(helpers, tmp_path):
    model = helpers.float_model()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "e4m3")
    for config, argument in [
        (qfp8.Qfp8Config(weights="float8_e5m2"), "weights"),
        (qfp8.Qfp8Config(weight_scale="tensor"), "weight_scale"),
        (qfp8.Qfp8Config(exclude=()), "exclude"),
    ]:
        with pytest.raises(ValueError, match=rf"Qfp8Config\({argument}=.*e4m3"):
            helpers.load(tmp_path / "e4m3", config=config.for_checkpoint(tmp_path / "e4m3"))


def test_a_checkpoint_qfp8_cannot_read_names_the_file(helpers, tmp_path):
    model = helpers.float_model()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "int")
    config = helpers.read_config(tmp_path / "int")
    config["quantization_config"]["format"] = "int-quantized"
    (tmp_path / "int" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"int/config\.json: compressed-tensors format 'int-quantized' is not FP8"):
        helpers.load(tmp_path / "int", config=qfp8.Qfp8Config().for_checkpoint(tmp_path / "int"))


def test_a_weight_fp8_cannot_hold_is_refused_naming_the_module(helpers, float_checkpoint):
    state = safetensors.torch.load_file(float_checkpoint / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    safetensors.torch.save_file(state, float_checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"module 'model\.layers\.1\.mlp\.up_proj'.*NaN/Inf"):
        helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config())


def test_for_checkpoint_of_a_float_checkpoint_points_to_quantization_config(float_checkpoint):
    with pytest.raises(ValueError, match=r"no quantization_config .*quantization_config=Qfp8Config"):
        qfp8.Qfp8Config().for_checkpoint(float_checkpoint)


def test_a_device_map_over_several_devices_is_refused_before_loading(helpers, float_checkpoint):
    device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    device_map["model.rotary_emb"] = "cpu"
    with pytest.raises(ValueError, match=r"spreads the model .*qfp8\.from_pretrained"):
        helpers.load(float_checkpoint, quantization_config=qfp8.Qfp8Config(), device_map=device_map)


def test_qfp8config_registers_qfp8_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    from qfp8.integrations.transformers_quantizer import Qfp8HfQuantizer

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["qfp8"] is qfp8.Qfp8Config
    assert AUTO_QUANTIZER_MAPPING["qfp8"] is Qfp8HfQuantizer
    config = qfp8.Qfp8Config(weight_scale="block", block_size=(64, 64), exclude=["lm_head", "*.down_proj"])
    again = qfp8.Qfp8Config.from_dict(json.loads(config.to_json_string()))
    assert again.to_dict() == config.to_dict() and again.quantize_arguments() == config.quantize_arguments()
