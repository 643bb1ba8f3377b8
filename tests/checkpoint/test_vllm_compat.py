"""What other readers (vLLM, transformers) make of qfp8's checkpoints, and what qfp8's readers refuse.

- e5m2 weights and a KV cache that is not e4m3fn cannot be said in compressed-tensors terms (its float type is
  e4m3fn to every reader): such a checkpoint is written without ``quant_method``, marked ``qfp8_method: "qfp8"``
  (vLLM and transformers refuse it), with one UserWarning.
- Checkpoints vLLM refuses or cannot run (block + static, fused shards quantized differently, block shapes its
  kernels cannot take) are still written, with one UserWarning naming the modules and the vLLM rule.
- Readers refuse a kv_cache_scheme that is not symmetric FP8 per tensor (or dynamic), and asymmetric groups.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qfp8
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.inspect import describe
from qfp8.checkpoint.stream import stream_quantize
from qfp8.nn.scheme import QuantizationScheme

# A Llama whose every dimension is a multiple of 128 (head_dim 128: k/v_proj have N = 128).
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)


def quantization_config(path):
    return json.loads((path / "config.json").read_text())["quantization_config"]


def save(model, path):
    """save_pretrained; returns the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, path)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def calibrated(tiny, model, **kwargs):
    qfp8.quantize(model, **kwargs)
    if kwargs.get("activations") == "static" or kwargs.get("kv_cache"):
        with qfp8.calibrate(model):
            model(tiny.tokens(seed=5))
    return model


def write_config(path, qc):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------ e5m2: marked qfp8_method "qfp8"


def test_e5m2_weights_are_marked_qfp8_with_one_warning_and_round_trip_bitwise(tiny, tmp_path, x):
    model = calibrated(tiny, tiny.model(), weights="float8_e5m2", weight_scale="channel")
    messages = save(model, tmp_path / "e5m2")
    assert len(messages) == 1, messages
    assert "14 layers have float8_e5m2 weights" in messages[0]
    assert "without quant_method (marked qfp8_method: 'qfp8')" in messages[0]
    assert "vLLM and transformers refuse it" in messages[0]
    qc = quantization_config(tmp_path / "e5m2")
    assert "quant_method" not in qc and qc["qfp8_method"] == "qfp8"
    # The same body as the e4m3fn checkpoint of the same scheme (the weight dtype is in the safetensors header).
    assert not save(calibrated(tiny, tiny.model(), weight_scale="channel"), tmp_path / "e4m3")
    standard = quantization_config(tmp_path / "e4m3")
    assert standard["quant_method"] == "compressed-tensors"
    assert {k: v for k, v in qc.items() if k != "qfp8_method"} == {
        k: v for k, v in standard.items() if k != "quant_method"
    }
    assert tiny.tensors(tmp_path / "e5m2")["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e5m2
    loaded = qfp8.from_pretrained(tmp_path / "e5m2")
    assert loaded.qfp8_checkpoint_format == "qfp8"
    assert loaded.model.layers[1].self_attn.k_proj.scheme == model.model.layers[1].self_attn.k_proj.scheme
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_transformers_refuses_a_qfp8_only_checkpoint(tiny, tmp_path):
    """Without quant_method transformers raises; with an unknown quant_method (say "qfp8") it would only log
    "Unknown quantization type" and load the FP8 values without their scales (checked with transformers 5.24)."""
    model = calibrated(tiny, tiny.model(), weights="float8_e5m2", weight_scale="channel")
    save(model, tmp_path)
    with pytest.raises(ValueError, match="quant_method"):
        tiny_transformers_load(tmp_path)


def tiny_transformers_load(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_e5m2_kv_cache_is_marked_qfp8_and_round_trips(tiny, tmp_path, x):
    model = calibrated(tiny, tiny.model(), weight_scale="channel", kv_cache="float8_e5m2")
    messages = save(model, tmp_path)
    assert len(messages) == 1 and "the KV cache is float8_e5m2" in messages[0], messages
    qc = quantization_config(tmp_path)
    assert "quant_method" not in qc and qc["qfp8_method"] == "qfp8" and qc["qfp8_kv_cache_dtype"] == "float8_e5m2"
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.qfp8_kv_cache_dtype == torch.float8_e5m2
    assert torch.equal(loaded.model.layers[1].self_attn.v_scale, model.model.layers[1].self_attn.v_scale)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert describe(tmp_path)["vllm"] == [
        "qfp8_method 'qfp8', no quant_method (the KV cache is float8_e5m2): vLLM and transformers refuse it (qfp8 only)"
    ]


def test_older_compressed_tensors_checkpoint_with_e5m2_cache_still_loads(tiny, tmp_path, x):
    """Before the qfp8_method marker, qfp8 wrote compressed-tensors + qfp8_kv_cache_dtype."""
    model = calibrated(tiny, tiny.model(), weight_scale="channel", kv_cache="float8_e5m2")
    save(model, tmp_path)
    old = {k: v for k, v in quantization_config(tmp_path).items() if k != "qfp8_method"}
    write_config(tmp_path, {"quant_method": "compressed-tensors", **old})
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.qfp8_checkpoint_format == "compressed-tensors"
    assert loaded.qfp8_kv_cache_dtype == torch.float8_e5m2
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_e4m3fnuz_weights_stay_compressed_tensors(tiny, tmp_path):
    model = calibrated(tiny, tiny.model(**ALIGNED), weights="float8_e4m3fnuz", weight_scale="channel")
    assert save(model, tmp_path) == []
    assert quantization_config(tmp_path)["quant_method"] == "compressed-tensors"


def test_stream_quantize_marks_e5m2_weights_qfp8(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source)
    with pytest.warns(UserWarning, match="14 layers have float8_e5m2 weights") as caught:
        stream_quantize(source, tmp_path / "out", weights="float8_e5m2", progress=False)
    assert len([w for w in caught if "qfp8" in str(w.message)]) == 1
    assert quantization_config(tmp_path / "out")["qfp8_method"] == "qfp8"
    memory = tiny.model(torch.bfloat16)
    qfp8.quantize(memory, weights="float8_e5m2")
    save(memory, tmp_path / "memory")
    assert quantization_config(tmp_path / "out") == quantization_config(tmp_path / "memory")
    assert describe(tmp_path / "out")["format"] == "qfp8"


# ------------------------------------------------------------ what vLLM refuses: a warning


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(weight_scale="channel"),
        dict(weight_scale="channel", activations="dynamic", activation_scale="token"),
        dict(weight_scale="tensor", activations="static"),
        dict(weight_scale="block", activations="dynamic", activation_scale="group"),
        dict(weight_scale="channel", kv_cache="float8_e4m3fn"),
    ],
    ids=["w8a16-channel", "w8a8-token", "static-tensor", "block-group", "kv-e4m3fn"],
)
def test_standard_checkpoint_gives_no_warning(tiny, tmp_path, kwargs):
    model = calibrated(tiny, tiny.model(**ALIGNED), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qfp8.save_pretrained(model, tmp_path)
    assert quantization_config(tmp_path)["quant_method"] == "compressed-tensors"
    assert describe(tmp_path)["vllm"] == []


def test_block_weights_with_static_inputs_warn(tiny, tmp_path):
    model = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="block", activations="static")
    (message,) = save(model, tmp_path)
    assert message.startswith("vLLM cannot load or run this checkpoint")
    assert "model.layers.*.self_attn.q_proj" in message and "(14 modules)" in message
    assert "CompressedTensorsW8A8Fp8 asserts" in message and "activation_scale='group'" in message
    # Still written, and qfp8 reads it back; inspect reports the same problems.
    assert quantization_config(tmp_path)["quant_method"] == "compressed-tensors"
    assert ["  - " + line for line in describe(tmp_path)["vllm"]] == message.splitlines()[1:]


def test_partly_excluded_fused_layer_warns(tiny, tmp_path):
    model = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="channel", exclude=("lm_head", "*.k_proj"))
    (message,) = save(model, tmp_path)
    assert "model.layers.*.self_attn.qkv_proj (2 modules): q_proj/k_proj/v_proj" in message
    assert "k_proj ignored" in message and "fuses them into qkv_proj" in message
    assert "gate_up_proj" not in message


def test_fused_shards_with_different_schemes_warn(tiny, tmp_path):
    model = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="channel", exclude=("lm_head", "*.up_proj"))
    other = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="tensor")
    for i, layer in enumerate(model.model.layers):
        layer.mlp.up_proj = other.model.layers[i].mlp.up_proj
    (message,) = save(model, tmp_path)
    assert "model.layers.*.mlp.gate_up_proj (2 modules): gate_proj/up_proj" in message
    assert "gate_proj w-e4m3fn-channel a-float, up_proj w-e4m3fn-tensor a-float" in message


def test_block_shapes_vllm_cannot_run_warn(tiny, tmp_path):
    # bn != bk on an aligned model (W8A8: vLLM's W8A16 block layers take another scheme, whose rules are not checked).
    model = calibrated(
        tiny, tiny.model(**ALIGNED), weight_scale="block", block_size=(128, 64), activations="dynamic",
        activation_scale="group",
    )  # fmt: skip
    (message,) = save(model, tmp_path / "128x64")
    assert "block size [128, 64]" in message and "block_n == block_k" in message and "K = " not in message
    assert not save(calibrated(tiny, tiny.model(), weight_scale="block", exclude=()), tmp_path / "w8a16")
    # The tiny model (hidden 64, k/v_proj N = 32) with 128 blocks: K % bn and fused shards' N % bn.
    model = calibrated(
        tiny, tiny.model(), weight_scale="block", activations="dynamic", activation_scale="group", exclude=()
    )
    message, for_transformers = save(model, tmp_path / "hidden64")
    assert for_transformers.startswith("transformers cannot load or run this checkpoint as written")  # K = 64 groups
    assert "K = 64 is not a multiple of block_n = 128" in message
    assert "K = 128 is not" not in message  # down_proj: K = intermediate = 128
    assert "model.layers.*.self_attn.qkv_proj (2 modules): q_proj N = 64 is not a multiple" in message
    assert "k_proj N = 32 is not a multiple" in message and "v_proj N" not in message
    assert "gate_proj N" not in message and "validate_fp8_block_shape" in message  # gate_proj: N = 128


def test_vllm_incompatibilities_rules():
    block = QuantizationScheme(torch.float8_e4m3fn, "block", (128, 128), "dynamic", "group")
    layers = {
        "attn.q_proj": (block, (256, 256)),
        "attn.k_proj": (block, (128, 256)),
        "attn.v_proj": (block, (64, 256)),  # the last shard may end in a partial block
        "o_proj": (block, (256, 256)),
        "lm_head": (None, (1000, 256)),
    }
    assert qconfig.vllm_incompatibilities(layers) == []
    layers["attn.k_proj"] = (block, (96, 256))
    (problem,) = qconfig.vllm_incompatibilities(layers)
    assert problem.startswith("attn.qkv_proj (1 module): k_proj N = 96 is not a multiple of block_n = 128")
    layers["attn.k_proj"] = (None, (96, 256))
    (problem,) = qconfig.vllm_incompatibilities(layers)
    assert "k_proj ignored" in problem


def test_stream_quantize_warns_about_a_partly_excluded_fused_layer(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16, **ALIGNED).save_pretrained(source)
    with pytest.warns(UserWarning, match="vLLM cannot load or run") as caught:
        stream_quantize(source, tmp_path / "out", exclude=("lm_head", "*.gate_proj"), progress=False)
    (message,) = [str(w.message) for w in caught if "vLLM" in str(w.message)]
    assert "model.layers.*.mlp.gate_up_proj (2 modules): gate_proj/up_proj (gate_proj ignored" in message
    assert quantization_config(tmp_path / "out")["quant_method"] == "compressed-tensors"


# ------------------------------------------------------------ readers


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(type="int"), "kv_cache_scheme: qfp8 reads 8-bit float quantization, got type='int'"),
        (dict(num_bits=4), "kv_cache_scheme: qfp8 reads 8-bit float quantization, got type='float' num_bits=4"),
        (dict(symmetric=False), "kv_cache_scheme: symmetric=False"),
        (dict(strategy="attn_head"), "kv_cache_scheme has static strategy 'attn_head'"),
    ],
    ids=["int8", "4-bit", "asymmetric", "attn-head"],
)
def test_reader_refuses_a_kv_cache_scheme_it_cannot_run(tiny, tmp_path, change, message):
    save(calibrated(tiny, tiny.model(), weight_scale="channel", kv_cache="float8_e4m3fn"), tmp_path)
    qc = quantization_config(tmp_path)
    qc["kv_cache_scheme"].update(change)
    write_config(tmp_path, qc)
    with pytest.raises(ValueError, match=r"config\.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        qfp8.from_pretrained(tmp_path)


def test_reader_takes_a_dynamic_kv_cache_scheme(tiny, tmp_path, x):
    save(calibrated(tiny, tiny.model(), weight_scale="channel"), tmp_path)
    qc = quantization_config(tmp_path)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": True}
    write_config(tmp_path, qc)
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.qfp8_kv_cache_dtype == torch.float8_e4m3fn
    assert loaded.model.layers[0].self_attn.k_scale is None  # dynamic: scales taken from the prefill
    with torch.no_grad():
        assert torch.isfinite(loaded(x).logits).all()


@pytest.mark.parametrize("args", ["weights", "input_activations"])
def test_reader_refuses_asymmetric_groups(tiny, tmp_path, args):
    save(calibrated(tiny, tiny.model(), weight_scale="channel", activations="dynamic"), tmp_path)
    qc = quantization_config(tmp_path)
    qc["config_groups"]["group_0"][args]["symmetric"] = False
    write_config(tmp_path, qc)
    with pytest.raises(ValueError, match=rf"config\.json: config_groups\.group_0\.{args}: symmetric=False"):
        qfp8.from_pretrained(tmp_path)


def test_group_activations_with_k_not_a_multiple_of_128_warn_for_transformers(tiny, tmp_path, x):
    # hidden 128, intermediate 200: down_proj alone has K = 200.
    model = tiny.model(hidden_size=128, intermediate_size=200, num_attention_heads=2, num_key_value_heads=1)
    qfp8.quantize(model, activations="dynamic", activation_scale="group")
    (message,) = save(model, tmp_path)
    assert message.startswith("transformers cannot load or run this checkpoint as written")
    assert "model.layers.*.mlp.down_proj (2 modules): in_features not a multiple of 128" in message
    assert "q_proj" not in message
    # What the warning says: transformers loads the folder and fails on the forward pass; qfp8 runs it.
    loaded = tiny_transformers_load(tmp_path)
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            loaded(x)
        assert torch.isfinite(qfp8.from_pretrained(tmp_path)(x).logits).all()


def test_group_activations_with_aligned_k_save_without_warning(tiny, tmp_path, x):
    model = tiny.model(**ALIGNED)
    qfp8.quantize(model, activations="dynamic", activation_scale="group")
    assert save(model, tmp_path) == []
    with torch.no_grad():
        torch.testing.assert_close(tiny_transformers_load(tmp_path)(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)


def test_an_uncalibrated_kv_cache_is_written_dynamic_with_a_warning(tiny, tmp_path, x):
    model = tiny.model()
    qfp8.quantize(model, kv_cache="float8_e4m3fn")
    (message,) = save(model, tmp_path / "dynamic")
    assert message.startswith("the FP8 KV cache is not calibrated") and "qfp8.calibrate" in message
    scheme = quantization_config(tmp_path / "dynamic")["kv_cache_scheme"]
    assert scheme["dynamic"] is True and scheme["strategy"] == "tensor"  # vLLM validates the strategy
    assert not [k for k in tiny.tensors(tmp_path / "dynamic") if k.endswith(("k_scale", "v_scale"))]
    loaded = qfp8.from_pretrained(tmp_path / "dynamic")
    attention = loaded.model.layers[0].self_attn
    assert loaded.qfp8_kv_cache_dtype == torch.float8_e4m3fn and attention.k_scale is None
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    # Calibrated: static, no warning.
    with torch.no_grad(), qfp8.calibrate(model):
        model(x)
    assert save(model, tmp_path / "static") == []
    assert quantization_config(tmp_path / "static")["kv_cache_scheme"]["dynamic"] is False


# ------------------------------------------------------------ config.json keys transformers 4 reads


def test_config_keeps_the_keys_transformers_4_reads(tiny, tmp_path):
    """vLLM pins transformers < 5, whose configs read ``rope_theta``/``rope_scaling`` and ``num_experts``.

    transformers 5 writes ``rope_parameters`` and ``num_local_experts`` instead; transformers 4 then fills the
    missing keys with its defaults (RoPE base 10000, 128 experts) with no error. The values written must be the
    model's, and transformers 5 must still read the file back as it was (checked by hand with transformers 4.56.2:
    rope_theta 500000, the llama3 scaling, num_experts 8).
    """
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
    model = tiny.model(rope_parameters=rope)
    qfp8.quantize(model)
    save(model, tmp_path / "llama")
    written = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert written["rope_theta"] == 500000.0
    assert written["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert transformers_config(tmp_path / "llama").rope_parameters == model.config.rope_parameters
    reloaded = qfp8.from_pretrained(tmp_path / "llama")
    assert reloaded.config.rope_parameters == model.config.rope_parameters

    plain = tiny.model()  # default RoPE: no scaling, and transformers 4's rope_scaling is then null
    qfp8.quantize(plain)
    save(plain, tmp_path / "plain")
    written = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert written["rope_theta"] == plain.config.rope_parameters["rope_theta"] and written["rope_scaling"] is None

    transformers = pytest.importorskip("transformers")
    moe_config = transformers.Qwen3MoeConfig(
        **{k: v for k, v in tiny.sizes.items() if k != "intermediate_size"},
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    moe = transformers.AutoModelForCausalLM.from_config(moe_config).eval()
    qfp8.quantize(moe)
    save(moe, tmp_path / "moe")
    written = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert written["num_experts"] == written["num_local_experts"] == 4
    assert transformers_config(tmp_path / "moe").num_local_experts == 4


def transformers_config(path):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)
