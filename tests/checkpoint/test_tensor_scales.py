"""Per-tensor weight scales on disk: written as channel scales (one value in every row), read back per tensor.

See qfp8/checkpoint/tensor_scales.py and docs/checkpoints.md.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import qfp8
from qfp8.checkpoint.inspect import describe
from qfp8.checkpoint.stream import stream_quantize

TENSOR_SCHEMES = {
    "w8a16-tensor": dict(weight_scale="tensor"),
    "w8a8-tensor-token": dict(weight_scale="tensor", activations="dynamic"),
    "w8a8-tensor-static": dict(weight_scale="tensor", activations="static"),
}
KEY = "qfp8_tensor_weight_groups"
SCALE = "model.layers.1.self_attn.q_proj.weight_scale"


def read_config(path):
    return json.loads((path / "config.json").read_text())


def write_config(path, config):
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kwargs", TENSOR_SCHEMES.values(), ids=TENSOR_SCHEMES.keys())
def test_per_tensor_scales_are_written_per_row_and_read_back_as_one(tiny, tmp_path, x, kwargs):
    model = tiny.quantized(**kwargs)
    qfp8.save_pretrained(model, tmp_path)
    qc = read_config(tmp_path)["quantization_config"]
    assert qc[KEY] == ["group_0"] and qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    compressed_tensors = pytest.importorskip("compressed_tensors", reason="validates the config with its schema")
    compressed_tensors.quantization.QuantizationConfig.model_validate(qc)  # the extra top-level key is accepted
    stored = tiny.tensors(tmp_path)
    modules = tiny.qlinears(model)
    assert len(modules) == 14
    for name, module in modules.items():
        scale = stored[name + ".weight_scale"]
        assert scale.shape == (module.out_features, 1) and scale.dtype == torch.float32, name
        assert torch.equal(scale, module.weight_scale.expand(module.out_features, 1)), name
    saved_scheme = next(iter(modules.values())).scheme.describe()  # qfp8 inspect names the scheme saved
    assert "-tensor " in saved_scheme and {g["scheme"] for g in describe(tmp_path)["groups"]} == {saved_scheme}
    loaded = qfp8.from_pretrained(tmp_path)
    for name, module in tiny.qlinears(loaded).items():
        assert module.scheme == modules[name].scheme and module.scheme.weight_scale == "tensor", name
        assert module.weight_scale.shape == (1,) and torch.equal(module.weight_scale, modules[name].weight_scale)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_the_stream_writes_per_tensor_scales_as_save_pretrained_does(tiny, tmp_path):
    tiny.model(torch.bfloat16).save_pretrained(tmp_path / "float")
    stream_quantize(tmp_path / "float", tmp_path / "stream", weight_scale_granularity="tensor", progress=False)
    model = tiny.model(torch.bfloat16)
    qfp8.quantize(model, weight_scale="tensor")
    qfp8.save_pretrained(model, tmp_path / "memory")
    streamed, in_memory = tiny.tensors(tmp_path / "stream"), tiny.tensors(tmp_path / "memory")
    assert streamed.keys() == in_memory.keys()
    for key, value in in_memory.items():
        assert streamed[key].shape == value.shape and torch.equal(
            streamed[key].view(torch.uint8), value.view(torch.uint8)
        )
    assert streamed[SCALE].shape == (64, 1)
    qc = read_config(tmp_path / "stream")["quantization_config"]
    assert qc == read_config(tmp_path / "memory")["quantization_config"] and qc[KEY] == ["group_0"]
    assert qfp8.from_pretrained(tmp_path / "stream").model.layers[1].self_attn.q_proj.scheme.weight_scale == "tensor"


def test_listed_scales_whose_rows_differ_are_refused_naming_the_file_and_tensor(tiny, tmp_path):
    qfp8.save_pretrained(tiny.quantized(**TENSOR_SCHEMES["w8a8-tensor-token"]), tmp_path)
    tensors = tiny.tensors(tmp_path)
    tensors[SCALE] = tensors[SCALE].clone()
    tensors[SCALE][3] *= 2
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.safetensors: {SCALE} has 1 of 64 rows differing"):
        qfp8.from_pretrained(tmp_path)
    # Unlisted, the same file is another tool's channel checkpoint: read per channel, as stored.
    config = read_config(tmp_path)
    del config["quantization_config"][KEY]
    write_config(tmp_path, config)
    q_proj = qfp8.from_pretrained(tmp_path).model.layers[1].self_attn.q_proj
    assert q_proj.scheme.weight_scale == "channel" and torch.equal(q_proj.weight_scale, tensors[SCALE])


def test_channel_scales_without_the_key_stay_channel_scales(tiny, tmp_path, x):
    model = tiny.quantized(**TENSOR_SCHEMES["w8a8-tensor-token"])
    qfp8.save_pretrained(model, tmp_path)
    config = read_config(tmp_path)
    del config["quantization_config"][KEY]
    write_config(tmp_path, config)
    loaded = qfp8.from_pretrained(tmp_path)
    for name, module in tiny.qlinears(loaded).items():
        assert module.scheme.weight_scale == "channel" and module.weight_scale.shape == (module.out_features, 1), name
    with torch.no_grad():  # the same values: only the kernel's scale layout differs
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "listed, message",
    [(["group_3"], "must list config_groups names"), ("group_0", "must be a list of strings")],
    ids=["unknown-group", "not-a-list"],
)
def test_the_key_must_list_config_groups(tiny, tmp_path, listed, message):
    qfp8.save_pretrained(tiny.quantized(**TENSOR_SCHEMES["w8a16-tensor"]), tmp_path)
    config = read_config(tmp_path)
    config["quantization_config"][KEY] = listed
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        qfp8.from_pretrained(tmp_path)


def test_a_listed_group_must_store_channel_weights(tiny, tmp_path):
    qfp8.save_pretrained(tiny.quantized(**dict(weight_scale="block", block_size=(32, 32))), tmp_path)
    config = read_config(tmp_path)
    config["quantization_config"][KEY] = ["group_0"]
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match=f"listed in {KEY} .* strategy is 'block', not 'channel'"):
        qfp8.from_pretrained(tmp_path)


def test_channel_weights_are_not_listed(tiny, tmp_path):
    qfp8.save_pretrained(tiny.quantized(**dict(activations="dynamic")), tmp_path)
    assert KEY not in read_config(tmp_path)["quantization_config"]
    assert tiny.tensors(tmp_path)[SCALE].shape == (64, 1)


def test_mixed_schemes_list_only_the_per_tensor_group(tiny, tmp_path, x):
    model = tiny.mixed()
    qfp8.save_pretrained(model, tmp_path)
    qc = read_config(tmp_path)["quantization_config"]
    (listed,) = qc[KEY]
    assert all(".mlp." in target for target in qc["config_groups"][listed]["targets"])
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.model.layers[0].mlp.up_proj.scheme.weight_scale == "tensor"
    assert loaded.model.layers[0].self_attn.q_proj.scheme.weight_scale == "channel"
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_load_state_dict_reads_a_saved_file_into_a_per_tensor_model(tiny, tmp_path, x):
    model = tiny.quantized(**TENSOR_SCHEMES["w8a8-tensor-token"])
    qfp8.save_pretrained(model, tmp_path)
    state = safetensors.torch.load_file(tmp_path / "model.safetensors")
    target = tiny.quantized(**TENSOR_SCHEMES["w8a8-tensor-token"])
    qfp8.load_state_dict(target, state)
    with torch.no_grad():
        assert torch.equal(target(x).logits, model(x).logits)
    state[SCALE] = state[SCALE].clone()
    state[SCALE][3] *= 2
    with pytest.raises(ValueError, match=f"state dict tensor '{SCALE}' has 1 of 64 rows differing"):
        qfp8.load_state_dict(tiny.quantized(**TENSOR_SCHEMES["w8a8-tensor-token"]), state)


def test_transformers_loads_it_through_qfp8config_and_its_own_loader(tiny, tmp_path, x):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors", reason="transformers reads compressed-tensors through it")
    model = tiny.quantized(**TENSOR_SCHEMES["w8a16-tensor"])
    qfp8.save_pretrained(model, tmp_path)
    through_qfp8config = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, config=qfp8.Qfp8Config().for_checkpoint(tmp_path), dtype=torch.float32
    )
    q_proj = through_qfp8config.model.layers[1].self_attn.q_proj
    assert q_proj.scheme.weight_scale == "tensor" and q_proj.weight_scale.shape == (1,)
    with torch.no_grad():
        assert torch.equal(through_qfp8config(x).logits, model(x).logits)
    from transformers.utils.quantization_config import CompressedTensorsConfig

    plain = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    )
    with torch.no_grad():  # the same dequantized weights, the same float matmuls
        torch.testing.assert_close(plain(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_a_group_holding_moe_experts_keeps_per_tensor_scales(tmp_path):
    """vLLM's fused MoE takes per-tensor expert weights with per-tensor activations, not channel ones: a group with
    experts is written per tensor; the same model with its experts float gets the dense layers per row."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    for exclude, per_row in ((("lm_head",), False), (("lm_head", "*experts*"), True)):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config).eval()
        qfp8.quantize(model, weight_scale="tensor", activations="dynamic", activation_scale="tensor", exclude=exclude)
        path = tmp_path / str(per_row)
        qfp8.save_pretrained(model, path)
        stored = safetensors.torch.load_file(path / "model.safetensors")
        qc = read_config(path)["quantization_config"]
        assert (KEY in qc) == per_row
        assert stored["model.layers.0.self_attn.q_proj.weight_scale"].shape == ((64, 1) if per_row else (1,))
        if not per_row:
            assert stored["model.layers.0.block_sparse_moe.experts.1.w2.weight_scale"].shape == (1,)
        q_proj = qfp8.from_pretrained(path).model.layers[0].self_attn.q_proj
        assert q_proj.scheme.weight_scale == "tensor" and torch.equal(
            q_proj.weight_scale, model.model.layers[0].self_attn.q_proj.weight_scale
        )
