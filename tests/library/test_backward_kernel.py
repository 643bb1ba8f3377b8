"""The input gradient of FP8 layers runs the linear kernel on the packed transposed weight (qfp8/library/transposed.py).

Judged against ``grad_y @ W`` in float64 with ``W`` the dequantized FP8
weight (straight-through for FP8 activations), by SQNR: float32 gradients
differ from it only by the order of the float32 sums, 16-bit ones also by
the rounding of the gradient (and, for channel scales, of ``grad * scale``)
to 8 or 11 mantissa bits.
"""

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.library import cpu, transposed

# SQNR floors in dB: float32 sums (138-146 dB measured), bfloat16 (52-56), float16 (70-75).
MIN_SQNR = {torch.float32: 110.0, torch.bfloat16: 42.0, torch.float16: 60.0}

SCHEMES = [
    pytest.param({"weight_scale": "tensor"}, id="w-tensor"),
    pytest.param({"weight_scale": "channel"}, id="w-channel"),
    pytest.param({"weight_scale": "block", "block_size": (16, 8)}, id="w-block-16x8"),
    pytest.param({"weight_scale": "block", "block_size": (7, 5)}, id="w-block-7x5"),
    pytest.param({"weight_scale": "channel", "activations": "dynamic"}, id="w-channel-a-token"),
    pytest.param({"weight_scale": "block", "block_size": (16, 8), "activations": "dynamic"}, id="w-block-a-token"),
    pytest.param(
        {"weight_scale": "tensor", "activations": "dynamic", "activation_scale": "tensor"}, id="w-tensor-a-tensor"
    ),
    pytest.param({"weight_scale": "channel", "weights": "float8_e5m2"}, id="w-e5m2-channel"),
]

requires_kernel = pytest.mark.skipif(cpu.cpu_kernel_isa() is None, reason="the qfp8 CPU extension is not built")


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(20 * torch.log10(want.norm() / (got.double() - want).norm()))


def _quantized_layer(n: int, k: int, dtype: torch.dtype, scheme: dict, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.rand(n, 1).add(0.1))
    return qfp8.quantize(nn.Sequential(linear.to(dtype)), **scheme).model[0]


def _want(layer, grad_y: torch.Tensor) -> torch.Tensor:
    w = layer.weight.dequantize(torch.float64)
    return grad_y.double().reshape(-1, layer.out_features) @ w


@requires_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", [(45, 37, 3), (33, 70, 17), (1, 9, 2)], ids=["45x37-m3", "33x70-m17", "1x9-m2"])
def test_input_gradient_matches_float64(scheme, dtype, shape):
    n, k, m = shape
    layer = _quantized_layer(n, k, dtype, scheme)
    assert layer.packing.startswith("cpu-")
    layer.bias.requires_grad_(True)  # frozen by default; a bias made trainable gets its gradient too
    x = torch.randn(2, m, k).to(dtype).requires_grad_()
    grad_y = torch.randn(2, m, n).to(dtype)
    layer(x).backward(grad_y)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    got = sqnr(x.grad.reshape(-1, k), _want(layer, grad_y))
    assert got > MIN_SQNR[dtype], f"input gradient SQNR {got:.1f} dB"
    assert layer.bias.grad.dtype == dtype
    assert sqnr(layer.bias.grad, grad_y.double().sum((0, 1))) > MIN_SQNR[dtype]


@requires_kernel
def test_backward_makes_no_float_copy_of_the_weight(monkeypatch):
    layer = _quantized_layer(64, 48, torch.bfloat16, {"weight_scale": "channel"})
    x = torch.randn(5, 48, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # the first backward packs the transposed weight

    def refused(*args, **kwargs):
        raise AssertionError("the backward dequantized the weight")

    monkeypatch.setattr(formats, "dequantize_weight", refused)
    monkeypatch.setattr(formats, "fp8_to_float", refused)
    x.grad = None
    layer(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@requires_kernel
def test_transposed_weight_is_packed_once_and_repacked_after_an_in_place_change():
    transposed.release()
    layer = _quantized_layer(40, 24, torch.float32, {"weight_scale": "tensor"})
    x = torch.randn(3, 24, requires_grad=True)
    layer(x)
    assert layer.qweight not in transposed._CACHE  # packed at the first backward, not before
    layer(x).sum().backward()
    first = transposed._CACHE[layer.qweight].weight
    # One more FP8 copy of the weight (the layout pads K to tiles of 32 rows and N to pairs).
    assert transposed.cached_bytes() == first.numel() == 32 * 2 * 20
    layer(x).sum().backward()
    assert transposed._CACHE[layer.qweight].weight is first
    with torch.no_grad():
        layer.qweight.copy_(
            torch.ops.qfp8.pack_weight_cpu(layer.canonical_weight().float().neg().to(torch.float8_e4m3fn))
        )
    x.grad = None
    layer(x).sum().backward()
    assert transposed._CACHE[layer.qweight].weight is not first
    want = torch.ones(1, 40, dtype=torch.float64) @ layer.weight.dequantize(torch.float64)
    assert sqnr(x.grad.sum(0, keepdim=True), 3 * want) > MIN_SQNR[torch.float32]
    transposed.release()
    assert transposed.cached_bytes() == 0


def test_reference_route_gradient_matches_float64():
    layer = _quantized_layer(21, 13, torch.float64, {"weight_scale": "block", "block_size": (4, 3)})
    assert layer.packing == "reference"  # float64 layers take the reference op
    x = torch.randn(4, 13, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(4, 21, dtype=torch.float64)
    layer(x).backward(grad_y)
    assert sqnr(x.grad, _want(layer, grad_y)) > MIN_SQNR[torch.float32]  # the reference op computes in float32


@requires_kernel
@pytest.mark.parametrize("scheme", SCHEMES[:3])
def test_new_weight_scales_reach_the_gradient(scheme):
    layer = _quantized_layer(40, 24, torch.float32, scheme)
    x = torch.randn(3, 24, requires_grad=True)
    grad_y = torch.randn(3, 40)
    layer(x).backward(grad_y)
    with torch.no_grad():
        layer.weight_scale.mul_(2.0)  # in place: the tensor's version changes
    for step in ("in place", "assigned"):
        x.grad = None
        layer(x).backward(grad_y)
        assert sqnr(x.grad, _want(layer, grad_y)) > MIN_SQNR[torch.float32], step
        layer.weight_scale = layer.weight_scale * 0.25  # a new tensor
