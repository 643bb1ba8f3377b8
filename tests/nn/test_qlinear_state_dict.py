"""QLinear under torch's own ``load_state_dict``: unexpected and missing keys,
values the kernels cannot use, and the bias Parameter kept in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.nn import QuantizationScheme

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def _model(activations=None, calibrate=True, weights="float8_e4m3fn"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))
    qfp8.quantize(model, weights=weights, activations=activations, exclude=())
    if activations == "static" and calibrate:
        with qfp8.calibrate(model):
            model(torch.randn(4, 16))
    return model


def test_unknown_key_under_a_quantized_layer_is_unexpected():
    model = _model()
    state = dict(model.state_dict())
    state["0.bogus"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*0\.bogus"):
        model.load_state_dict(state)
    assert "0.bogus" in model.load_state_dict(state, strict=False).unexpected_keys


def test_static_state_into_a_w8a16_model_reports_input_scale():
    static = _model("static")
    plain = _model()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*0\.input_scale"):
        plain.load_state_dict(static.state_dict())
    # Non-strict: the scale is skipped, the layer stays W8A16.
    plain.load_state_dict(static.state_dict(), strict=False)
    assert plain[0].input_scale is None
    with pytest.raises(ValueError, match=r"0\.input_scale"):
        qfp8.load_state_dict(plain, static.state_dict())


def test_w8a16_state_into_a_calibrated_static_model_misses_input_scale():
    static = _model("static")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.input_scale"):
        static.load_state_dict(_model().state_dict())


def test_static_state_fills_an_uncalibrated_static_layer():
    source = _model("static")
    target = _model("static", calibrate=False)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target[0].input_scale, source[0].input_scale)
    x = torch.randn(3, 16)
    assert torch.equal(target(x), source(x))


@pytest.mark.parametrize("key", ["0.weight_scale", "2.weight_scale", "0.input_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_unusable_scales_are_refused(key, value):
    model = _model("static")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in before.items()}
    state[key] = torch.full_like(state[key], value)
    with pytest.raises(RuntimeError, match=rf"{key}: .*NaN/Inf, zero or negative"):
        model.load_state_dict(state)
    for k, v in model.state_dict().items():  # nothing of the refused state was taken
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("value", [5e-39, 1e-30, 2e-15])
def test_an_input_scale_below_the_smallest_qfp8_makes_is_refused(value):
    """x / 5e-39 overflows float32 for |x| above 1.7, and an overflowed quotient quantizes to NaN: every output
    was NaN. The floor is 1e-12 / 448, the smallest scale calibration gives."""
    model = _model("static")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.input_scale"] = torch.tensor([value])
    with pytest.raises(RuntimeError, match=r"0.input_scale: .*below 2.232e-15, the smallest scale qfp8 makes"):
        model.load_state_dict(state)
    state["0.input_scale"] = torch.tensor([2.3e-15])  # just above: taken, and the outputs are finite
    model.load_state_dict(state)
    assert model(torch.randn(3, 16)).isfinite().all()


def test_a_tiny_weight_scale_is_still_taken():
    """A weight scale only multiplies: a tiny one gives tiny outputs, not NaN, so no floor applies to it."""
    model = _model("static")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight_scale"] = torch.full_like(state["0.weight_scale"], 1e-30)
    model.load_state_dict(state)
    y = model[0](torch.randn(3, 16))
    assert y.isfinite().all()


@pytest.mark.parametrize("dtype", FP8)
def test_nonfinite_weight_codes_are_refused_on_load_and_at_freeze(dtype):
    model = _model(weights=str(dtype).removeprefix("torch."))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    code = {torch.float8_e4m3fn: 0xFF, torch.float8_e5m2: 0x7C, torch.float8_e4m3fnuz: 0x80}[dtype]
    state["0.weight"].view(torch.uint8)[5, 11] = code
    with pytest.raises(RuntimeError, match=rf"0\.weight: .*NaN/Inf code \(0x{code:02X}\) at \[5, 11\]"):
        model.load_state_dict(state)
    with pytest.raises(ValueError, match=r"module '0': weight: .*NaN/Inf code \(0x[0-9A-F]{2}\) at \[5, 11\]"):
        qfp8.load_state_dict(model, state)
    # A weight changed in place after loading (here in its packed layout) is caught by freeze.
    model[2].qweight.view(torch.uint8).view(-1)[7] = code
    row, col = formats.first_nonfinite(model[2].canonical_weight())
    with pytest.raises(ValueError, match=rf"freeze: module '2'.*NaN/Inf code at \[{row}, {col}\]"):
        qfp8.freeze(model)


@pytest.mark.parametrize("dtype", FP8)
def test_first_nonfinite_matches_the_decoded_values(dtype, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (300, 37), dtype=torch.uint8, generator=generator).view(dtype)
    decoded = formats.fp8_to_float(codes)
    bad = (~torch.isfinite(decoded)).nonzero()
    assert bad.numel(), "the random codes should hold NaN/Inf ones"
    assert formats.first_nonfinite(codes) == tuple(bad[0].tolist())
    finite = torch.where(torch.isfinite(decoded), codes.view(torch.uint8), 0).view(dtype)
    assert formats.first_nonfinite(finite) is None
    assert formats.first_nonfinite(codes.to("meta")) is None  # no codes to check
    # The torch path (other devices, a build without the extension) agrees.
    monkeypatch.setattr(formats, "_extension_scan", lambda q: None)
    assert formats.first_nonfinite(codes) == tuple(bad[0].tolist())
    assert formats.first_nonfinite(finite) is None


def test_load_keeps_the_bias_parameter():
    model = _model()
    bias = model[0].bias
    bias.requires_grad_(True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.bias"] = torch.randn_like(state["0.bias"])
    model.load_state_dict(state)
    assert model[0].bias is bias and bias.requires_grad
    assert torch.equal(bias.detach(), state["0.bias"])
    model(torch.randn(2, 16)).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


@pytest.mark.parametrize("route", ["attribute", "buffers", "register_buffer"])
def test_an_input_scale_put_in_place_by_hand_is_used(route):
    scheme = QuantizationScheme.from_args(activations="static")
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    reference = qfp8.QLinear.from_weight(weight, None, scheme, "reference")
    reference.input_scale = torch.tensor([0.01])
    layer = qfp8.QLinear.from_weight(weight, None, scheme, "layer")
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="never calibrated"):
        layer(x)
    scale = torch.tensor([0.01])
    if route == "attribute":
        layer.input_scale = scale
    elif route == "buffers":
        layer._buffers["input_scale"] = scale
    else:
        layer.register_buffer("input_scale", scale)
    assert torch.equal(layer(x), reference(x))
    layer.input_scale = None  # back to uncalibrated: the layer's own message, not the op's
    with pytest.raises(RuntimeError, match=r"QLinear\(16 -> 8\) has static activation scales but was never calibrated"):
        layer(x)
