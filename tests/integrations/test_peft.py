"""peft's LoRA on FP8 models (qfp8/integrations): dispatch, training, adapter files, merge, and adapters kept float.

Numerics against float64: the gradients LoRA trains with equal those of the
same model with its FP8 weights dequantized to float64 Linears; a merged
layer's FP8 weight is one FP8 rounding of ``W + scaling * B @ A``.
"""

import subprocess
import sys

import pytest
import torch
from torch import nn

import qfp8
from qfp8.nn import QLinear

peft = pytest.importorskip("peft", reason="the integration under test is peft's")
transformers = pytest.importorskip("transformers", reason="builds a tiny transformers model")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from qfp8.integrations.lora import LoraQLinear  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
SCHEMES = [
    pytest.param({}, id="w-channel"),
    pytest.param({"weight_scale": "tensor"}, id="w-tensor"),
    pytest.param({"weight_scale": "block", "block_size": (32, 32)}, id="w-block-32"),
    pytest.param({"activations": "dynamic"}, id="w-channel-a-token"),
    pytest.param({"weights": "float8_e5m2"}, id="w-e5m2-channel"),
]
# One FP8 rounding of a weight, as SQNR: e4m3 keeps 3 mantissa bits (about 32 dB measured on these weights),
# e5m2 two (about 26 dB).
MIN_ROUNDING_SQNR = {"float8_e4m3fn": 27.0, "float8_e5m2": 21.0}


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float(20 * torch.log10(want.norm() / (got.double() - want).norm()))


def _llama(seed: int = 0) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _fp8_llama(seed: int = 0, **scheme) -> nn.Module:
    return qfp8.quantize(_llama(seed), **scheme).model


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_get_peft_model_trains_only_the_adapters_on_fp8_layers(scheme):
    model = get_peft_model(_fp8_llama(**scheme), LoraConfig(target_modules=TARGETS, r=4))
    layers = _lora_layers(model)
    assert len(layers) == 4 and all(isinstance(m, LoraQLinear) for m in layers.values())
    assert all(isinstance(m.get_base_layer(), QLinear) for m in layers.values())
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    frozen = {name: m.get_base_layer().canonical_weight().clone() for name, m in layers.items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _tokens()
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.95 * losses[0], losses
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values())  # lora_A's too, once B moved
    for name, m in layers.items():
        assert torch.equal(m.get_base_layer().canonical_weight().view(torch.uint8), frozen[name].view(torch.uint8))


def _float64_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose QLinears are float64 nn.Linears of their dequantized weights."""
    import copy

    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, QLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = nn.Parameter(module.weight.dequantize(torch.float64), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, linear)
    return twin.double()


def test_adapter_gradients_match_the_float64_model():
    model = get_peft_model(_fp8_llama(), LoraConfig(target_modules=TARGETS, r=4, init_lora_weights=False))
    twin = _float64_twin(model)
    ids = _tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    twin(input_ids=ids, labels=ids).loss.backward()
    want = dict(twin.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            # Float32 arithmetic against float64, through attention and two layers: about 125 dB measured.
            assert sqnr(p.grad, want[name].grad) > 90, name
            checked += 1
    assert checked == 8


def test_adapter_saved_by_peft_loads_on_an_fp8_checkpoint(tmp_path):
    base = _fp8_llama()
    qfp8.save_pretrained(base, tmp_path / "base")
    model = get_peft_model(base, LoraConfig(target_modules=TARGETS, r=4, init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(qfp8.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert all(isinstance(m, LoraQLinear) for m in _lora_layers(loaded).values())
    ids = _tokens()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    merged = loaded.merge_and_unload()
    qfp8.save_pretrained(merged, tmp_path / "merged")
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        assert torch.equal(qfp8.from_pretrained(tmp_path / "merged")(input_ids=ids).logits, want)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_merge_and_unload_keeps_the_layers_fp8_and_the_outputs(scheme):
    model = get_peft_model(_fp8_llama(**scheme), LoraConfig(target_modules=TARGETS, r=4, init_lora_weights=False))
    ids = _tokens()
    wants = {}
    for name, m in _lora_layers(model).items():
        base = m.get_base_layer()
        delta = m.get_delta_weight("default").double()
        wants[name.removeprefix("base_model.model.")] = (base.weight.dequantize(torch.float64) + delta, base.scheme)
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
    merged_model = model.merge_and_unload()
    fp8 = scheme.get("weights", "float8_e4m3fn")
    for name, (want, scheme_before) in wants.items():
        layer = merged_model.get_submodule(name)
        assert type(layer) is QLinear and layer.scheme == scheme_before
        assert layer.qweight.dtype == getattr(torch, fp8) and layer.packing.startswith("cpu-")
        assert sqnr(layer.weight.dequantize(torch.float64), want) > MIN_ROUNDING_SQNR[fp8], name
    with torch.no_grad():
        merged = merged_model(input_ids=ids).logits
    # Four layers each rounded once more to FP8 (W8A8's activation rounding on top): 23-30 dB measured.
    assert sqnr(merged, unmerged) > MIN_ROUNDING_SQNR[fp8] - 8


def test_safe_merge_then_unmerge_returns_close_to_the_base_weight():
    model = get_peft_model(_fp8_llama(), LoraConfig(target_modules=TARGETS, r=4, init_lora_weights=False))
    layer = next(iter(_lora_layers(model).values()))
    before = layer.get_base_layer().weight.dequantize(torch.float64)
    merged = before + layer.get_delta_weight("default").double()
    layer.merge(safe_merge=True)
    assert layer.merged and layer.merged_adapters == ["default"]
    layer.unmerge()
    assert not layer.merged
    after = layer.get_base_layer().weight.dequantize(torch.float64)
    # Two roundings (merged, then unmerged), each at the scale of the merged weight (a random adapter is large).
    error_db = float(20 * torch.log10(merged.norm() / (after - before).norm()))
    assert error_db > MIN_ROUNDING_SQNR["float8_e4m3fn"] - 3


def test_quantize_after_lora_keeps_the_adapters_float_and_says_why():
    model = get_peft_model(_llama(), LoraConfig(target_modules=TARGETS, r=4, modules_to_save=["o_proj"]))
    model.base_model.model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)  # made trainable by hand
    trainable_before = {name for name, p in model.named_parameters() if p.requires_grad}
    report = qfp8.quantize(model).report
    reasons = {entry.name: entry.reason for entry in report.skipped}
    adapters = [name for name in reasons if ".lora_A." in name or ".lora_B." in name]
    assert len(adapters) == 8 and all(reasons[name].startswith("peft adapter (lora_") for name in adapters)
    saved_copies = [name for name in reasons if ".modules_to_save." in name]
    assert len(saved_copies) == 2 and all("modules_to_save" in reasons[name] for name in saved_copies)
    assert "trainable in a peft model" in reasons["base_model.model.model.layers.0.mlp.up_proj"]
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable_before
    layers = _lora_layers(model)
    assert all(isinstance(m, LoraQLinear) and isinstance(m.get_base_layer(), QLinear) for m in layers.values())
    ids = _tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if name in trainable_before)
    merged = model.merge_and_unload()
    assert isinstance(merged.model.layers[1].self_attn.q_proj, QLinear)


def test_merge_refusals_name_the_module():
    with pytest.raises(ValueError, match=r"module 'model.layers.0.self_attn.q_proj'.*DoRA"):
        get_peft_model(_fp8_llama(), LoraConfig(target_modules=TARGETS, r=4, use_dora=True))
    model = get_peft_model(_fp8_llama(), LoraConfig(target_modules=TARGETS, r=4, lora_bias=True))
    with pytest.raises(ValueError, match=r"module 'model.layers.0.self_attn.q_proj'.*no bias"):
        model.merge_and_unload()
    model = get_peft_model(_fp8_llama(accuracy="gptq"), LoraConfig(target_modules=TARGETS, r=4))
    with pytest.raises(ValueError, match=r"module 'model.layers.0.self_attn.q_proj'.*calibrat"):
        model.merge_and_unload()
    model = get_peft_model(_fp8_llama(), LoraConfig(target_modules=TARGETS, r=4))
    base = model.base_model.model.model.layers[0].mlp.up_proj
    with pytest.raises(ValueError, match=r"module 'model.layers.0.mlp.up_proj'.*shape \(96, 64\), got .*\(64, 96\)"):
        base.requantize(torch.zeros(64, 96))
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("nan"))
    before = layer.get_base_layer().canonical_weight().clone()
    for safe in (True, False):
        with pytest.raises(ValueError, match=r"module 'model.layers.1.self_attn.v_proj'.*NaN"):
            layer.merge(safe_merge=safe)
        assert not layer.merged
        assert torch.equal(layer.get_base_layer().canonical_weight().view(torch.uint8), before.view(torch.uint8))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_qfp8_imports_and_trains_without_peft():
    code = (
        "import sys; sys.modules['peft'] = None\n"  # peft not installed: importing it raises ImportError
        "import torch, qfp8\n"
        "model = qfp8.quantize(torch.nn.Sequential(torch.nn.Linear(16, 8))).model\n"
        "x = torch.randn(3, 16, requires_grad=True); model(x).sum().backward()\n"
        "assert x.grad is not None and 'peft.tuners.lora.model' not in sys.modules\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("order", ["qfp8-first", "peft-first"])
def test_dispatch_is_installed_whichever_is_imported_first(order):
    imports = "import qfp8, peft" if order == "qfp8-first" else "import peft, qfp8"
    code = (
        f"{imports}\n"
        "import torch\n"
        "from peft import LoraConfig, get_peft_model\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 8))\n"
        "model = get_peft_model(qfp8.quantize(model).model, LoraConfig(target_modules=['0'], r=2))\n"
        "assert type(model.base_model.model[0]).__name__ == 'LoraQLinear', type(model.base_model.model[0])\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
