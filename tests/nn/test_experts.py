"""Fused MoE experts (transformers 5's 3-D ``experts.gate_up_proj`` / ``down_proj``) in FP8.

Numerics are judged against a float64 reference on random weights and
inputs: the experts module's output with the FP8 weights against the same
module computing in float64 with the dequantized weights (the kernel's own
error: bf16-level or better) and with the float weights (the FP8 rounding:
SQNR). Checkpoints are judged by the names transformers itself writes for
the float model, and by a bitwise round trip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import safetensors.torch
import torch

import qfp8
from qfp8 import formats
from qfp8.nn.experts import QExperts

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
ARCHS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **COMMON,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        )
    ),  # fmt: skip
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**COMMON, intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    ),
}


def moe(arch: str = "mixtral", seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHS[arch]().eval()
    for name, param in model.named_parameters():
        if "experts" in name:  # random experts, larger than the default init, never zero
            param.data = torch.randn_like(param) * 0.05
    return model


def experts_of(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts") and not isinstance(m, QExperts)]


def quiet_quantize(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qfp8.quantize(model, **kwargs)


def routed_inputs(module, tokens: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, module.hidden_dim if hasattr(module, "hidden_dim") else 64, generator=g)
    count = len(module.gate_up_proj)
    top_k_index = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, 2, generator=g)
    return hidden, top_k_index, top_k_weights


def reference_output(module, weights: dict[str, torch.Tensor], inputs, activations=None):
    """The module's own eager forward in float64 with ``weights`` (name -> [E, N, K]) as its parameters.

    ``activations(x)``, if given, is applied to the input of every expert matmul (a W8A8 scheme's rounding).
    """
    clone = type(module).__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._parameters = {k: torch.nn.Parameter(v.double(), requires_grad=False) for k, v in weights.items()}
    clone._modules = {k: v for k, v in module._modules.items() if not isinstance(v, QExperts)}
    hidden, index, top_weights = inputs
    linear = torch.nn.functional.linear
    if activations is not None:
        torch.nn.functional.linear = lambda x, w, b=None: linear(activations(x), w, b)
    try:
        with torch.no_grad():
            return type(module).forward.__wrapped__(clone, hidden.double(), index, top_weights.double())
    finally:
        torch.nn.functional.linear = linear


def fake_quantized(granularity: str, scale=None):
    """x -> x rounded to FP8 e4m3 with per-``granularity`` scales (``scale``: a static one), in float64."""

    def rounded(x):
        q, s = formats.quantize_activation(x.float(), torch.float8_e4m3fn, granularity, scale)
        return formats.fp8_to_float(q, torch.float64) * s.double()

    return rounded


def dequantized(qexperts: QExperts) -> torch.Tensor:
    return torch.stack([formats.dequantize_weight(e.canonical_weight(), e.weight_scale, qexperts.scheme.block_size)
                        for e in qexperts.experts])  # fmt: skip


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"weight_scale": "tensor"},
        {"weight_scale": "block", "block_size": (64, 32)},
        {"activations": "dynamic"},
        {"activations": "dynamic", "activation_scale": "tensor"},
    ],
    ids=["channel", "tensor", "block", "w8a8-token", "w8a8-tensor"],
)
@pytest.mark.parametrize("implementation", ["qfp8", "eager"])
def test_experts_forward_against_float64(arch, kwargs, implementation):
    # "qfp8": the experts implementation quantize registers; "eager": transformers' own loop, which reaches
    # each expert through experts.gate_up_proj[e] (an ExpertWeight bound to its QLinear).
    model = moe(arch)
    module = experts_of(model)[0]
    float_weights = {a: module._parameters[a].detach().clone() for a in ("gate_up_proj", "down_proj")}
    inputs = routed_inputs(module)
    exact = reference_output(module, float_weights, inputs)
    _, report = quiet_quantize(model, **kwargs)
    assert isinstance(module.gate_up_proj, QExperts) and isinstance(module.down_proj, QExperts)
    assert model.config._experts_implementation == "qfp8"
    model.config._experts_implementation = implementation
    assert not any(p.dim() == 3 for p in model.parameters())  # the float experts are gone
    entries = {e.name: e for e in report.entries if e.experts}
    assert len(entries) == 4 and all(e.quantized and e.kernel == module.gate_up_proj.packing for e in entries.values())
    with torch.no_grad():
        out = module(*inputs).double()
    fp8_weights = {a: dequantized(getattr(module, a)) for a in float_weights}
    # The kernel's own error, against the same FP8 weights (and, W8A8, the same FP8 inputs: an FP8 x FP8
    # product is exact in float32; the reference's float64 gate/up product can round a rare down_proj input
    # to the FP8 neighbour of the kernel's, hence 1e-3, far below the ~3e-2 of not quantizing the inputs).
    granularity = kwargs.get("activation_scale", "token")
    activations = fake_quantized(granularity) if "activations" in kwargs else None
    on_grid = reference_output(module, fp8_weights, inputs, activations)
    rel = (out - on_grid).norm() / on_grid.norm()
    assert rel < (1e-3 if activations else 1e-5), rel
    if activations:  # the inputs were quantized: the weight-only product of the same weights is far off
        weight_only = reference_output(module, fp8_weights, inputs)
        assert (out - weight_only).norm() / weight_only.norm() > 1e-2
    assert formats.sqnr(exact, out) > (22 if "activations" in kwargs else 25)  # e4m3: ~31 dB per weight


@pytest.mark.parametrize("tokens", [1, 24])
def test_the_qfp8_implementation_computes_what_the_eager_loop_does(tokens):
    model = moe("qwen3_moe")
    quiet_quantize(model, activations="dynamic")
    module = experts_of(model)[0]
    hidden, index, weights = routed_inputs(module, tokens=tokens)
    index[0, 1] = len(module.gate_up_proj)  # a pair routed past this rank's experts (expert parallel): skipped
    outputs = {}
    for implementation in ("qfp8", "eager"):
        model.config._experts_implementation = implementation
        with torch.no_grad():
            outputs[implementation] = module(hidden, index, weights)
    # Same FP8 products; only the order of the routing-weighted sum differs.
    assert torch.allclose(outputs["qfp8"], outputs["eager"], rtol=1e-5, atol=1e-6)
    assert outputs["qfp8"].dtype == hidden.dtype and outputs["qfp8"].abs().min(-1).values.gt(0).all()


@pytest.mark.parametrize("tokens", [1, 5])
def test_expert_ids_past_the_layer_are_refused_with_the_sizes(tokens):
    model = moe()
    quiet_quantize(model)
    module = experts_of(model)[0]
    hidden, index, weights = routed_inputs(module, tokens=tokens)
    for bad in (7, -1):
        index[0, 0] = bad
        with pytest.raises(
            ValueError, match=rf"MixtralExperts: top_k_index holds expert {bad}; this layer has experts 0 to 3"
        ):
            module(hidden, index, weights)
    with pytest.raises(IndexError, match="expert 4 of QExperts with 4 experts"):
        module.gate_up_proj[4]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_names_are_transformers_own_and_round_trip_bitwise(arch, tmp_path):
    float_model = moe(arch)
    float_model.save_pretrained(tmp_path / "float")
    expected = set(safetensors.torch.load_file(tmp_path / "float" / "model.safetensors"))
    model = moe(arch)
    quiet_quantize(model, activations="dynamic")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
    qfp8.save_pretrained(model, tmp_path / "q")
    stored = safetensors.torch.load_file(tmp_path / "q" / "model.safetensors")
    weights = {k for k in stored if not k.endswith("_scale")}
    assert weights == expected, sorted(weights ^ expected)[:6]
    expert_weights = [k for k in stored if ".experts.0." in k and k.endswith(".weight")]
    assert expert_weights and all(stored[k].dtype == torch.float8_e4m3fn for k in expert_weights)
    assert all(stored[k + "_scale"].shape == (stored[k].shape[0], 1) for k in expert_weights)
    reloaded = qfp8.from_pretrained(tmp_path / "q")
    assert isinstance(experts_of(reloaded)[0].gate_up_proj, QExperts)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


def test_per_tensor_scales_are_written_per_part_and_read_back(tmp_path):
    model = moe()
    quiet_quantize(model, weight_scale="tensor")
    qfp8.save_pretrained(model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    w1 = stored["model.layers.0.block_sparse_moe.experts.2.w1.weight_scale"]
    w3 = stored["model.layers.0.block_sparse_moe.experts.2.w3.weight_scale"]
    assert w1.shape == (1,) and torch.equal(w1, w3)
    assert torch.equal(w1, experts_of(model)[0].gate_up_proj.experts[2].weight_scale)
    reloaded = experts_of(qfp8.from_pretrained(tmp_path))[0].gate_up_proj
    assert reloaded.scheme.weight_scale == "tensor"  # equal parts' scales stay one per-tensor scale
    assert torch.equal(reloaded.experts[2].weight_scale, w1)


def test_a_missing_expert_part_is_named(tmp_path):
    model = moe()
    quiet_quantize(model)
    qfp8.save_pretrained(model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    # (Without its scale as well: the reader names a weight_scale without its weight itself.)
    del stored["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    del stored["model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"]
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"quantizes 3 of the 4 expert parts of model\.layers\.1\.mlp\.experts\.down_proj \(the others"
    ):
        qfp8.from_pretrained(tmp_path)


def test_excluded_experts_stay_float_and_are_written_per_expert(tmp_path):
    model = moe()
    gate_up = experts_of(model)[1].gate_up_proj.detach().clone()
    _, report = quiet_quantize(model, exclude=["lm_head", "model.layers.1.mlp.experts.*"])
    skipped = {e.name for e in report.skipped if e.experts}
    assert skipped == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    qfp8.save_pretrained(model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert torch.equal(stored["model.layers.1.block_sparse_moe.experts.1.w3.weight"], gate_up[1, 128:])
    config = qfp8.checkpoint.writer.model_quantization_config(model)
    assert "model.layers.1.block_sparse_moe.experts.1.w3" in config["ignore"]
    reloaded = qfp8.from_pretrained(tmp_path)
    assert torch.equal(experts_of(reloaded)[1].gate_up_proj, gate_up)
    assert isinstance(experts_of(reloaded)[0].gate_up_proj, QExperts)


def test_accuracy_gptq_leaves_experts_float_with_the_reason():
    model = moe()
    _, report = quiet_quantize(model, accuracy="gptq")
    experts = [e for e in report.entries if e.experts]
    reason = "accuracy='gptq' is not built for fused MoE experts"
    assert experts and all(not e.quantized and reason in e.reason for e in experts)
    assert all(isinstance(m.gate_up_proj, torch.nn.Parameter) for m in experts_of(model))


def calibrated_static_model(arch: str = "mixtral"):
    """A static-W8A8 model calibrated on random ids, with the largest |input| each experts module saw."""
    model = moe(arch)
    quiet_quantize(model, activations="static")
    seen = {}

    def record(module, args):
        seen[module] = max(seen.get(module, 0.0), float(args[0].abs().max()))

    hooks = [m.register_forward_pre_hook(record) for m in experts_of(model)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    with qfp8.calibrate(model):
        model(ids)
    for hook in hooks:
        hook.remove()
    return model, seen


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_static_experts_share_one_calibrated_input_scale_per_fused_weight(arch):
    model, seen = calibrated_static_model(arch)
    for module in experts_of(model):
        gate_up = {float(e.input_scale) for e in module.gate_up_proj.experts}
        down = {float(e.input_scale) for e in module.down_proj.experts}
        assert len(gate_up) == 1 and len(down) == 1  # one scale per fused weight, every expert included
        # Every token reaches some expert: the gate/up scale is the scale of the whole experts input.
        expected = float(formats.scale_from_amax(torch.tensor([seen[module]]), torch.float8_e4m3fn))
        assert gate_up.pop() == pytest.approx(expected, rel=1e-6)
        # Each expert's matmul rounds its input with that scale (random inputs, larger than calibration's:
        # clamped at the FP8 maximum, as a static scale does).
        g = torch.Generator().manual_seed(8)
        for fused in (module.gate_up_proj, module.down_proj):
            scale = fused.experts[0].input_scale
            weights = dequantized(fused).double()
            for e in range(len(fused)):
                x = torch.randn(5, fused.in_features, generator=g)
                with torch.no_grad():
                    y = torch.nn.functional.linear(x, fused[e]).double()
                ref = fake_quantized("tensor", scale)(x.double()) @ weights[e].T
                assert ((y - ref).norm() / ref.norm()) < 1e-5


def test_static_experts_before_calibration_say_so():
    model = moe()
    quiet_quantize(model, activations="static")
    with pytest.raises(RuntimeError, match="never calibrated"), torch.no_grad():
        model(torch.randint(0, 128, (1, 5)))
    module = experts_of(model)[0]  # the experts themselves name the expert
    with pytest.raises(
        RuntimeError, match=r"module .model\.layers\.0\.mlp\.experts\.gate_up_proj\[\d\].: QLinear.*never calibrated"
    ):
        with torch.no_grad():
            module(*routed_inputs(module))
    with pytest.raises(RuntimeError, match=r"mlp\.experts\.gate_up_proj\[0\]"):
        qfp8.freeze(model)


def test_static_experts_load_into_an_uncalibrated_model():
    model, _ = calibrated_static_model()
    other = moe(seed=5)
    quiet_quantize(other, activations="static")
    qfp8.load_state_dict(other, model.state_dict())
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)


def test_static_experts_round_trip_under_transformers_names(tmp_path):
    model, _ = calibrated_static_model()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
    qfp8.save_pretrained(model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    w1, w3 = (stored[f"model.layers.1.block_sparse_moe.experts.2.{p}.input_scale"] for p in ("w1", "w3"))
    assert torch.equal(w1, w3) and w1.dtype == torch.float32
    assert torch.equal(w1.reshape(1), experts_of(model)[1].gate_up_proj.experts[2].input_scale)
    reloaded = qfp8.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)
    assert experts_of(reloaded)[0].gate_up_proj.experts[1].label == "model.layers.0.mlp.experts.gate_up_proj[1]"


def test_block_rows_straddling_gate_and_up_are_refused_per_module():
    model = moe()  # gate and up: 128 rows each
    _, report = quiet_quantize(model, weight_scale="block", block_size=(96, 64))
    reasons = {e.name.rsplit(".", 1)[1]: e.reason for e in report.entries if e.experts}
    assert "would straddle the gate and up halves (128 rows each)" in reasons["gate_up_proj"]
    assert reasons["down_proj"] == ""  # down_proj has no parts


def test_nan_in_an_expert_is_refused_before_anything_changes():
    model = moe()
    module = experts_of(model)[1]
    module.down_proj.data[2, 5, 7] = float("nan")
    with pytest.raises(ValueError, match=r"module 'model\.layers\.1\.mlp\.experts\.down_proj': weight \[4, 64, 128\]"):
        qfp8.quantize(model)
    assert not any(isinstance(m, (qfp8.QLinear, QExperts)) for m in model.modules())


def test_report_counts_quantized_experts_with_the_linears():
    model = moe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "left in float" warning: only the small routers are
        _, report = qfp8.quantize(model)
    assert {o.kind for o in report.others} == {"MixtralTopKRouter"}
    assert report.other_fraction < 0.01
    assert "4 x [256, 64]" in str(report)


def test_dtype_and_device_moves_keep_fp8_experts():
    model = moe()
    quiet_quantize(model)
    module = experts_of(model)[0]
    inputs = routed_inputs(module)
    model.to(torch.bfloat16)
    assert module.gate_up_proj.orig_dtype == torch.bfloat16
    assert module.gate_up_proj.experts[0].qweight.dtype in (torch.float8_e4m3fn, torch.uint8)
    assert module.gate_up_proj.experts[0].weight_scale.dtype == torch.float32
    hidden, index, weights = inputs
    with torch.no_grad():
        out = module(hidden.bfloat16(), index, weights.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_state_dict_round_trip_through_load_state_dict():
    model = moe()
    quiet_quantize(model)
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj.weight"].shape == (4, 256, 64)
    other = moe(seed=5)
    quiet_quantize(other)
    qfp8.load_state_dict(other, state)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    "cli, in_memory",
    [
        ({"activations": "dynamic"}, {"activations": "dynamic"}),
        ({"weight_scale_granularity": "tensor"}, {"weight_scale": "tensor"}),
    ],
    ids=["w8a8", "per-tensor"],
)
def test_the_streaming_cli_quantizes_experts_as_quantize_does(cli, in_memory, tmp_path):
    from qfp8.checkpoint.stream import stream_quantize

    moe().save_pretrained(tmp_path / "float")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept in float, nothing to warn about
        warnings.filterwarnings("ignore", "vLLM's CPU engine")  # no W8A16 kernel there (tests/vllm)
        if "activations" not in cli:  # but W8A16 experts, which vLLM's fused MoE does not take
            warnings.filterwarnings("ignore", "(?s)vLLM cannot load or run.*MoE experts quantized weight-only")
        stream_quantize(tmp_path / "float", tmp_path / "cli", progress=False, **cli)
    stored = safetensors.torch.load_file(tmp_path / "cli" / "model.safetensors")
    w1, w3 = (f"model.layers.0.block_sparse_moe.experts.3.{p}" for p in ("w1", "w3"))
    assert stored[w3 + ".weight"].dtype == torch.float8_e4m3fn
    if "weight_scale" in in_memory:  # per tensor: the gate and up parts share the expert's scale
        assert torch.equal(stored[w1 + ".weight_scale"], stored[w3 + ".weight_scale"])
    from_cli = qfp8.from_pretrained(tmp_path / "cli")
    assert experts_of(from_cli)[0].gate_up_proj.scheme.weight_scale == in_memory.get("weight_scale", "channel")
    reference = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "float").eval()
    quiet_quantize(reference, **in_memory)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(from_cli(ids).logits, reference(ids).logits)


def autofp8_mixtral(directory):
    """A Mixtral checkpoint as AutoFP8 writes one (quant_method "fp8", static): every expert part with its own
    per-tensor weight scale (w1 and w3 differ) and input scale. Returns {checkpoint name: tensor}."""
    moe().save_pretrained(directory)
    state = safetensors.torch.load_file(directory / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    for key in [k for k in state if ".experts." in k and k.endswith(".weight")]:
        module = key[: -len(".weight")]
        scale = (state[key].abs().max() / 448 * (1 + torch.rand((), generator=g))).float()
        state[key] = (state[key] / scale).to(torch.float8_e4m3fn)
        state[module + ".weight_scale"] = scale
        state[module + ".input_scale"] = (0.01 + 0.01 * torch.rand((), generator=g)).float()
    safetensors.torch.save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (directory / "config.json").write_text(json.dumps(config))
    return state


def test_a_checkpoint_with_different_w1_w3_scales_loads_exactly_as_channel_scales(tmp_path):
    stored = autofp8_mixtral(tmp_path / "src")
    model = qfp8.from_pretrained(tmp_path / "src")
    module = experts_of(model)[1]
    gate_up = module.gate_up_proj
    assert isinstance(gate_up, QExperts) and gate_up.scheme.weight_scale == "channel"
    assert gate_up.scheme.activations == "static" and module.down_proj.scheme.weight_scale == "tensor"
    stem = "model.layers.1.block_sparse_moe.experts"
    for e in range(len(gate_up)):
        w1, w3 = (stored[f"{stem}.{e}.w{p}.weight"].float() * stored[f"{stem}.{e}.w{p}.weight_scale"] for p in "13")
        assert torch.equal(dequantized(gate_up)[e], torch.cat([w1, w3]))  # the stored values, exactly
        inputs = [stored[f"{stem}.{e}.w{p}.input_scale"] for p in "13"]
        assert float(gate_up.experts[e].input_scale) == float(max(inputs))  # vLLM's one scale for w1 and w3
        x = torch.randn(3, gate_up.in_features)
        with torch.no_grad():
            y = torch.nn.functional.linear(x, gate_up[e]).double()
        ref = fake_quantized("tensor", gate_up.experts[e].input_scale)(x.double()) @ torch.cat([w1, w3]).double().T
        assert (y - ref).norm() / ref.norm() < 1e-5
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    qfp8.save_pretrained(model, tmp_path / "again")  # written back per channel, read back bitwise
    with torch.no_grad():
        assert torch.equal(qfp8.from_pretrained(tmp_path / "again")(ids).logits, logits)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(activations="dynamic"), dict(activations="static"), dict(weight_scale="block", block_size=(32, 32))],
    ids=["w8a16", "w8a8-token", "w8a8-static", "w8a16-block"],
)
def test_decode_compiles_with_fullgraph_and_no_recompile_when_the_routing_changes(arch, kwargs):
    """Each expert's rows go to its kernel inside torch.ops.qfp8.experts_linear, which compile keeps opaque."""
    from torch._dynamo.utils import counters

    model = moe(arch)
    quiet_quantize(model, **kwargs)
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(9))
    if kwargs.get("activations") == "static":
        with torch.no_grad(), qfp8.calibrate(model):
            model(prompt)
    torch._dynamo.reset()
    counters.clear()

    def step(tokens, cache, position):
        return model(tokens, past_key_values=cache, use_cache=True, cache_position=position).logits

    compiled = torch.compile(step, fullgraph=True)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    routings = set()
    with torch.no_grad():
        for cache in caches:
            model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(6))
        tokens = prompt[:, -1:].clone()  # contiguous, as the argmax tokens of later steps are
        for i in range(8):
            position = torch.tensor([6 + i])
            got = compiled(tokens, caches[0], position)
            seen = experts_of(model)[0].register_forward_pre_hook(
                lambda module, args: routings.add(tuple(args[1].flatten().tolist()))
            )
            expected = step(tokens, caches[1], position)  # eager, recording layer 0's routing
            seen.remove()
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
            tokens = expected[:, -1:].argmax(-1)
    assert len(routings) > 1  # the routing changed between steps
    assert counters["stats"]["unique_graphs"] == 1  # one graph, every step (no recompile)
    torch._dynamo.reset()


def quantized_down_proj() -> QExperts:
    """The W8A16 down_proj experts (4 experts) of layer 0 of a quantized tiny Mixtral."""
    model = moe()
    quiet_quantize(model)
    return model.model.layers[0].mlp.experts.down_proj


def test_experts_linear_op_checks_ids_and_gives_zeros_to_other_ranks_rows():
    from qfp8.library.testing import opcheck

    qexperts = quantized_down_proj()
    x = torch.randn(5, qexperts.in_features)
    ids = torch.tensor([0, 0, 2, 3, 4])  # 4 = num_experts: a pair another rank computes
    args = (
        [e.qweight for e in qexperts.experts],
        [e.weight_scale for e in qexperts.experts],
        [],
        qexperts.packing,
        "channel",
        [],
        "none",
        torch.float8_e4m3fn,
        qexperts.out_features,
        qexperts.in_features,
    )
    out = torch.ops.qfp8.experts_linear(x, ids, *args)
    for e in ids.unique().tolist():  # each expert's rows in one call of its layer
        rows = ids == e
        expected = qexperts.experts[e](x[rows]) if e < 4 else torch.zeros(int(rows.sum()), qexperts.out_features)
        assert torch.equal(out[rows], expected), e
    opcheck(torch.ops.qfp8.experts_linear.default, (x, ids, *args))
    with pytest.raises(ValueError, match="expert id 5; the layer has experts 0 to 3"):
        torch.ops.qfp8.experts_linear(x, torch.tensor([0, 1, 2, 3, 5]), *args)


def test_a_block_fp8_checkpoint_as_qwen_releases_them_loads_exactly(tmp_path):
    # Qwen3-MoE's official FP8 checkpoints: quant_method "fp8" with weight_block_size, FP8 weights and
    # weight_scale_inv (one float32 scale per block, dequantized = weight * scale) for every expert part.
    block = (64, 32)
    model = moe("qwen3_moe")
    model.save_pretrained(tmp_path)
    state = safetensors.torch.load_file(tmp_path / "model.safetensors")
    for key in [k for k in state if ".experts." in k and k.endswith(".weight")]:
        q, scale = formats.quantize_weight(state[key], torch.float8_e4m3fn, "block", block)
        state[key], state[key[: -len("weight")] + "weight_scale_inv"] = q, scale
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = qfp8.from_pretrained(tmp_path)
    gate_up = experts_of(loaded)[1].gate_up_proj
    assert isinstance(gate_up, QExperts) and gate_up.scheme.weight_scale == "block"
    stem = "model.layers.1.mlp.experts.3"
    stored = [
        formats.dequantize_weight(state[f"{stem}.{p}.weight"], state[f"{stem}.{p}.weight_scale_inv"], block)
        for p in ("gate_proj", "up_proj")
    ]
    assert torch.equal(dequantized(gate_up)[3], torch.cat(stored))
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()


def test_accuracy_scale_fits_each_routed_expert_and_keeps_the_others_rounded_to_nearest():
    model = moe()
    module = experts_of(model)[0]
    float_gate_up = module.gate_up_proj.detach().clone()
    hidden, _, weights = routed_inputs(module, tokens=48)
    g = torch.Generator().manual_seed(12)
    index = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(48)])  # expert 3 gets no token
    rtn = [
        formats.dequantize_weight(*formats.quantize_weight(w, torch.float8_e4m3fn, "channel")) for w in float_gate_up
    ]
    _, report = quiet_quantize(model, accuracy="scale")
    assert all(e.quantized for e in report.entries if e.experts)
    with qfp8.calibrate(model):
        module(hidden, index, weights)
    fitted = dequantized(module.gate_up_proj)
    assert not any(e.accuracy_pending for e in module.gate_up_proj.experts + module.down_proj.experts)
    assert torch.equal(fitted[3], rtn[3])  # never routed: nearest rounding
    for e in range(3):  # routed: the scales minimise sum_k err_k^2 H_kk over the inputs it saw
        diag = hidden[(index == e).any(-1)].square().sum(0)
        objective = {
            k: float(((w - float_gate_up[e]).square() * diag).sum()) for k, w in (("fit", fitted[e]), ("rtn", rtn[e]))
        }
        assert objective["fit"] < objective["rtn"], objective


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_static_w8a8_with_fp8_kv_cache_generates_the_same_tokens_after_reload(arch, tmp_path):
    model = moe(arch)
    quiet_quantize(model, activations="static", kv_cache="float8_e4m3fn")
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(13))
    with qfp8.calibrate(model):
        model(ids)
    qfp8.freeze(model)
    generated = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    qfp8.save_pretrained(model, tmp_path)
    reloaded = qfp8.from_pretrained(tmp_path)
    assert isinstance(experts_of(reloaded)[0].down_proj, QExperts)
    assert torch.equal(reloaded.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0), generated)


def test_loading_an_moe_checkpoint_peaks_near_its_size(tmp_path, rss_reader):
    # A separate process, its first load measured (the modeling code imported before). The experts are
    # read one at a time from the mapped file (no stacked copy of a fused weight), and the file's pages
    # are let go once packed.
    config = transformers.MixtralConfig(
        **{**COMMON, "hidden_size": 512, "num_hidden_layers": 4},
        intermediate_size=1024, num_local_experts=16, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    quiet_quantize(model)
    qfp8.save_pretrained(model, tmp_path)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    del model
    script = rss_reader + textwrap.dedent(
        f"""
        import json, qfp8, torch, transformers.models.mixtral.modeling_mixtral
        with torch.device("meta"):  # the modeling code imported and run once, without weights
            transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained({str(tmp_path)!r}))
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
        base = rss("VmRSS:")
        model = qfp8.from_pretrained({str(tmp_path)!r})
        print(json.dumps({{"load_peak": rss("VmHWM:") - base}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"checkpoint {size / 1e6:.1f} MB, load peak +{figures['load_peak'] / 1e6:.1f} MB")
    assert figures["load_peak"] <= 1.5 * size + 8e6  # about 1.1x; stacking every fused weight first would be 3x


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_whose_parts_fit_one_block_round_trip(arch, tmp_path):
    # 128 x 128 blocks on 128-row parts: one block scale per part, [1, 1], which is not a per-tensor scale.
    model = moe(arch)
    quiet_quantize(model, weight_scale="block")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        logits = model(ids).logits
    qfp8.save_pretrained(model, tmp_path)
    reloaded = qfp8.from_pretrained(tmp_path)
    assert all(m.gate_up_proj.scheme.weight_scale == "block" for m in experts_of(reloaded))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


def test_a_whole_moe_model_unpickles_in_a_new_process(tmp_path):
    model = moe()
    quiet_quantize(model)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save({"model": model, "ids": ids, "logits": expected}, tmp_path / "model.pt")
    script = textwrap.dedent(
        f"""
        import torch, qfp8
        saved = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        with torch.no_grad():
            assert torch.equal(saved["model"](saved["ids"]).logits, saved["logits"])
        print(saved["model"].config._experts_implementation)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("qfp8")


@pytest.mark.parametrize(
    "implementation, message",
    [
        ("grouped_mm", r"is not a tensor \(asked for \.transpose\).*'qfp8'"),
        ("batched_mm", r"is indexed one expert at a time, got Tensor of shape \[\d+\].*'qfp8'"),
    ],
)
def test_experts_implementations_that_take_whole_weights_say_what_to_set(implementation, message):
    model = moe()
    quiet_quantize(model)
    model.config._experts_implementation = implementation
    with pytest.raises(TypeError, match=message), torch.no_grad():
        model(torch.randint(0, 128, (1, 5)))
    assert not hasattr(experts_of(model)[0].gate_up_proj, "data")  # hasattr still answers False


def test_the_streaming_cli_excludes_a_fused_weight_whole(tmp_path):
    from qfp8.checkpoint.stream import stream_quantize

    moe().save_pretrained(tmp_path / "float")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each pattern matches: no "excludes nothing" warning
        warnings.filterwarnings("ignore", "vLLM cannot load or run")  # experts partly float, W8A16
        warnings.filterwarnings("ignore", "vLLM's CPU engine")  # no W8A16 kernel there (tests/vllm)
        stream_quantize(tmp_path / "float", tmp_path / "a", exclude=["lm_head", "*.w1"], progress=False)
        stream_quantize(
            tmp_path / "float", tmp_path / "b", exclude=["lm_head", "*mlp.experts.down_proj"], progress=False
        )
    a, b = (safetensors.torch.load_file(tmp_path / d / "model.safetensors") for d in "ab")
    stem = "model.layers.0.block_sparse_moe.experts.1"
    # A part pattern (w1) keeps the whole gate/up weight float, w3 included: qfp8 holds it with one scheme.
    assert a[f"{stem}.w1.weight"].dtype == a[f"{stem}.w3.weight"].dtype == torch.float32
    assert a[f"{stem}.w2.weight"].dtype == torch.float8_e4m3fn
    assert b[f"{stem}.w2.weight"].dtype == torch.float32 and b[f"{stem}.w1.weight"].dtype == torch.float8_e4m3fn
    for d in "ab":
        kinds = {
            type(m.gate_up_proj).__name__ + "/" + type(m.down_proj).__name__
            for m in experts_of(qfp8.from_pretrained(tmp_path / d))
        }
        assert kinds == {"Parameter/QExperts" if d == "a" else "QExperts/Parameter"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_load_state_dict_takes_the_checkpoint_names_save_pretrained_writes(arch, tmp_path):
    model, _ = calibrated_static_model(arch)
    qfp8.save_pretrained(model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith("gate_up_proj.weight") for k in stored)  # per-expert names in the file
    other = moe(arch, seed=5)
    quiet_quantize(other, activations="static")
    qfp8.load_state_dict(other, stored)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)


def test_experts_transformers_stores_stacked_are_refused_at_save_with_what_to_exclude(tmp_path):
    # GraniteMoE: transformers renames the 3-D input_linear.weight to experts.gate_up_proj, with no
    # per-expert names to write FP8 2-D weights under.
    config = transformers.GraniteMoeConfig(**COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(config).eval()
    quiet_quantize(model)
    assert isinstance(experts_of(model)[0].gate_up_proj, QExperts)  # it runs in FP8 in memory
    with pytest.raises(
        ValueError,
        match=r"input_linear\.weight\), not per expert.*exclude=\['lm_head', '\*experts\.down_proj', '\*experts\.gate_up_proj'\]",
    ):
        qfp8.save_pretrained(model, tmp_path / "q")
    assert not any((tmp_path / "q").glob("*")) if (tmp_path / "q").exists() else True  # nothing written
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(config).eval()
    quiet_quantize(model, exclude=["lm_head", "*experts.down_proj", "*experts.gate_up_proj"])
    qfp8.save_pretrained(model, tmp_path / "q")
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        assert torch.equal(qfp8.from_pretrained(tmp_path / "q")(ids).logits, model(ids).logits)


def test_torch_load_state_dict_reports_unexpected_keys_under_the_experts():
    model = moe()
    quiet_quantize(model)
    for extra in ("bogus", "input_scale"):  # a W8A16 layer has no input_scale
        state = dict(model.state_dict())
        state[f"model.layers.0.mlp.experts.gate_up_proj.{extra}"] = torch.ones(4, 1)
        with pytest.raises(RuntimeError, match=rf"Unexpected key\(s\).*experts.gate_up_proj.{extra}"):
            model.load_state_dict(state)


def test_an_uncalibrated_static_moe_loads_its_own_state_dict_and_a_calibrated_one():
    source, _ = calibrated_static_model()
    target = moe()
    quiet_quantize(target, activations="static")
    target.load_state_dict(target.state_dict())  # no input_scale yet: nothing missing
    target.load_state_dict(source.state_dict())  # fills the empty slots
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)


def test_save_warns_for_block_scaled_experts_transformers_cannot_load(tmp_path):
    model = moe()
    quiet_quantize(model, weight_scale="block", block_size=(32, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, tmp_path)
    (message,) = [str(w.message) for w in caught if "transformers cannot" in str(w.message)]
    assert (
        "model.layers.*.block_sparse_moe.experts.*.w1" in message and "MoE experts with block weight scales" in message
    )
    assert "self_attn" not in message  # dense block layers load
    with pytest.raises(RuntimeError, match="conversion"):  # what the warning says
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(qfp8.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_group_activations_on_experts_do_not_warn_for_transformers(tmp_path):
    # transformers dequantizes experts to float, so their K needs no 128 groups (down_proj: K = 128 here,
    # gate_up: K = 64 would otherwise be named).
    model = moe()
    quiet_quantize(model, activations="dynamic", activation_scale="group", exclude=("lm_head", "*.self_attn.*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.save_pretrained(model, tmp_path)
    assert not [str(w.message) for w in caught if "transformers cannot" in str(w.message)]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()


@pytest.mark.parametrize("kwargs", [dict(), dict(activations="dynamic")], ids=["w8a16", "w8a8-token"])
def test_compiled_fullgraph_with_gradients_matches_eager_input_gradients(kwargs):
    """With gradients on (a float adapter trained on top), the traced experts carry the input gradient."""
    model = moe()
    quiet_quantize(model, **kwargs)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))

    def run(forward):
        embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)
        out = forward(embeds)
        out.float().square().mean().backward()
        return out.detach(), embeds.grad

    def forward(embeds):
        return model(inputs_embeds=embeds).logits

    torch._dynamo.reset()
    eager_out, eager_grad = run(forward)
    compiled_out, compiled_grad = run(torch.compile(forward, fullgraph=True))
    assert (compiled_out - eager_out).abs().max() <= 1e-5 * eager_out.abs().max()
    assert (compiled_grad - eager_grad).abs().max() <= 1e-5 * eager_grad.abs().max()
    torch._dynamo.reset()


def test_experts_linear_grad_input_op():
    from qfp8 import formats
    from qfp8.library.testing import opcheck

    qexperts = quantized_down_proj()
    grad = torch.randn(5, qexperts.out_features)
    ids = torch.tensor([0, 1, 1, 3, 4])  # 4: another rank's pair, no gradient
    args = ([e.qweight for e in qexperts.experts], [e.weight_scale for e in qexperts.experts], qexperts.packing, [])
    out = torch.ops.qfp8.experts_linear_grad_input(grad, ids, *args, qexperts.out_features, qexperts.in_features)
    for row, e in enumerate(ids.tolist()):
        if e == 4:
            assert not out[row].any()
            continue
        layer = qexperts.experts[e]
        weight = formats.dequantize_weight(layer.canonical_weight(), layer.weight_scale, None)
        torch.testing.assert_close(out[row], grad[row] @ weight, rtol=1e-5, atol=1e-6)
    opcheck(
        torch.ops.qfp8.experts_linear_grad_input.default,
        (grad, ids, *args, qexperts.out_features, qexperts.in_features),
    )


@pytest.mark.parametrize("block_size", [(), (16, 32)], ids=["channel", "block"])
def test_second_order_gradients_through_the_experts_op_match_float64(block_size):
    """A gradient penalty (the input gradient's own gradient) through ``experts_linear`` called directly, as an
    exported graph calls it: the input-gradient op has a backward too (its int[] block_size, empty or not,
    takes no gradient)."""
    model = moe()
    quiet_quantize(model, **({"weight_scale": "block", "block_size": block_size} if block_size else {}))
    qexperts = model.model.layers[0].mlp.experts.down_proj
    ids = torch.tensor([0, 1, 1, 3, 3, 3])
    x = torch.randn(len(ids), qexperts.in_features, generator=torch.Generator().manual_seed(5))
    weights = [
        formats.dequantize_weight(e.canonical_weight(), e.weight_scale, block_size or None).double()
        for e in qexperts.experts
    ]
    first = qexperts.experts[0]
    args = (
        [e.qweight for e in qexperts.experts],
        [e.weight_scale for e in qexperts.experts],
        [],
        qexperts.packing,
        first.scheme.weight_scale,
        list(block_size),
        "none",
        torch.float8_e4m3fn,
        qexperts.out_features,
        qexperts.in_features,
    )

    def penalty_gradient(forward, x):
        x = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(forward(x).tanh().sum(), x, create_graph=True)
        return torch.autograd.grad(grad.square().sum(), x)[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = penalty_gradient(lambda x: torch.ops.qfp8.experts_linear(x, ids, *args), x)
    # torch's fallback for an op without an autograd formula warns (the gradient may be wrong or missing).
    assert not [w for w in caught if "autograd kernel was not registered" in str(w.message)]
    want = penalty_gradient(
        lambda x: torch.stack([x[r] @ weights[e].t() for r, e in enumerate(ids.tolist())]), x.double()
    )
    assert want.abs().sum() > 0
    assert (got.double() - want).norm() / want.norm() < 1e-5


def test_without_the_extension_the_experts_op_differentiates_with_block_scales_too(tmp_path):
    """Without the C++ Autograd kernel the op gets a Python one, whose gradients must match the inputs' tree."""
    script = tmp_path / "check.py"
    script.write_text(
        "import warnings, torch, qfp8\n"
        "from qfp8 import formats\n"
        "from qfp8.library import cpu\n"
        "assert cpu.cpu_kernel_isa() is None\n"
        "w = torch.randn(2, 24, 40)\n"
        "qs = [formats.quantize_weight(w[e], torch.float8_e4m3fn, 'block', (8, 8)) for e in range(2)]\n"
        "x = torch.randn(3, 40, requires_grad=True)\n"
        "ids = torch.tensor([0, 1, 1])\n"
        "y = torch.ops.qfp8.experts_linear(x, ids, [q for q, _ in qs], [s for _, s in qs], [], 'reference', "
        "'block', [8, 8], 'none', torch.float8_e4m3fn, 24, 40)\n"
        "(g,) = torch.autograd.grad(y.sum(), x)\n"
        "d = [formats.dequantize_weight(q, s, (8, 8)) for q, s in qs]\n"
        "want = torch.stack([d[0].sum(0), d[1].sum(0), d[1].sum(0)])\n"
        "assert torch.allclose(g, want, rtol=1e-5, atol=1e-5), (g - want).abs().max()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "QFP8_NO_EXTENSION": "1"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
