import pytest
import torch
from torch import nn

import qfp8
from qfp8 import QLinear, formats


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.shared = nn.Linear(width, width)
        self.alias = self.shared  # the same module under two names
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.lm_head = nn.Linear(width, 10, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.alias(self.shared(x))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.lm_head(x)


def test_nested_modulelist_shared_and_report():
    model = Net()
    x = torch.randn(2, 5, 32)
    ref = model(x)
    model, report = qfp8.quantize(model)
    names = {e.name: e for e in report.entries}
    for name in ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "shared"]:
        assert names[name].quantized and names[name].scheme == "w-e4m3fn-channel a-float"
        assert isinstance(model.get_submodule(name), QLinear)
    assert names["shared"].aliases == ["alias"] and model.alias is model.shared
    assert not names["lm_head"].quantized and "excluded by pattern 'lm_head'" in names["lm_head"].reason
    assert not names["attn.out_proj"].quantized and "MultiheadAttention" in names["attn.out_proj"].reason
    assert len(report.entries) == 7 and len(report.quantized) == 5
    text = str(report)
    assert "blocks.0.up" in text and "shared (= alias)" in text and "5 quantized, 2 skipped" in text
    assert formats.sqnr(ref, model(x)) > 20


def test_exclude_patterns():
    model, report = qfp8.quantize(Net(), exclude=("blocks.*.down", "lm_head"))
    quantized = {e.name for e in report.quantized}
    assert quantized == {"blocks.0.up", "blocks.1.up", "shared"}
    assert isinstance(model.blocks[0].down, nn.Linear) and not isinstance(model.blocks[0].down, QLinear)


def test_nan_weight_is_refused_naming_the_module_and_model_is_untouched():
    model = Net()
    with torch.no_grad():
        model.blocks[1].down.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="blocks.1.down"):
        qfp8.quantize(model)
    assert not any(isinstance(m, QLinear) for m in model.modules())


def test_inf_weight_is_refused():
    model = Net()
    with torch.no_grad():
        model.shared.weight[3, 3] = float("inf")
    with pytest.raises(ValueError, match="'shared'.*NaN/Inf"):
        qfp8.quantize(model)


def test_float64_weight_beyond_float32_range_is_refused():
    """Finite in float64, but its float32 scale would be Inf (the layer would output NaN)."""
    model = Net().double()
    with torch.no_grad():
        model.shared.weight[2, 5] = 1e39
    with pytest.raises(ValueError, match=r"'shared'.*beyond float32's range \(\|w\| up to 1e\+39\)"):
        qfp8.quantize(model)
    assert not any(isinstance(m, QLinear) for m in model.modules())
    with pytest.raises(ValueError, match="'direct'.*beyond float32's range"):
        QLinear.from_linear(model.shared, qfp8.nn.QuantizationScheme(), "direct")


def test_zero_weight_gives_zero_output_not_nan():
    model = nn.Sequential(nn.Linear(16, 8, bias=False))
    nn.init.zeros_(model[0].weight)
    qfp8.quantize(model, activations="dynamic", exclude=())
    out = model(torch.randn(3, 16))
    assert torch.equal(out, torch.zeros(3, 8))
    assert torch.equal(model(torch.zeros(3, 16)), torch.zeros(3, 8))


def test_quantize_twice_and_freeze_before_quantize():
    with pytest.raises(ValueError, match="no QLinear.*qfp8.quantize"):
        qfp8.freeze(Net())
    with pytest.raises(ValueError, match="no QLinear.*qfp8.quantize"):
        with qfp8.calibrate(Net()):
            pass
    model, _ = qfp8.quantize(Net())
    with pytest.raises(ValueError, match="already quantized"):
        qfp8.quantize(model)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weights": "float8_e3m4"}, "unknown FP8 dtype"),
        ({"weight_scale": "row"}, "unknown weight_scale"),
        ({"activations": "always"}, "unknown activations"),
        ({"activation_scale": "head"}, "unknown activation_scale"),
        ({"kv_cache": "int8"}, "unknown kv_cache"),
        ({"weight_scale": "block", "block_size": (128,)}, "block_size"),
    ],
    ids=["weights", "weight_scale", "activations", "activation_scale", "kv_cache", "block_size"],
)
def test_unknown_scheme_strings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qfp8.quantize(Net(), **kwargs)


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        qfp8.quantize(torch.randn(3))
    with pytest.raises(TypeError, match="calibrate takes an nn.Module, got str"):
        with qfp8.calibrate("model"):
            pass
    with pytest.raises(TypeError, match="freeze takes an nn.Module, got Tensor"):
        qfp8.freeze(torch.randn(3))
    model, _ = qfp8.quantize(nn.Sequential(nn.Linear(16, 8)))
    with pytest.raises(TypeError, match=r"load_state_dict takes a dict of tensors, got str .*load_file"):
        qfp8.load_state_dict(model, "model.safetensors")


def test_static_never_calibrated_freeze_says_what_to_do():
    model, _ = qfp8.quantize(Net(), activations="static")
    with pytest.raises(RuntimeError, match="never calibrated.*blocks.0.up.*qfp8.calibrate"):
        qfp8.freeze(model)


def test_calibration_keeps_the_maximum_over_batches():
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model, activations="static", exclude=())
    big, small = torch.randn(4, 16) * 10, torch.randn(4, 16)
    with qfp8.calibrate(model):
        model(big)
        model(small)
    expected = big.abs().max() / 448
    assert model[0].input_scale.item() == pytest.approx(expected.item(), rel=1e-6)
    qfp8.freeze(model)


@pytest.mark.parametrize("activations", [None, "dynamic"], ids=["w8a16", "dynamic"])
def test_calibrate_warns_when_nothing_in_the_model_uses_it(activations):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    qfp8.quantize(model, activations=activations, exclude=())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(4, 16)
    with pytest.warns(UserWarning, match=r"nothing in Sequential uses calibration data: its 2 quantized layer"):
        with qfp8.calibrate(model):
            model(x)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_calibrate_of_a_static_model_does_not_say_it_changes_nothing(recwarn):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    qfp8.quantize(model, activations="static", exclude=())
    with qfp8.calibrate(model):
        model(torch.randn(4, 16))
    assert not [w for w in recwarn if "uses calibration data" in str(w.message)]
    assert torch.isfinite(model[0].input_scale).all() and model[0].input_scale.item() > 0


def test_calibration_sees_upstream_quantization_error():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    qfp8.quantize(model, activations="static", exclude=())
    x = torch.randn(64, 32)
    with qfp8.calibrate(model):
        model(x)
    first = model[0]
    # what the second layer must have seen: the first layer's quantized output
    scale = first.input_scale
    quantized_out = torch.ops.qfp8.scaled_linear(
        x, first.canonical_weight(), first.weight_scale, first.bias, scale, [], "static", torch.float8_e4m3fn
    )
    float_out = nn.functional.linear(x, first.weight.dequantize(torch.float32), first.bias)
    expected = quantized_out.abs().max() / 448
    assert model[1].input_scale.item() == pytest.approx(expected.item(), rel=1e-6)
    assert expected.item() != pytest.approx((float_out.abs().max() / 448).item(), rel=1e-7)


def test_static_calibrated_model_is_accurate():
    model = Net()
    x = torch.randn(4, 6, 32)
    ref = model(x)
    qfp8.quantize(model, activations="static")
    with qfp8.calibrate(model):
        for _ in range(3):
            model(torch.randn(4, 6, 32))
    qfp8.freeze(model)
    assert formats.sqnr(ref, model(x)) > 15
