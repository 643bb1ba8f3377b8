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
from qfp8.checkpoint import reader_rules
from qfp8.checkpoint.inspect import describe
from qfp8.checkpoint.stream import stream_quantize
from qfp8.nn.scheme import QuantizationScheme

# A Llama whose every dimension is a multiple of 128 (head_dim 128: k/v_proj have N = 128).
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)


CPU_ENGINE_WARNING = "vLLM's CPU engine"


def quantization_config(path):
    return json.loads((path / "config.json").read_text())["quantization_config"]


def save(model, path):
    """save_pretrained; returns the messages of the warnings it gave, but the vLLM CPU engine's (tested in
    test_serving_compat.py and tests/vllm)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, path)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return [message for message in messages if not message.startswith(CPU_ENGINE_WARNING)]


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
        warnings.filterwarnings("ignore", CPU_ENGINE_WARNING)  # what vLLM's CPU engine runs: test_serving_compat
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
    other = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="channel", activations="dynamic")
    for i, layer in enumerate(model.model.layers):
        layer.mlp.up_proj = other.model.layers[i].mlp.up_proj
    (message,) = save(model, tmp_path)
    assert "model.layers.*.mlp.gate_up_proj (2 modules): gate_proj/up_proj" in message
    assert "gate_proj w-e4m3fn-channel a-float, up_proj w-e4m3fn-channel a-dynamic-token" in message


def test_fused_shards_with_channel_and_per_tensor_weights_are_one_scheme_to_vllm(tiny, tmp_path):
    """Per-tensor weights are written as channel weights (docs/checkpoints.md): vLLM reads the two shards alike."""
    model = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="channel", exclude=("lm_head", "*.up_proj"))
    other = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="tensor")
    for i, layer in enumerate(model.model.layers):
        layer.mlp.up_proj = other.model.layers[i].mlp.up_proj
    messages = save(model, tmp_path)
    assert not any("vLLM cannot" in message for message in messages), messages
    groups = quantization_config(tmp_path)["config_groups"]
    assert len(groups) == 2 and {g["weights"]["strategy"] for g in groups.values()} == {"channel"}


def test_block_shapes_vllm_cannot_run_warn(tiny, tmp_path):
    # bn != bk on an aligned model (W8A8 only: vLLM's W8A16 block layers, CompressedTensorsW8A16Fp8, take it).
    model = calibrated(
        tiny, tiny.model(**ALIGNED), weight_scale="block", block_size=(128, 64), activations="dynamic",
        activation_scale="group",
    )  # fmt: skip
    (message,) = save(model, tmp_path / "128x64")
    assert "block size [128, 64]" in message and "block_n == block_k" in message and "K = " not in message
    assert not save(calibrated(tiny, tiny.model(**ALIGNED), weight_scale="block", block_size=(128, 64)), tmp_path / "a")
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


def test_w8a16_block_shards_vllm_cannot_fuse_warn(tiny, tmp_path):
    """The newest CompressedTensorsW8A16Fp8 (02e43002) takes block weights and checks validate_fp8_block_shape: a
    fused shard other than the last must be a multiple of block_n (K and bn != bk are free). Older ones (aa63715b)
    refuse block weights without input activations outright."""
    model = calibrated(tiny, tiny.model(), weight_scale="block")  # hidden 64: q_proj N = 64, k_proj N = 32
    (message,) = save(model, tmp_path)
    assert message.startswith("vLLM cannot load or run this checkpoint")
    lines = message.splitlines()[1:]
    assert len(lines) == 2, lines
    assert "model.layers.*.self_attn.qkv_proj (2 modules): q_proj N = 64 is not a multiple of block_n = 128" in lines[0]
    assert "k_proj N = 32 is not a multiple" in lines[1] and "v_proj N" not in message and "K = " not in message
    assert "CompressedTensorsW8A16Fp8 calls for W8A16 block layers" in message and "aa63715b" in message
    assert "'Unsupported weight strategy=block'" in message
    assert ["  - " + line for line in describe(tmp_path)["vllm"]] == lines


def test_vllm_incompatibilities_rules():
    block = QuantizationScheme(torch.float8_e4m3fn, "block", (128, 128), "dynamic", "group")
    layers = {
        "attn.q_proj": (block, (256, 256)),
        "attn.k_proj": (block, (128, 256)),
        "attn.v_proj": (block, (64, 256)),  # the last shard may end in a partial block
        "o_proj": (block, (256, 256)),
        "lm_head": (None, (1000, 256)),
    }
    assert reader_rules.vllm_incompatibilities(layers) == []
    layers["attn.k_proj"] = (block, (96, 256))
    (problem,) = reader_rules.vllm_incompatibilities(layers)
    assert problem.startswith("attn.qkv_proj (1 module): k_proj N = 96 is not a multiple of block_n = 128")
    layers["attn.k_proj"] = (None, (96, 256))
    (problem,) = reader_rules.vllm_incompatibilities(layers)
    assert "k_proj ignored" in problem


def test_stream_quantize_warns_about_a_partly_excluded_fused_layer(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16, **ALIGNED).save_pretrained(source)
    with pytest.warns(UserWarning, match="vLLM cannot load or run") as caught:
        stream_quantize(source, tmp_path / "out", exclude=("lm_head", "*.gate_proj"), progress=False)
    (message,) = [str(w.message) for w in caught if "vLLM cannot" in str(w.message)]
    assert "model.layers.*.mlp.gate_up_proj (2 modules): gate_proj/up_proj (gate_proj ignored" in message
    assert quantization_config(tmp_path / "out")["quant_method"] == "compressed-tensors"


def test_a_quantized_lm_head_warns(tiny, tmp_path):
    """vLLM's ParallelLMHead is no LinearBase: CompressedTensorsConfig.get_quant_method gives it no scheme (newer
    vLLM takes one only from a group naming lm_head, not from the 'Linear' target), and its loader then fails on
    lm_head.weight_scale."""
    model = calibrated(tiny, tiny.model(**ALIGNED), weight_scale="channel", exclude=())
    (message,) = save(model, tmp_path)
    (line,) = message.splitlines()[1:]
    assert line.startswith("  - lm_head (1 module): a quantized lm_head: vLLM builds lm_head as a ParallelLMHead")
    assert "lm_head.weight_scale" in line and "'Linear' target" in line and "Keep lm_head float" in line
    assert describe(tmp_path)["vllm"] == [line.removeprefix("  - ")]


# ------------------------------------------------------------ MoE experts: vLLM's FusedMoE

MOE_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def moe_model(arch="mixtral"):
    transformers = pytest.importorskip("transformers")
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(
            **MOE_COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **MOE_COMMON, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **MOE_COMMON, moe_intermediate_size=128, shared_expert_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2,
        ),
    }  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]()).eval()


def quiet_quantize(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qfp8.quantize(model, **kwargs)
    return model


def vllm_lines(messages):
    (message,) = [m for m in messages if m.startswith("vLLM cannot load or run")]
    return message.splitlines()[1:]


@pytest.mark.parametrize(
    "arch, weight_scale, prefix",
    [("mixtral", "channel", "block_sparse_moe.experts"), ("qwen3_moe", "tensor", "mlp.experts")],
)
def test_weight_only_experts_warn_with_what_vllm_takes(tmp_path, arch, weight_scale, prefix):
    """vLLM has no FP8 weight-only fused-MoE method: get_moe_method sends per-channel weights to its WNA16 branch
    (which takes 'pack-quantized' only) and per-tensor ones to no method."""
    model = quiet_quantize(moe_model(arch), weight_scale=weight_scale)
    (line,) = vllm_lines(save(model, tmp_path / "w8a16"))
    assert line.startswith(f"  - model.layers.*.{prefix} (2 modules): MoE experts quantized weight-only")
    assert "no FP8 weight-only fused-MoE method" in line and "'float-quantized'" in line
    assert "activations='dynamic' with weight_scale='channel' and activation_scale='token'" in line
    assert "weight_scale='tensor' with activations='static'" in line and "activation_scale='group'" in line
    # Float experts are a way out where vLLM finds them in the ignore list (gate_proj names), not for Mixtral.
    assert ("keep them float (exclude=" in line) == (arch == "qwen3_moe")
    assert ["  - " + problem for problem in describe(tmp_path / "w8a16")["vllm"]] == [line]
    # What the warning advises saves without one.
    assert save(quiet_quantize(moe_model(arch), activations="dynamic"), tmp_path / "w8a8") == []


@pytest.mark.parametrize("activation_scale", ["token", "token-mse"])
def test_experts_with_a_w8a8_pairing_vllm_refuses_warn(tmp_path, activation_scale):
    model = quiet_quantize(moe_model(), weight_scale="tensor", activations="dynamic", activation_scale=activation_scale)
    (line,) = vllm_lines(save(model, tmp_path))
    (group,) = quantization_config(tmp_path)["config_groups"].values()
    assert group["input_activations"]["strategy"] == "token"  # token-mse is written as dynamic per-token
    assert line.startswith("  - model.layers.*.block_sparse_moe.experts (2 modules): MoE experts with tensor weight")
    assert "dynamic per-token" in line and ("token-mse, saved as dynamic per-token" in line) == (
        activation_scale == "token-mse"
    )
    assert "CompressedTensorsW8A8Fp8MoEMethod takes per-tensor weights with per-tensor activations" in line


def expert_layers(scheme, parts=("gate_proj", "up_proj", "down_proj"), experts=2, n=128):
    layers = {}
    for e in range(experts):
        for part in parts:
            layers[f"model.layers.0.mlp.experts.{e}.{part}"] = (scheme, (n, 128) if part != parts[-1] else (128, n))
    layers["model.layers.0.self_attn.o_proj"] = (scheme, (128, 128))
    return layers


# (weight_scale, activations, activation_scale): refused by vLLM's fused MoE
MOE_PAIRINGS = {
    ("tensor", "static", "tensor"): False,
    ("tensor", "dynamic", "tensor"): False,
    ("channel", "dynamic", "token"): False,
    ("channel", "dynamic", "token-mse"): False,  # saved as dynamic per-token
    ("block", "dynamic", "group"): False,
    ("block", "dynamic", "token"): False,
    ("tensor", "dynamic", "token"): True,
    ("tensor", "dynamic", "token-mse"): True,
    ("tensor", "dynamic", "group"): True,
    ("channel", "static", "tensor"): True,
    ("channel", "dynamic", "tensor"): True,
    ("channel", "dynamic", "group"): True,
}


def test_vllm_fused_moe_w8a8_pairings():
    """CompressedTensorsW8A8Fp8MoEMethod: per-tensor weights + per-tensor activations, per-channel + dynamic
    per-token, block + dynamic; it asserts block weights for any other pairing."""
    refused = {}
    for weight_scale, activations, activation_scale in MOE_PAIRINGS:
        scheme = QuantizationScheme.from_args("float8_e4m3fn", weight_scale, activations, activation_scale)
        problems = reader_rules.vllm_incompatibilities(expert_layers(scheme))
        refused[(weight_scale, activations, activation_scale)] = bool(problems)
        for problem in problems:
            assert problem.startswith(f"model.layers.*.mlp.experts (1 module): MoE experts with {weight_scale} weight")
            assert "asserts block weights for any other pairing" in problem
    assert refused == MOE_PAIRINGS


def test_block_experts_whose_gate_up_rows_are_not_a_multiple_of_block_n_warn():
    scheme = QuantizationScheme.from_args("float8_e4m3fn", "block", "dynamic", "group", block_size=(128, 128))
    layers = {k: v for k, v in expert_layers(scheme, n=192).items() if "o_proj" not in k}
    problems = reader_rules.vllm_incompatibilities(layers)
    assert any("down_proj (2 modules): K = 192 is not a multiple" in p for p in problems)  # the dense rule
    (problem,) = [p for p in problems if "MoE" in p]
    assert problem.startswith("model.layers.*.mlp.experts (1 module): MoE experts' gate/up N = 192 is not a multiple")
    assert "CompressedTensorsW8A8Fp8MoEMethod.create_weights raises" in problem


def test_experts_of_a_layer_not_quantized_alike_warn(tmp_path):
    """vLLM fuses a layer's experts into one FusedMoE with one scheme, looked up by expert 0's names."""
    model = quiet_quantize(moe_model(), activations="dynamic", exclude=["lm_head", "*experts.down_proj"])
    (line,) = vllm_lines(save(model, tmp_path))
    assert line.startswith("  - model.layers.*.block_sparse_moe.experts (2 modules): MoE experts of one layer not all")
    assert "(4 of 12 expert parts ignored; ignored, w-e4m3fn-channel a-dynamic-token)" in line
    assert "one FusedMoE with one scheme" in line and "'<experts>.0.gate_proj'" in line
    # Rules level: one expert's part ignored is enough.
    scheme = QuantizationScheme.from_args("float8_e4m3fn", "channel", "dynamic", "token")
    layers = expert_layers(scheme)
    assert reader_rules.vllm_incompatibilities(layers) == []
    layers["model.layers.0.mlp.experts.1.up_proj"] = (None, (128, 128))
    (problem,) = reader_rules.vllm_incompatibilities(layers)
    assert "(1 of 6 expert parts ignored; ignored, w-e4m3fn-channel a-dynamic-token)" in problem


def test_float_experts_vllm_cannot_find_in_the_ignore_list_warn(tmp_path):
    """vLLM checks the ignore list for '<experts>.0.gate_proj' only: Mixtral's float experts (w1/w2/w3) are missed,
    and the layer takes the checkpoint's one scheme; Qwen3-MoE's gate_proj names are found."""
    model = quiet_quantize(moe_model(), activations="dynamic", exclude=["lm_head", "model.layers.1.mlp.experts.*"])
    (line,) = vllm_lines(save(model, tmp_path / "mixtral"))
    assert line.startswith("  - model.layers.*.block_sparse_moe.experts (1 module): MoE experts kept float under")
    assert "names vLLM does not look up (w1/w2/w3)" in line and "'Linear' target also covers FusedMoE" in line
    assert "model.layers.1.block_sparse_moe.experts.0.w1" in quantization_config(tmp_path / "mixtral")["ignore"]
    model = quiet_quantize(
        moe_model("qwen3_moe"), activations="dynamic", exclude=["lm_head", "model.layers.1.mlp.experts.*"]
    )
    assert save(model, tmp_path / "qwen3") == []
    assert "model.layers.1.mlp.experts.0.gate_proj" in quantization_config(tmp_path / "qwen3")["ignore"]


def test_experts_named_otherwise_under_several_schemes_warn():
    """With several config groups the targets are module names, and none is '<experts>.0.gate_proj'."""
    channel = QuantizationScheme.from_args("float8_e4m3fn", "channel", "dynamic", "token")
    tensor = QuantizationScheme.from_args("float8_e4m3fn", "tensor", "static", "tensor")
    mixtral = expert_layers(channel, parts=("w1", "w3", "w2"))
    assert reader_rules.vllm_incompatibilities(mixtral) == []  # one scheme: the 'Linear' target reaches FusedMoE
    mixtral["model.layers.0.self_attn.o_proj"] = (tensor, (64, 64))
    (problem,) = reader_rules.vllm_incompatibilities(mixtral)
    assert "MoE experts named w1/w2/w3 in a checkpoint with several schemes" in problem
    assert "builds the layer unquantized and its loader fails on the experts' weight_scale" in problem
    named = expert_layers(channel)
    named["model.layers.0.self_attn.o_proj"] = (tensor, (64, 64))
    assert reader_rules.vllm_incompatibilities(named) == []
    # Float experts under several schemes: no target, so vLLM builds them unquantized, as stored.
    mixtral = {k: (None if ".experts." in k else v, shape) for k, (v, shape) in mixtral.items()}
    mixtral["model.layers.0.self_attn.q_proj"] = (channel, (64, 64))
    assert reader_rules.vllm_incompatibilities(mixtral) == []


def test_qwen2_moe_shared_expert_gate_stays_float(tiny, tmp_path):
    """vLLM builds Qwen2-MoE's shared_expert_gate as a plain torch.nn.Linear: quantize keeps it float, as the
    routers (no nn.Linear) are, with the reason in the report; the streamed CLI path does the same."""
    moe_model("qwen2_moe").save_pretrained(tmp_path / "float")
    model = moe_model("qwen2_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, report = qfp8.quantize(model, activations="dynamic")
    entries = {e.name: e for e in report.entries}
    gate = entries["model.layers.0.mlp.shared_expert_gate"]
    assert not gate.quantized and gate.reason.startswith("a MoE gate, kept in float as the routers are")
    assert type(model.model.layers[1].mlp.shared_expert_gate) is torch.nn.Linear
    assert entries["model.layers.0.mlp.shared_expert.gate_proj"].quantized
    assert save(model, tmp_path / "memory") == []
    ignore = quantization_config(tmp_path / "memory")["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"]
    stored = tiny.tensors(tmp_path / "memory")
    assert stored["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.shared_expert_gate.weight_scale" not in stored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream_quantize(tmp_path / "float", tmp_path / "cli", activations="dynamic", progress=False)
    assert quantization_config(tmp_path / "cli") == quantization_config(tmp_path / "memory")
    assert tiny.tensors(tmp_path / "cli").keys() == stored.keys()
    # A quantized one (an older qfp8 checkpoint, another tool) is what vLLM refuses.
    scheme = QuantizationScheme.from_args("float8_e4m3fn", "channel", "dynamic", "token")
    (problem,) = reader_rules.vllm_incompatibilities({"model.layers.0.mlp.shared_expert_gate": (scheme, (1, 64))})
    assert problem.startswith("model.layers.*.mlp.shared_expert_gate (1 module): a quantized shared_expert_gate")
    assert "plain torch.nn.Linear" in problem and "weight_scale (KeyError)" in problem


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
    """transformers runs each layer as qfp8 does (1 x 128 groups). Layer by layer on the same random input the
    outputs agree to float32 sum order; through the model, where each layer's output is quantized again, a sum
    order that differs (the AVX2 kernel's against transformers': 2.9e-3 of the logits on Zen 3; the scalar
    kernel's: 1.4e-6) moves a few values across an FP8 rounding boundary, so the logits are held to 1e-2. Reading
    the scales per token instead would be 6.7e-2 off (measured)."""
    model = tiny.model(**ALIGNED)
    qfp8.quantize(model, activations="dynamic", activation_scale="group")
    assert save(model, tmp_path) == []
    loaded = tiny_transformers_load(tmp_path)
    theirs = dict(loaded.named_modules())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logits, ours = loaded(x).logits, model(x).logits  # (transformers' first forward sets its layers up)
        assert (logits - ours).abs().max() <= 1e-2 * ours.abs().max()
        checked = 0
        for name, module in model.named_modules():
            if isinstance(module, qfp8.QLinear):
                h = torch.randn(2, 5, module.in_features, generator=generator)
                y = module(h)
                torch.testing.assert_close(theirs[name](h), y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
                checked += 1
        assert checked == 14


def test_an_uncalibrated_kv_cache_is_written_dynamic_with_a_warning(tiny, tmp_path, x):
    model = tiny.model()
    qfp8.quantize(model, kv_cache="float8_e4m3fn")
    (message,) = save(model, tmp_path / "dynamic")
    assert message.startswith("the FP8 KV cache is not calibrated") and "qfp8.calibrate" in message
    # What vLLM does with it: with --kv-cache-dtype auto, an FP8 cache from the kv_cache_scheme, with scale 1.0.
    assert "--kv-cache-dtype auto" in message and "scale 1.0 in every layer" in message
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
