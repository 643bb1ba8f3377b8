"""The CPU kernel's convolution op (qfp8::scaled_conv_cpu, qfp8/ext/cpu/conv.cpp) on every ISA this CPU runs:
against float64 convolutions, bit for bit against the linear kernel on a patch matrix built by PyTorch, and the
QConv layers' choice between it and the patch route."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import qfp8
from qfp8 import formats
from qfp8.library.conv_cpu import CONV_OP
from qfp8.library.testing import opcheck
from qfp8.nn.conv import quantize_convolution
from qfp8.nn.scheme import QuantizationScheme
from tests.isas import ISA_PARAMS, forced

pytestmark = pytest.mark.skipif(CONV_OP is None, reason="the qfp8 CPU extension is not built")


@pytest.fixture(params=ISA_PARAMS)
def isa(request):
    yield from forced(request)


# (in, out, kernel, stride, padding, dilation, spatial): even channel counts let the avx512bf16 kernel read the
# patches in place (each kernel row one run of kw * C values); odd ones, a width dilation (runs of C values) and
# few output pixels (M <= 4) take the gathered patch matrix.
CONV2D = {
    "3x3-even": (16, 40, 3, 1, 1, 1, (9, 11)),
    "3x3-odd-channels": (5, 33, 3, 1, 1, 1, (7, 8)),
    "stride2-asymmetric": (6, 17, (3, 2), (2, 1), (2, 0), 1, (10, 7)),
    "dilated-width": (8, 9, (2, 3), 1, (1, 2), (2, 3), (9, 9)),
    "1x1": (24, 70, 1, 1, 0, 1, (6, 5)),
    "few-pixels": (10, 12, 3, 1, 0, 1, (4, 3)),
    "long-k": (130, 40, 3, 1, 1, 1, (6, 6)),  # K = 1170: more than one 512-pair chunk, runs straddle chunks
}
SCHEMES = {
    "w8a16": QuantizationScheme(),
    "tensor-e5m2": QuantizationScheme.from_args(weights="float8_e5m2", weight_scale="tensor"),
    "a-token": QuantizationScheme.from_args(activations="dynamic"),
    "a-tensor": QuantizationScheme.from_args(activations="dynamic", activation_scale="tensor"),
    "a-group": QuantizationScheme.from_args(activations="dynamic", activation_scale="group"),
    "a-token-mse": QuantizationScheme.from_args(activations="dynamic", activation_scale="token-mse"),
    "a-static": QuantizationScheme.from_args(activations="static"),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to max |reference|


def _patch_route(q, x: torch.Tensor) -> torch.Tensor:
    """The layer's output the way it is computed when a gradient is needed: PyTorch builds the patch matrix,
    the linear kernel multiplies it."""
    padded = q._channels_last_input(x)
    out = q._output_sizes(padded)
    y = q._linear(q._patches(padded, out, 0, q.in_channels)).view(x.shape[0], *out, -1)
    return y.movedim(-1, 1)


def _float64(conv, q, x: torch.Tensor) -> torch.Tensor:
    """``conv`` with the layer's dequantized weight and its activations' rounding, in float64."""
    weight = formats.dequantize_weight(q.canonical_weight(), q.weight_scale, q.scheme.block_size or None)
    weight = q.stored_order(weight).reshape(conv.weight.shape).double()
    bias = None if conv.bias is None else conv.bias.double()
    functional = F.conv2d if isinstance(conv, nn.Conv2d) else F.conv1d
    return functional(x.double(), weight, bias, conv.stride, conv.padding, conv.dilation)


@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", list(CONV2D.values()), ids=list(CONV2D))
@torch.no_grad()
def test_conv_op_matches_the_patch_route_and_float64(isa, shape, dtype, scheme):
    cin, cout, kernel, stride, padding, dilation, spatial = shape
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, kernel, stride, padding, dilation).to(dtype)
    q = quantize_convolution(conv, SCHEMES[scheme], "conv")
    x = torch.randn(2, cin, *spatial).to(dtype)
    if SCHEMES[scheme].activations == "static":  # calibrated by hand: a static scale a little below x's range
        q.input_scale = x.float().abs().amax().reshape(1) / 400
    for memory in (torch.contiguous_format, torch.channels_last):
        xm = x.contiguous(memory_format=memory)
        assert q._reads_in_place(xm)
        y = q(xm)
        assert y.dtype == dtype and y.is_contiguous(memory_format=memory)
        assert torch.equal(y, _patch_route(q, xm))  # the same products in the same order: the same bits
        if SCHEMES[scheme].activations is None:
            reference = _float64(conv, q, x)
            assert (y.double() - reference).abs().max() <= TOLERANCE[dtype] * reference.abs().max()


@torch.no_grad()
def test_strided_input_conv1d_and_unbatched(isa):
    torch.manual_seed(1)
    conv = nn.Conv2d(12, 20, 3, padding=1).to(torch.bfloat16)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    wide = torch.randn(2, 24, 9, 10, dtype=torch.bfloat16)
    x = wide[:, ::2]  # neither contiguous nor channels-last: the output is channels-last, as the patch route's
    assert torch.equal(q(x), _patch_route(q, x))
    conv1 = nn.Conv1d(10, 14, 5, stride=2, padding=3, dilation=2)
    q1 = quantize_convolution(conv1, QuantizationScheme(), "conv1d")
    x1 = torch.randn(3, 10, 31)
    y1 = q1(x1)
    assert torch.equal(y1, _patch_route(q1, x1))
    reference = _float64(conv1, q1, x1)
    assert (y1.double() - reference).abs().max() <= TOLERANCE[torch.float32] * reference.abs().max()
    assert torch.equal(q1(x1[1]), y1[1])


@torch.no_grad()
def test_tiny_activations_and_padding_modes(isa):
    torch.manual_seed(2)
    conv = nn.Conv2d(8, 16, 3, padding=2, padding_mode="reflect").to(torch.bfloat16)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    x = torch.randn(1, 8, 7, 6, dtype=torch.bfloat16)
    x[0, 3, 2, 2] = 1e-30  # below the bf16 products' range: the bf16 kernels decline, the float32 code runs
    y = q(x)
    assert torch.equal(y, _patch_route(q, x))
    weight = q.stored_order(formats.dequantize_weight(q.canonical_weight(), q.weight_scale, None))
    reference = F.conv2d(F.pad(x.double(), (2, 2, 2, 2), mode="reflect"), weight.reshape(16, 8, 3, 3).double(),
                         conv.bias.double())  # fmt: skip
    assert (y.double() - reference).abs().max() <= TOLERANCE[torch.bfloat16] * reference.abs().max()


def test_gradients_block_scales_and_groups_take_the_patch_route():
    torch.manual_seed(3)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    x = torch.randn(1, 4, 7, 7, requires_grad=True)
    assert not q._reads_in_place(x)
    with torch.no_grad():
        assert q._reads_in_place(x)
    block = quantize_convolution(conv, QuantizationScheme.from_args(weight_scale="block", block_size=(16, 16)), "b")
    grouped = quantize_convolution(nn.Conv2d(4, 6, 3, groups=2), QuantizationScheme(), "g")
    assert not block._reads_in_place(x.detach()) and not grouped._reads_in_place(x.detach())
    static = quantize_convolution(conv, QuantizationScheme.from_args(activations="static"), "s")
    assert not static._reads_in_place(x.detach())  # uncalibrated: the patch route says what to do


def test_op_checks_and_bad_arguments():
    torch.manual_seed(4)
    q = quantize_convolution(nn.Conv2d(6, 10, 3), QuantizationScheme(), "conv")
    args = (q.qweight, q.weight_scale, q.bias, None, *q._extra_args)
    x = torch.randn(2, 6, 8, 7)
    opcheck(CONV_OP, (x, *args, [3, 3], [1, 2], [1, 0, 0, 2], [1, 1]))
    opcheck(CONV_OP, (x.contiguous(memory_format=torch.channels_last), *args, [3, 3], [1, 1], [0] * 4, [2, 1]))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        CONV_OP(torch.randn(1, 6, 2, 8), *args, [3, 3], [1, 1], [0] * 4, [1, 1])
    with pytest.raises(ValueError, match="in_features 54 is not channels 5"):
        CONV_OP(torch.randn(1, 5, 8, 8), *args, [3, 3], [1, 1], [0] * 4, [1, 1])
    with pytest.raises(ValueError, match="twice as many paddings"):
        CONV_OP(x, *args, [3, 3], [1, 1], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="must be positive"):
        CONV_OP(x, *args, [3, 3], [0, 1], [0] * 4, [1, 1])
    with pytest.raises(ValueError, match=r"x must be \[batch, channels, height, width\]"):
        CONV_OP(x[0], *args, [3, 3], [1, 1], [0] * 4, [1, 1])


@torch.no_grad()
def test_compiled_channels_last_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 8, 3, stride=2)).to(torch.bfloat16)
    qfp8.quantize(model)
    x = torch.randn(2, 8, 12, 10, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    assert eager.is_contiguous(memory_format=torch.channels_last)  # channels-last in, channels-last out
    assert compiled.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(compiled, eager)
