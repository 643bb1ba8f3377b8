"""The CPU kernels with enough rows that an ISA's preparation of the activations is shared out among threads (the
avx512bf16 and amx kernels lay the rows of x out by register block, ranges of blocks on the call's threads): linear
and convolution outputs bit for bit the same at 1, 2 and 3 threads and close to float64, and tiny activations seen
in any thread's rows."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qfp8 import formats
from qfp8.library import cpu
from qfp8.library.conv_cpu import CONV_OP
from qfp8.nn.conv import quantize_convolution
from qfp8.nn.scheme import QuantizationScheme
from tests.isas import ISA_PARAMS, forced

pytestmark = pytest.mark.skipif(CONV_OP is None, reason="the qfp8 CPU extension is not built")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # max |y - reference| / max |reference|


@pytest.fixture(params=ISA_PARAMS)
def isa(request):
    yield from forced(request)


def _at_thread_counts(fn, counts=(1, 2, 3)):
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append(fn())
    finally:
        torch.set_num_threads(threads)
    return results


def _weight(n, k, dtype=torch.float8_e4m3fn, block_size=()):
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * torch.rand(n, 1).add(0.1)
    return formats.quantize_weight(w, dtype, "block" if block_size else "channel", block_size or None)


def _linear(x, q, scale, activation="none", block_size=()):
    n, k = q.shape
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    return cpu.scaled_linear_cpu(
        x, packed, scale, None, None, n, k, list(block_size), activation, formats.activation_dtype_for(q.dtype)
    )


def _float64(x_values, q, scale):
    return x_values.double() @ (formats.fp8_to_float(q).double() * scale.double().reshape(-1, 1)).t()


# (M, K, block_size): 84 and 25 register blocks of 12 rows, enough for each thread to lay out and multiply its own
# rows; at K = 8192 a thread's rows go through the tiles in row groups.
CASES = {"M1000-K320": (1000, 320, ()), "M300-K1100-block": (300, 1100, (32, 64)), "M600-K8192": (600, 8192, ())}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("activation", ["none", "token", "group"])
def test_linear_identical_across_thread_counts(isa, case, activation):
    m, k, block_size = CASES[case]
    q, scale = _weight(72, k, block_size=block_size)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    results = _at_thread_counts(lambda: _linear(x, q, scale, activation, block_size))
    for other in results[1:]:
        assert torch.equal(results[0].view(torch.int16), other.view(torch.int16)), isa
    if activation == "none":
        w = formats.dequantize_weight(q, scale, block_size or None)
        reference = x.double() @ w.double().t()
        error = (results[0].double() - reference).abs().max() / reference.abs().max()
        assert error <= TOLERANCE[torch.bfloat16], f"{isa}: {error:.2e}"


def test_tiny_rows_in_the_last_register_blocks(isa):
    """Rows of magnitude 1e-30 only at the end of 1000 (laid out by the second thread): vdpbf16ps would flush their
    products with the smallest e5m2 weights to zero, so the bf16 kernels must decline whichever thread sees them."""
    q, scale = _weight(40, 320, torch.float8_e5m2)
    q[:, ::3] = torch.tensor(1, dtype=torch.uint8).view(torch.float8_e5m2)  # 2^-16, the smallest subnormal
    row_scales = torch.ones(1000)
    row_scales[-7::3] = 1e-30
    x = (torch.randn(1000, 320) * row_scales[:, None]).to(torch.bfloat16)
    (y,) = _at_thread_counts(lambda: _linear(x, q, scale).double(), counts=(2,))
    reference = _float64(x, q, scale)
    for row in (0, 993, 994, 996, 999):
        error = ((y[row] - reference[row]).abs().max() / reference[row].abs().max()).item()
        assert error <= TOLERANCE[torch.bfloat16], f"{isa} row {row} of scale {row_scales[row]:g}: {error:.2e}"


@pytest.mark.parametrize("tiny", [False, True], ids=["ordinary", "tiny-last-patches"])
@torch.no_grad()
def test_convolution_identical_across_thread_counts(isa, tiny):
    """A 3x3 convolution over 24 x 24 pixels (M = 576 patches of K = 576), which the avx512bf16 kernel reads in
    place and lays out on the call's threads; with tiny values in the last patches it declines (to float32)."""
    torch.manual_seed(3)
    conv = nn.Conv2d(64, 40, 3, padding=1).to(torch.bfloat16)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    x = torch.randn(1, 64, 24, 24, dtype=torch.bfloat16)
    if tiny:
        x[0, :, -1, -1] = 1e-30  # below the bf16 products' range
    results = _at_thread_counts(lambda: q(x))
    for other in results[1:]:
        assert torch.equal(results[0].view(torch.int16), other.view(torch.int16)), isa
    weight = q.stored_order(formats.dequantize_weight(q.canonical_weight(), q.weight_scale, None))
    reference = F.conv2d(x.double(), weight.reshape(40, 64, 3, 3).double(), conv.bias.double(), padding=1)
    error = (results[0].double() - reference).abs().max() / reference.abs().max()
    assert error <= TOLERANCE[torch.bfloat16], f"{isa}: {error:.2e}"
