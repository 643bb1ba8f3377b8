"""A quantized layer follows the model's dtype: float64 takes the reference route, float32/bf16/fp16 the kernel."""

import copy

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.library import cpu


def _reference(layer, x):
    w = layer.weight.dequantize(torch.float64)
    return x.double() @ w.t() + (0 if layer.bias is None else layer.bias.double())


def test_float64_model_is_quantized_onto_the_reference_route_and_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 24), nn.Linear(24, 8, bias=False)).double()
    _, report = qfp8.quantize(model)
    x = torch.randn(5, 48, dtype=torch.float64)
    y = model(x)
    assert y.dtype == torch.float64
    assert model[0].packing == "reference"
    if cpu.cpu_kernel_isa() is not None:  # the report says why the kernel was passed over
        assert "float64" in " ".join(model[0].kernel_notes)
    want = _reference(model[1], _reference(model[0], x))
    assert formats.sqnr(want, y) > 60  # W8A16: only the weights are rounded, and want uses the same weights


def test_model_dtype_changes_after_quantize_reroute_each_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 24), nn.Linear(24, 8, bias=False))
    qfp8.quantize(model)
    kernel = model[0].packing
    x = torch.randn(5, 48)
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        model.to(dtype)
        assert [layer.orig_dtype for layer in model] == [dtype, dtype]  # the bias-free layer too
        y = model(x.to(dtype))
        assert y.dtype == dtype and torch.isfinite(y).all()
        expected = "reference" if dtype == torch.float64 or cpu.cpu_kernel_isa() is None else kernel
        assert {layer.packing for layer in model} == {expected}
        want = _reference(model[1], _reference(model[0], x.to(dtype)))
        assert formats.sqnr(want, y) > {torch.float64: 60, torch.float32: 60}.get(dtype, 35)


@pytest.mark.parametrize("path", ["fast", "regular"])
def test_bad_inputs_raise_errors_naming_the_layer(path):
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model)
    if path == "regular":  # a hook sends calls through nn.Module.__call__ and forward
        model[0].register_forward_hook(lambda *args: None)
    cases = [
        (torch.randn(3, 15), ValueError, r"QLinear\(in_features=16, out_features=8.*shape \(3, 15\).* must be 16"),
        (torch.randn(()), ValueError, r"shape \(\).* must be 16"),
        (torch.randint(0, 5, (3, 16)), TypeError, "floating-point tensor, got torch.int64"),
    ]
    if model[0].packing != "reference":
        cases.append((torch.randn(3, 16, dtype=torch.float64), TypeError, "float64.*model.to"))
    for x, kind, message in cases:
        with pytest.raises(kind, match=message):
            model(x)


def test_autocast_runs_the_layer_in_its_dtype_as_for_nn_linear():
    """Under torch.autocast a float32 input goes in (and out) in the autocast dtype, as nn.Linear's does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    float_model = copy.deepcopy(model)
    qfp8.quantize(model, exclude=())
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = model(x.bfloat16())  # the same layers given bf16 inputs
        for grad in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
                out, reference = model(x), float_model(x)
                compiled = torch.compile(model, fullgraph=True)(x)
            assert out.dtype == reference.dtype == compiled.dtype == torch.bfloat16
            assert torch.equal(out, expected) and torch.equal(compiled, expected)
        assert model(x).dtype == torch.float32  # outside autocast: the input's dtype
        model.to(torch.bfloat16)  # a bf16 model under fp16 autocast: fp16 in and out, as nn.Linear
        with torch.autocast("cpu", dtype=torch.float16):
            assert model(x.bfloat16()).dtype == float_model.bfloat16()(x.bfloat16()).dtype == torch.float16
