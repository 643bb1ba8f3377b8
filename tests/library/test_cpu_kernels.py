"""The CPU kernels (qfp8/ext/cpu) against float64 math and the reference op, on every ISA this CPU runs."""

import os
import subprocess
import sys

import pytest
import torch

from qfp8 import formats
from qfp8.library import cpu
from qfp8.library.testing import opcheck
from tests.isas import ISA_PARAMS, forced, isa_param

pytestmark = pytest.mark.skipif(cpu.cpu_kernel_isa() is None, reason="the qfp8 CPU extension is not built")

FP8_IDS = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2", torch.float8_e4m3fnuz: "e4m3fnuz"}
X_IDS = {torch.float32: "x-f32", torch.bfloat16: "x-bf16", torch.float16: "x-f16"}
# block-odd splits k pairs (the fp16 route); block-even keeps them whole (the float32 route at M <= 4).
GRANULARITIES = {"tensor": (), "channel": (), "block-odd": (16, 7), "block-even": (48, 10)}
# Relative error of the output (max |y - ref| / max |ref|): bf16 and fp16
# outputs are rounded once at the end; float32 outputs only by the sum order.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(1, 1, 1), (1, 7, 17), (3, 17, 7), (2, 33, 577), (4, 40, 130), (7, 577, 33), (13, 64, 300)]  # (M, N, K)


@pytest.fixture(params=ISA_PARAMS)
def isa(request):
    yield from forced(request)


def random_weight(n, k, dtype, granularity, block_size=(16, 7)):
    """Random quantized weight; no zero codes (every lane carries signal)."""
    w = torch.randn(n, k) * torch.rand(n, 1).add(0.1)
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 0.5), w)
    return formats.quantize_weight(w, dtype, granularity, block_size)


def float64_reference(x_values, q, w_scale, bias, block_size):
    """y = x_values @ (q * scale)^T + bias, all in float64 (x_values already dequantized)."""
    n, k = q.shape
    w = formats.fp8_to_float(q).double()
    if block_size:
        bn, bk = block_size
        w = w * w_scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        w = w * w_scale.double().reshape(-1, 1)
    y = x_values.double().reshape(-1, k) @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y


def run_kernel(x, q, w_scale, bias, block_size=(), activation="none", input_scale=None):
    n, k = q.shape
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    return cpu.scaled_linear_cpu(
        x, packed, w_scale, bias, input_scale, n, k, list(block_size), activation, formats.activation_dtype_for(q.dtype)
    )


def activation_values(x, activation, act_dtype=torch.float8_e4m3fn):
    """x as a W8A8 kernel multiplies it, in float64: its FP8 values times their scales ("none": x itself)."""
    if activation == "none":
        return x
    xq, xs = formats.quantize_activation(x, act_dtype, activation)
    k = x.shape[-1]
    xs = xs.double()
    return formats.fp8_to_float(xq).double() * (formats.expand_group_scale(xs, k) if activation == "group" else xs)


def assert_random_case_matches_float64(isa, m, n, k, x_dtype, block_size, activation):
    """A random weight (channel scales, or block scales of block_size) and rows of x of varied magnitude, through
    the kernel, against float64 at the output dtype's tolerance."""
    granularity = "block" if block_size else "channel"
    q, scale = random_weight(n, k, torch.float8_e4m3fn, granularity, block_size or None)
    x = (torch.randn(m, k) * torch.rand(m, 1).add(0.1)).to(x_dtype)
    bias = torch.randn(n)
    y = run_kernel(x, q, scale, bias, block_size, activation)
    ref = float64_reference(activation_values(x, activation), q, scale, bias, block_size)
    err = rel_error(y, ref)
    assert err <= TOLERANCE[x_dtype], f"{isa} M={m} N={n} K={k} block={block_size} {activation}: {err:.2e}"


def rel_error(y, ref):
    y = y.double().reshape(ref.shape)
    return ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("granularity", list(GRANULARITIES), ids=[f"w-{g}" for g in GRANULARITIES])
@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_w8a16_matches_float64(isa, w_dtype, granularity, x_dtype):
    block_size = GRANULARITIES[granularity]
    for m, n, k in SHAPES:
        q, scale = random_weight(n, k, w_dtype, granularity.split("-")[0], block_size or None)
        x = torch.randn(m, k).add(0.05).to(x_dtype)
        bias = torch.randn(n).to(x_dtype)
        y = run_kernel(x, q, scale, bias, block_size)
        assert y.dtype == x_dtype and y.shape == (m, n)
        ref = float64_reference(x, q, scale, bias, block_size)
        err = rel_error(y, ref)
        assert err <= TOLERANCE[x_dtype], f"{isa} M={m} N={n} K={k}: relative error {err:.2e}"


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("activation", ["token", "tensor", "group", "static", "token-mse"], ids=lambda a: f"a-{a}")
@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_w8a8_matches_reference_op(isa, w_dtype, activation, x_dtype):
    act_dtype = formats.activation_dtype_for(w_dtype)
    for m, n, k in [(1, 7, 17), (5, 40, 300), (9, 33, 577)]:
        q, scale = random_weight(n, k, w_dtype, "channel")
        x = torch.randn(m, k).to(x_dtype)
        bias = torch.randn(n, dtype=torch.float32)
        input_scale = torch.tensor([0.01], dtype=torch.float32) if activation == "static" else None
        y = run_kernel(x, q, scale, bias, (), activation, input_scale)
        reference = torch.ops.qfp8.scaled_linear(x, q, scale, bias, input_scale, [], activation, act_dtype)
        # Same quantized activations as formats.quantize_activation, in float64.
        granularity = "tensor" if activation == "static" else activation
        xq, xs = formats.quantize_activation(x.reshape(m, k), act_dtype, granularity, scale=input_scale)
        x_values = formats.fp8_to_float(xq).double()
        xs = xs.double()
        x_values = x_values * (formats.expand_group_scale(xs, k) if activation == "group" else xs)
        ref64 = float64_reference(x_values, q, scale, bias, ())
        assert rel_error(y, ref64) <= TOLERANCE[x_dtype], f"{isa} M={m} N={n} K={k}"
        assert rel_error(y, reference.double()) <= 2 * TOLERANCE[x_dtype], f"{isa} M={m} N={n} K={k}"


@pytest.mark.parametrize(
    "block_size",
    [(), (128, 128), (32, 64), (16, 96), (64, 256), (16, 7)],
    ids=lambda b: "x".join(map(str, b)) or "channel",
)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x-bf16", "x-f32"])
def test_group_activations_with_any_weight_scales_and_many_rows(isa, block_size, x_dtype):
    """1 x 128 group scales (the avx512bf16 kernel applies them to each group's partial sums) with channel or
    block weight scales whose k-blocks are smaller, larger or not a multiple of 128 (odd: that kernel declines),
    K not a multiple of 128, in the few-row (M <= 4) and the panel (more rows, > 12) loops."""
    granularity = "block" if block_size else "channel"
    for m, n, k in [(1, 40, 300), (4, 33, 257), (30, 70, 640), (13, 64, 1000)]:
        q, scale = random_weight(n, k, torch.float8_e4m3fn, granularity, block_size or (16, 7))
        x = (torch.randn(m, k) * torch.rand(m, 1) * torch.logspace(-2, 2, k)[torch.randperm(k)]).to(x_dtype)
        bias = torch.randn(n)
        y = run_kernel(x, q, scale, bias, block_size, "group")
        xq, xs = formats.quantize_activation(x.reshape(m, k), torch.float8_e4m3fn, "group")
        x_values = formats.fp8_to_float(xq).double() * formats.expand_group_scale(xs.double(), k)
        ref64 = float64_reference(x_values, q, scale, bias, block_size)
        assert rel_error(y, ref64) <= TOLERANCE[x_dtype], f"{isa} M={m} N={n} K={k}"


@pytest.mark.parametrize("activation", ["token", "static", "token-mse"])
@pytest.mark.parametrize("granularity", ["block-odd", "block-even"])
def test_w8a8_block_scales_and_odd_k_match_reference_op(isa, granularity, activation):
    """Block scales whose k-block is odd (avx512bf16 declines its bf16 route), even ones, odd and even K."""
    block_size = GRANULARITIES[granularity]
    for m, n, k in [(9, 40, 300), (3, 33, 301)]:
        q, scale = random_weight(n, k, torch.float8_e4m3fn, "block", block_size)
        x = torch.randn(m, k).to(torch.bfloat16)
        input_scale = torch.tensor([0.02]) if activation == "static" else None
        y = run_kernel(x, q, scale, None, block_size, activation, input_scale)
        reference = torch.ops.qfp8.scaled_linear(
            x, q, scale, None, input_scale, list(block_size), activation, torch.float8_e4m3fn
        )
        assert rel_error(y, reference.double()) <= TOLERANCE[torch.bfloat16], f"{isa} M={m} N={n} K={k}"


def _rounding_probe(act_dtype) -> torch.Tensor:
    """Every finite FP8 value of ``act_dtype``, the midpoints between neighbours (ties), values just off them,
    and values beyond the largest, both signs, in float32."""
    codes = torch.arange(256, dtype=torch.uint8).view(act_dtype)
    grid = formats.fp8_to_float(codes).float()
    grid = torch.unique(grid[torch.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2
    fmax = grid.max().item()
    values = torch.cat(
        [
            grid,
            mids,
            torch.nextafter(mids, grid[1:]),
            torch.nextafter(mids, grid[:-1]),
            torch.tensor([1.5 * fmax, 1e30]),
        ]
    )
    return torch.cat([values, -values])


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("activation", ["static", "token", "tensor"])
@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_activation_rounding_is_bit_exact(isa, w_dtype, activation, x_dtype):
    """The in-op quantization rounds exactly as formats.quantize_activation (round to nearest, ties to even,
    subnormals, saturation) from x in each dtype: with an identity weight each output is one quantized activation
    times its scale, rounded once to x's dtype."""
    act_dtype = formats.activation_dtype_for(w_dtype)
    probe = _rounding_probe(act_dtype)
    if x_dtype == torch.float16:  # still beyond every FP8 dtype's largest value, but not Inf in fp16
        probe = probe.clamp(-60000.0, 60000.0)
    k = probe.numel()
    shuffled = probe[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
    # Row 0 as it is (static scale 1: the values themselves meet the grid); row 1 shuffled and scaled
    # (per token, the scale moves the grid); row 2 small (fp16 subnormals).
    x = torch.stack([probe, shuffled * 0.37, shuffled * 1e-3]).to(x_dtype)
    eye = torch.eye(k).to(w_dtype)
    ones = torch.ones(k, 1)
    input_scale = torch.ones(1) if activation == "static" else None
    y = run_kernel(x, eye, ones, None, (), activation, input_scale)
    granularity = "tensor" if activation == "static" else activation
    xq, xs = formats.quantize_activation(x, act_dtype, granularity, input_scale)
    expected = (formats.fp8_to_float(xq).float() * xs.float()).to(x_dtype)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{isa}: {m}")


@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_token_mse_scales_match_the_reference_over_magnitudes(isa, w_dtype):
    """The kernel's own scale search (its rounding to the FP8 grid, vectorized) picks the reference's scale on rows
    of magnitude 1e-9 to 1e3 with outlier channels and an Inf: float32 outputs agree with the float64 product of the
    reference's quantized activations to float32 precision (another candidate would be ~1e-2 off; a search that
    truncates instead of rounding fails here)."""
    act_dtype = formats.activation_dtype_for(w_dtype)
    torch.manual_seed(3)
    m, n, k = 24, 40, 1001
    x = torch.randn(m, k) * torch.logspace(-9, 3, m)[:, None]
    x[:, 5:9] *= 40.0
    x[3, 17] = float("inf")
    q, scale = random_weight(n, k, w_dtype, "channel")
    y = run_kernel(x, q, scale, None, (), "token-mse").double()
    xq, xs = formats.quantize_activation(x, act_dtype, "token-mse")
    ref = float64_reference(formats.fp8_to_float(xq).double() * xs.double(), q, scale, None, ())
    rows = [r for r in range(m) if r != 3]
    err = ((y[rows] - ref[rows]).abs().amax(-1) / ref[rows].abs().amax(-1)).max().item()
    assert err <= 2e-5, f"{isa}: relative error {err:.2e}"
    assert torch.isnan(y[3]).all()


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("activation", ["token", "tensor"])
def test_nonfinite_activation_spoils_only_its_row(isa, activation, x_dtype):
    """An Inf or NaN becomes NaN and spoils its own row; the amax (of its row, or of the tensor) leaves it out, so
    the other rows are the reference op's."""
    q, scale = random_weight(40, 300, torch.float8_e4m3fn, "channel")
    x = torch.randn(4, 300).to(x_dtype)
    x[2, 5] = float("inf")
    x[1, 299] = float("nan")
    y = run_kernel(x, q, scale, None, (), activation)
    assert torch.isnan(y[[1, 2]]).all()
    reference = torch.ops.qfp8.scaled_linear(x, q, scale, None, None, [], activation, torch.float8_e4m3fn)
    assert rel_error(y[[0, 3]], reference[[0, 3]].double()) <= TOLERANCE[x_dtype], isa


@pytest.mark.parametrize("granularity", ["channel", "block"], ids=lambda g: f"w-{g}")
@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"M{m}")
def test_identical_across_thread_counts(isa, m, granularity):
    block = (128, 128) if granularity == "block" else ()
    q, scale = random_weight(1000, 2048, torch.float8_e4m3fn, granularity, block or None)
    x = torch.randn(m, 2048, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(run_kernel(x, q, scale, None, block))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(results[0].view(torch.int16), other.view(torch.int16))


@pytest.mark.parametrize("m", [1, 2, 7], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_every_fp8_code_subnormals_and_max(isa, w_dtype, m):
    """Each finite FP8 code (subnormals, the largest values) as a weight, exactly, on the M = 1, small-M and
    panel routes."""
    codes = torch.arange(256, dtype=torch.uint8).view(w_dtype)
    finite = torch.isfinite(formats.fp8_to_float(codes))
    codes = codes[finite]
    n = codes.numel()
    q = torch.zeros(n, 9, dtype=torch.uint8).view(w_dtype)
    q[:, 4] = codes  # one nonzero code per channel, at an even and an odd k
    q[:, 7] = codes
    x = torch.zeros(m, 9)
    x[:, 4] = 1.0
    x[:, 7] = 0.5
    scale = torch.ones(1)
    y = run_kernel(x, q, scale, None)
    expected = formats.fp8_to_float(codes).double() * 1.5
    for row in range(m):
        assert torch.equal(y[row].double(), expected), f"{isa} M={m}: row {row}"
    assert y.abs().max().item() == formats.fp8_max(w_dtype) * 1.5


@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=lambda m: f"M{m}")
def test_subnormal_weights_exact_with_flush_denormal_set(isa, m):
    """torch.set_flush_denormal(True) sets MXCSR.DAZ; the kernel must still read FP8 subnormals."""
    codes = torch.arange(1, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)  # the 7 positive subnormals
    q = torch.zeros(7, 4, dtype=torch.float8_e4m3fn)
    q[:, 1] = codes
    x = torch.zeros(m, 4)
    x[:, 1] = 3.0
    expected = formats.fp8_to_float(codes).double() * 3.0
    try:
        assert torch.set_flush_denormal(True)
        y = run_kernel(x, q, torch.ones(7, 1), None)
    finally:
        torch.set_flush_denormal(False)
    for row in range(m):
        assert torch.equal(y[row].double(), expected)


@pytest.mark.parametrize("w_scale", [1e-10, 1e-3, 1e6], ids=lambda s: f"scale{s:g}")
@pytest.mark.parametrize("x_scale", [1e-6, 1.0], ids=lambda s: f"x{s:g}")
def test_tiny_and_huge_scales_tiny_activations(isa, w_scale, x_scale):
    for m in (1, 2, 3, 4, 5):
        q, _ = random_weight(70, 301, torch.float8_e4m3fn, "channel")
        scale = torch.full((70, 1), w_scale) * torch.rand(70, 1).add(0.5)
        block_scale = torch.full((5, 43), w_scale) * torch.rand(5, 43).add(0.5)
        x = torch.randn(m, 301) * x_scale
        even_block_scale = torch.full((2, 31), w_scale) * torch.rand(2, 31).add(0.5)
        for s, block in ((scale, ()), (block_scale, (16, 7)), (even_block_scale, (64, 10))):
            y = run_kernel(x, q, s, None, block)
            ref = float64_reference(x, q, s, None, block)
            assert rel_error(y, ref) <= TOLERANCE[torch.float32], f"M={m} block={block}"


W8A8_GRANULARITIES = {
    "tensor": (),
    "channel": (),
    "block-odd": (16, 7),
    "block-even": (48, 10),
    "block-128": (128, 128),
}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x-f32", "x-bf16"])
@pytest.mark.parametrize("magnitudes", [(3e35, 3e-5), (1e-3, 1e35)], ids=["huge-w", "huge-x"])
@pytest.mark.parametrize("activation", ["token", "tensor", "static", "token-mse", "group"], ids=lambda a: f"a-{a}")
@pytest.mark.parametrize("granularity", list(W8A8_GRANULARITIES), ids=lambda g: f"w-{g}")
def test_w8a8_at_extreme_magnitudes_is_finite_and_accurate(isa, granularity, activation, magnitudes, x_dtype):
    """W8A8 multiplies FP8 codes by FP8 codes (up to 448 x 448 a term) and scales after. With a weight scale
    near 1e33 applied before the row's activation scale, those float32 sums overflowed to Inf/NaN (61 of 144
    outputs) where the float64 result is about 2e32. Huge activations times small weights must hold too."""
    w_size, x_size = magnitudes
    block_size = W8A8_GRANULARITIES[granularity]
    for m, n, k in [(1, 40, 130), (5, 33, 300), (40, 70, 256)]:
        torch.manual_seed(m)
        w = torch.randn(n, k) * w_size
        q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, granularity.split("-")[0], block_size or None)
        x = (torch.randn(m, k) * x_size).to(x_dtype)
        input_scale = formats.scale_from_amax(x.float().abs().amax(), torch.float8_e4m3fn).reshape(1)
        input_scale = input_scale if activation == "static" else None
        y = run_kernel(x, q, scale, None, block_size, activation, input_scale)
        granularity_x = "tensor" if activation == "static" else activation
        xq, xs = formats.quantize_activation(x.float(), torch.float8_e4m3fn, granularity_x, scale=input_scale)
        xs = xs.double()
        x_values = formats.fp8_to_float(xq).double() * (
            formats.expand_group_scale(xs, k) if activation == "group" else xs
        )
        ref = float64_reference(x_values, q, scale, None, block_size)
        assert ref.isfinite().all() and ref.abs().max() < 1e37
        assert y.isfinite().all(), f"{isa} M={m}: {int((~y.isfinite()).sum())} of {y.numel()} outputs not finite"
        assert rel_error(y, ref) <= TOLERANCE[x_dtype], f"{isa} M={m}: relative error {rel_error(y, ref):.2e}"


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("granularity", ["channel", "block-even"], ids=lambda g: f"w-{g}")
def test_many_rows_in_uneven_register_blocks(isa, x_dtype, granularity):
    """M = 5, 37 and 64: several register blocks of rows (the avx512bf16 kernel also counts one row per bf16 part
    of x: 1 for bf16, 2 for fp16, 3 for float32), blocks of unequal size, K and N tails."""
    block_size = GRANULARITIES[granularity]
    for m in (5, 37, 64):
        q, scale = random_weight(
            70, 301 if not block_size else 300, torch.float8_e4m3fn, granularity.split("-")[0], block_size or None
        )
        x = torch.randn(m, q.shape[1]).to(x_dtype)
        bias = torch.randn(70).to(x_dtype)
        y = run_kernel(x, q, scale, bias, block_size)
        ref = float64_reference(x, q, scale, bias, block_size)
        assert rel_error(y, ref) <= TOLERANCE[x_dtype], f"{isa} M={m}"


@pytest.mark.parametrize("activation", ["none", "group"], ids=lambda a: f"a-{a}")
@pytest.mark.parametrize("block_size", [(), (48, 10), (128, 128)], ids=lambda b: "x".join(map(str, b)) or "channel")
@pytest.mark.parametrize(
    "m, k, x_dtype",
    [(16, 2100, torch.bfloat16), (40, 6600, torch.bfloat16), (100, 2100, torch.bfloat16), (48, 2100, torch.float32)],
    ids=["M16-K2100", "M40-K6600-grouped", "M100-K2100", "M48-f32-K2100-grouped"],
)
def test_many_rows_over_several_chunks_and_grouped_tiles(isa, m, k, x_dtype, block_size, activation):
    """The avx512bf16 kernel's many-row loops go through K 1024 values at a time (the last chunk partial): up to
    64 virtual rows (one per bf16 part of x) convert the FP8 weights as they multiply them, more multiply a panel
    converted once per chunk. Activations over 512 KB send four 32-channel tiles through K together (N = 150:
    one group of four tiles and one tile left). Channel, block and 1 x 128 group scales."""
    assert_random_case_matches_float64(isa, m, 150, k, x_dtype, block_size, activation)


AVX512BF16 = isa_param("avx512bf16")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", [AVX512BF16])
@pytest.mark.parametrize(
    "m, k, n, x_dtype, block_size, activation",
    [
        (1100, 2100, 70, torch.bfloat16, (), "none"),
        (300, 16000, 40, torch.bfloat16, (), "token"),
        (300, 16000, 40, torch.bfloat16, (128, 128), "group"),
        (200, 40000, 40, torch.bfloat16, (), "none"),
        (200, 40000, 40, torch.bfloat16, (128, 128), "group"),
        (120, 6000, 40, torch.float32, (48, 10), "none"),
        (600, 1200, 3500, torch.float32, (), "none"),
    ],
    ids=["rows1100", "rows300-K16000-w8a8", "rows300-K16000-block-group", "rows200-K40000-segments",
         "rows200-K40000-segments-block-group", "f32-K6000-segments-block", "f32-rows600-spans"],
)  # fmt: skip
def test_row_groups_and_k_segments_give_each_row_the_same_bits(
    isa, one_thread, m, k, n, x_dtype, block_size, activation
):
    """Past 4 MB of activations of one part (bf16 x, FP8 activations) the avx512bf16 kernel takes the rows in
    groups of 96-256 rows; past 4 MB of a group's (float32 x: three parts; K = 40000: 66-67 rows, 5.3 MB) it goes
    through K in segments, all tiles of a span of them before the next segment (the last case: two spans, with
    two K segments, on one thread). Each row gets the same additions in the same order, so its outputs equal,
    bit for bit, those of a call with 13 rows; and they match float64."""
    granularity = "block" if block_size else "channel"
    q, scale = random_weight(n, k, torch.float8_e4m3fn, granularity, block_size or None)
    x = (torch.randn(m, k) * torch.rand(m, 1).add(0.1)).to(x_dtype)
    bias = torch.randn(n)
    y = run_kernel(x, q, scale, bias, block_size, activation)
    bits = torch.int32 if x_dtype == torch.float32 else torch.int16
    for first in (0, m // 2 - 6, m - 13):  # the first group, across a group boundary, the last rows
        rows = run_kernel(x[first : first + 13], q, scale, bias, block_size, activation)
        assert torch.equal(rows.view(bits), y[first : first + 13].view(bits)), first
    if activation == "none":
        x_values = x
    else:
        xq, xs = formats.quantize_activation(x, torch.float8_e4m3fn, activation)
        xs = formats.expand_group_scale(xs, k) if activation == "group" else xs
        x_values = formats.fp8_to_float(xq).double() * xs.double()
    ref = float64_reference(x_values, q, scale, bias, block_size)
    assert rel_error(y, ref) <= TOLERANCE[x_dtype], f"M={m} K={k} {block_size} {activation}"


@pytest.mark.parametrize("activation", ["none", "token", "group"], ids=lambda a: f"a-{a}")
@pytest.mark.parametrize(
    "block_size", [(), (128, 128), (4, 96), (64, 512), (16, 7)], ids=lambda b: "x".join(map(str, b)) or "channel"
)
@pytest.mark.parametrize(
    "m, n, k, x_dtype",
    [
        (5, 33, 577, torch.bfloat16),
        (17, 70, 1030, torch.float16),
        (24, 70, 1030, torch.bfloat16),
        (33, 1, 300, torch.bfloat16),
        (48, 65, 2049, torch.float32),
        (300, 150, 2100, torch.bfloat16),
    ],
    ids=["M5-K577", "M17-f16-K1030", "M24-K1030", "M33-N1", "M48-f32-K2049", "M300-K2100-grouped"],
)  # fmt: skip
def test_tile_products_rows_k_segments_and_scales(isa, m, n, k, x_dtype, block_size, activation):
    """The amx kernel's tile route: 16-row blocks taken two at a time (M = 5, 17, 33, 48 leave a block of 16
    alone or half full; up to 32 rows without scaled segments keep C in the tile registers through K), K in
    32-value steps with a zero tail, 128-value chunks (256 from 128 virtual rows on: M = 300, and M = 48 of
    float32 x in its three parts; each chunk's conversion shared among the blocks), N tails (N = 1). Block
    scales and 1 x 128 group scales cut K into segments: 128 x 128 (one chunk each, half a long one), 4 x 96
    (3-step segments, 1-step with groups; 4-channel blocks differ inside a register), 64 x 512 (a segment over
    four chunks, two long ones), 16 x 7 (odd k-blocks: that kernel hands the call to avx512bf16). Activations
    over 1 MB (M = 300) send up to 13 tiles through K together. Every ISA runs it; against float64."""
    assert_random_case_matches_float64(isa, m, n, k, x_dtype, block_size, activation)


@pytest.mark.parametrize("m", [20, 300], ids=lambda m: f"M{m}")
def test_many_rows_identical_across_thread_counts(isa, m):
    """Two threads share a call's tiles; at M = 300 the amx kernel sends groups of tiles through K together, and a
    thread's share of tiles cuts a group short: the bits must not change."""
    q, scale = random_weight(700, 1100, torch.float8_e4m3fn, "block", (128, 128))
    x = torch.randn(m, 1100, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run_kernel(x, q, scale, None, (128, 128), "group"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x-bf16", "x-f32"])
def test_tiny_rows_among_many(isa, x_dtype):
    """bf16 and float32 rows of magnitude 1e-30 among 24 rows: tdpbf16ps (like vdpbf16ps) flushes products this
    small against the smallest e5m2 weight, so the amx kernel must decline (to float32 products) for both the bf16
    activations it takes as they are and the float32 ones it splits."""
    q, scale = random_weight(40, 130, torch.float8_e5m2, "channel")
    q[:, ::3] = torch.tensor(1, dtype=torch.uint8).view(torch.float8_e5m2)  # 2^-16
    row_scales = torch.tensor([1.0, 1e-30] * 12)
    x = (torch.randn(24, 130) * row_scales[:, None]).to(x_dtype)
    y = run_kernel(x, q, scale, None).double()
    ref = float64_reference(x, q, scale, None, ())
    for row in range(24):
        err = ((y[row] - ref[row]).abs().max() / ref[row].abs().max()).item()
        assert err <= TOLERANCE[x_dtype], f"{isa} row {row} of scale {row_scales[row]:g}: {err:.2e}"


@pytest.mark.parametrize("m", [1, 3, 20], ids=lambda m: f"M{m}")
def test_activations_below_bf16_dot_product_range(isa, m):
    """Rows of magnitude 1e-30 and 1e-40 (float32 subnormal) beside ordinary rows, against the smallest weights of
    e5m2: a product this small is flushed to zero by vdpbf16ps, so the avx512bf16 kernel must see them coming and
    keep float32 products; each row is compared on its own scale."""
    q, scale = random_weight(40, 130, torch.float8_e5m2, "channel")
    q[:, ::3] = torch.tensor(1, dtype=torch.uint8).view(torch.float8_e5m2)  # 2^-16, the smallest subnormal
    row_scales = torch.tensor([1.0, 1e-30, 1e-40] * 7)[:m]
    x = torch.randn(m, 130) * row_scales[:, None]
    y = run_kernel(x, q, scale, None).double()
    ref = float64_reference(x, q, scale, None, ())
    for row in range(m):
        err = ((y[row] - ref[row]).abs().max() / ref[row].abs().max()).item()
        assert err <= TOLERANCE[torch.float32], f"{isa} row {row} of scale {row_scales[row]:g}: {err:.2e}"


@pytest.mark.parametrize("m", [1, 3, 20], ids=lambda m: f"M{m}")
def test_float32_activations_beyond_bf16_range(isa, m):
    """A float32 activation of 3.4e38 (finite, but above bf16's largest value, so it rounds to Inf in bf16) times a
    weight of 2^-9: the product is finite, and so must the output be."""
    q, scale = random_weight(40, 130, torch.float8_e4m3fn, "channel")
    q[:, 5] = torch.tensor(1, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2^-9, the smallest subnormal
    x = torch.randn(m, 130)
    x[:, 5] = 3.4e38
    y = run_kernel(x, q, scale, None)
    ref = float64_reference(x, q, scale, None, ())
    assert torch.isfinite(y).all(), f"{isa} M={m}"
    assert rel_error(y, ref) <= TOLERANCE[torch.float32], f"{isa} M={m}"


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("m", [1, 9], ids=lambda m: f"M{m}")
def test_output_fully_written(isa, x_dtype, m):
    q, scale = random_weight(77, 65, torch.float8_e5m2, "channel")
    x = torch.randn(m, 65).to(x_dtype)
    out = torch.full((m, 77), float("nan"), dtype=x_dtype)
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    torch.ops.qfp8._scaled_linear_cpu_into(out, x, packed, scale, None, None, 77, 65, [], "none", torch.float8_e4m3fn)
    assert torch.isfinite(out).all()
    assert torch.equal(out, run_kernel(x, q, scale, None))


@pytest.mark.parametrize("x_dtype", list(X_IDS), ids=list(X_IDS.values()))
@pytest.mark.parametrize("m", [1, 2, 4, 9], ids=lambda m: f"M{m}")
def test_output_rounding_is_bit_exact(isa, x_dtype, m):
    """K = 1 and power-of-two channel scales: every output is one exact product x * w * s, rounded once when the
    bias is added in float32 and once to the output dtype, whatever order a kernel multiplies in. So the bits must
    be those of torch's float32 math and casts: round to nearest even (bf16 and fp16 ties), fp16 overflow to Inf and
    fp16 subnormals, NaN and Inf rows. N = 70: two whole tiles and a tail of 6 channels."""
    n = 70
    generator = torch.Generator().manual_seed(m)
    codes = torch.randint(0, 256, (n, 1), dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no e4m3fn NaN codes
    q = codes.view(torch.float8_e4m3fn)
    scale = torch.pow(2.0, torch.randint(-24, 8, (n, 1), generator=generator).float())
    exponent = torch.randint(-12, 12, (m, 1), generator=generator).float()
    x = (torch.rand(m, 1, generator=generator) + 0.5) * torch.pow(2.0, exponent)
    x = torch.where(torch.rand(m, 1, generator=generator) < 0.5, -x, x).to(x_dtype)
    if m > 4:
        x[2, 0], x[5, 0] = float("nan"), float("inf")
    bias = (torch.randn(n, generator=generator) * 4).to(x_dtype)
    bias[:32] = 0  # the first tile without: its tiny products stay tiny
    y = run_kernel(x, q, scale, bias)
    exact = x.float() * formats.fp8_to_float(q).reshape(1, n) * scale.reshape(1, n)  # x * w exact, * 2^e exact
    ref = (exact + bias.float()).to(x_dtype)
    assert torch.equal(y.isnan(), ref.isnan())
    finite = ~ref.isnan()
    bits = torch.int32 if x_dtype == torch.float32 else torch.int16
    assert torch.equal(y.view(bits)[finite], ref.view(bits)[finite])
    if x_dtype == torch.float16 and m == 9:  # the cases the test is for occur
        assert ref.isinf().any() and ((ref != 0) & (ref.abs() < 2.0**-14)).any()


@pytest.mark.parametrize("shape", [(1, 1), (7, 17), (33, 64), (577, 31)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("w_dtype", list(FP8_IDS), ids=list(FP8_IDS.values()))
def test_pack_unpack_bitwise(w_dtype, shape):
    bits = torch.randint(0, 256, shape, dtype=torch.uint8)
    q = bits.view(w_dtype)
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    assert packed.dtype == w_dtype and tuple(packed.shape) == cpu.packed_shape(*shape)
    back = torch.ops.qfp8.unpack_weight_cpu(packed, *shape)
    assert back.dtype == w_dtype and torch.equal(back.view(torch.uint8), bits)


def test_large_packed_weight_is_huge_page_aligned_and_round_trips():
    # From 2 MiB up the packed weight comes from the extension's 2 MiB-aligned,
    # THP-advised allocator (cpu._packed_buffer); the layout is the same.
    shape = (1000, 2100)  # 32 tiles x 1050 pairs x 64 bytes = 2.05 MiB packed
    bits = torch.randint(0, 256, shape, dtype=torch.uint8)
    packed = torch.ops.qfp8.pack_weight_cpu(bits.view(torch.float8_e4m3fn))
    assert packed.numel() >= cpu.HUGEPAGE_MIN_BYTES
    assert packed.data_ptr() % cpu.HUGEPAGE_MIN_BYTES == 0
    back = torch.ops.qfp8.unpack_weight_cpu(packed, *shape)
    assert torch.equal(back.view(torch.uint8), bits)
    # And the kernel computes from it: float64 reference, random inputs.
    q, scale = random_weight(*shape, torch.float8_e4m3fn, "channel")
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    assert packed.data_ptr() % cpu.HUGEPAGE_MIN_BYTES == 0
    x = torch.randn(3, shape[1])
    got = torch.ops.qfp8.scaled_linear_cpu(x, packed, scale, None, None, *shape, [], "none", torch.float8_e4m3fn)
    ref = float64_reference(x.double(), q, scale, None, ())
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.skipif(sys.platform != "linux", reason="counts minor page faults through getrusage, as Linux reports them")
@pytest.mark.parametrize("activation", ["none", "token"], ids=lambda a: f"a-{a}")
def test_repeated_large_calls_reuse_their_activation_buffers(activation):
    """A call's laid-out (or quantized) activations live in scratch memory that the next call takes again: a fresh
    buffer of this size (32 MB) faults in at least sixteen 2 MiB pages (8192 with 4 KiB pages) at every call, and after
    other large allocations far more slowly. The results stay the float64 reference's.

    glibc may trim its heap between calls, and the next call's small allocations (the 128 KB output) then fault in
    again now and then: the fewest faults of three runs of three calls is compared, which a buffer taken fresh at
    every call exceeds in every run."""
    import resource

    k = 4096
    q, scale = random_weight(32, k, torch.float8_e4m3fn, "channel")
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    x = torch.randn(2048, k, dtype=torch.bfloat16)
    call = torch.ops.qfp8.scaled_linear_cpu
    first = call(x, packed, scale, None, None, 32, k, [], activation, torch.float8_e4m3fn)
    runs = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            again = call(x, packed, scale, None, None, 32, k, [], activation, torch.float8_e4m3fn)
        runs.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(runs) <= 8, runs
    assert torch.equal(again, first)
    xr = x.double()
    if activation == "token":
        xq, xs = formats.quantize_activation(x.float(), torch.float8_e4m3fn, "token")
        xr = formats.fp8_to_float(xq).double() * xs
    ref = float64_reference(xr, q, scale, None, ())
    assert ((first.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_opcheck():
    q, scale = random_weight(40, 33, torch.float8_e4m3fn, "channel")
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    # qfp8.library.testing.opcheck: torch's schema test cannot compare FP8 tensors.
    opcheck(torch.ops.qfp8.pack_weight_cpu, (q,))
    opcheck(torch.ops.qfp8.unpack_weight_cpu, (packed, 40, 33))
    x = torch.randn(2, 3, 33, dtype=torch.bfloat16)
    bias = torch.randn(40, dtype=torch.bfloat16)
    for activation, input_scale in (("none", None), ("token", None), ("static", torch.tensor([0.02]))):
        args = (x, packed, scale, bias, input_scale, 40, 33, [], activation, torch.float8_e4m3fn)
        opcheck(torch.ops.qfp8.scaled_linear_cpu, args)


def test_compiles_fullgraph():
    q, scale = random_weight(48, 64, torch.float8_e4m3fn, "channel")
    packed = torch.ops.qfp8.pack_weight_cpu(q)

    def layer(x):
        y = torch.ops.qfp8.scaled_linear_cpu(x, packed, scale, None, None, 48, 64, [], "none", torch.float8_e4m3fn)
        return torch.relu(y)

    x = torch.randn(3, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


def _valid_args():
    q, scale = random_weight(40, 33, torch.float8_e4m3fn, "channel")
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    return dict(
        x=torch.randn(2, 33),
        packed_weight=packed,
        weight_scale=scale,
        bias=None,
        input_scale=None,
        out_features=40,
        in_features=33,
        block_size=[],
        activation="none",
        activation_dtype=torch.float8_e4m3fn,
    )


BAD_INPUTS = {
    "mismatched-K": (dict(x=torch.randn(2, 34)), "34"),
    "x-int": (dict(x=torch.ones(2, 33, dtype=torch.int32)), "torch.int32"),
    "x-noncontiguous": (dict(x=torch.randn(33, 2).t()), "(2, 33)"),
    "x-meta": (dict(x=torch.randn(2, 33, device="meta")), "meta"),
    "weight-not-fp8": (dict(packed_weight=torch.zeros(2, 17, 64)), "torch.float32"),
    "weight-wrong-shape": (dict(packed_weight=torch.zeros(1, 17, 64, dtype=torch.float8_e4m3fn)), "(1, 17, 64)"),
    "scale-wrong-shape": (dict(weight_scale=torch.ones(39, 1)), "(39, 1)"),
    "scale-float64": (dict(weight_scale=torch.ones(40, 1, dtype=torch.float64)), "torch.float64"),
    "bias-wrong-shape": (dict(bias=torch.ones(41)), "(41,)"),
    "block-wrong-shape": (dict(block_size=[16, 16], weight_scale=torch.ones(3, 2)), "(3, 2)"),
    "static-no-scale": (dict(activation="static"), "input_scale"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error_with_sizes(case):
    changes, expected_text = BAD_INPUTS[case]
    args = _valid_args() | changes
    with pytest.raises(ValueError, match=None) as error:
        cpu.scaled_linear_cpu(**args)
    assert expected_text in str(error.value)


def test_kernel_checks_name_sizes():
    args = _valid_args() | dict(x=torch.randn(2, 34))
    with pytest.raises(RuntimeError, match="in_features is 33"):
        torch.ops.qfp8.scaled_linear_cpu(*args.values())


def test_routing_registers_the_cpu_kernel():
    from qfp8.library.routing import KernelRequest, select_kernel

    request = KernelRequest(
        torch.device("cpu"), torch.float8_e4m3fn, "channel", (), "none", torch.float8_e4m3fn, 64, 32
    )
    kernel, _ = select_kernel(request)
    assert kernel.name.startswith("cpu-") and kernel.op is torch.ops.qfp8.scaled_linear_cpu


@pytest.mark.parametrize("requested", ["scalar", "avx512bf16", "amx"], ids=lambda r: f"env-{r}")
def test_isa_environment_variable(requested):
    code = "import warnings; warnings.simplefilter('always'); from qfp8.library import cpu; print(cpu.cpu_kernel_isa())"
    env = dict(os.environ, QFP8_CPU_ISA=requested)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    chosen = result.stdout.strip().splitlines()[-1]
    if requested in cpu.usable_isas():
        assert chosen == requested
    else:
        assert chosen == cpu.usable_isas()[0] and "QFP8_CPU_ISA=" in result.stderr


def test_set_unsupported_isa_raises():
    with pytest.raises(ValueError, match="unknown CPU kernel ISA"):
        cpu.set_cpu_kernel_isa("sse9")
    missing = [isa for isa in cpu.ISAS if isa not in cpu.usable_isas()]
    if missing:
        with pytest.raises(ValueError, match=missing[0]):
            cpu.set_cpu_kernel_isa(missing[0])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: torch.ops.qfp8.pack_weight_cpu(torch.zeros(5, dtype=torch.float8_e4m3fn)), ValueError, r"\[N, K\], got shape \[5\]"),
        (lambda: torch.ops.qfp8.pack_weight_cpu(torch.zeros(5, 3)), TypeError, "must be an FP8 tensor, got torch.float32"),
        (lambda: torch.ops.qfp8.unpack_weight_cpu(torch.zeros(1, 2, 64, dtype=torch.float8_e4m3fn), 40, 3), ValueError,
         r"a packed \[40, 3\] weight has shape \[2, 2, 64\], got \[1, 2, 64\]"),
        (lambda: torch.ops.qfp8.unpack_weight_cpu(torch.zeros(1, 2, 64, dtype=torch.float8_e4m3fn), 0, 3), ValueError,
         r"sizes must be positive"),
    ],
)  # fmt: skip
def test_pack_and_unpack_refuse_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_an_unknown_qfp8_kernel_setting_warns_once(monkeypatch):
    import warnings

    from torch import nn

    import qfp8
    from qfp8.library import routing

    monkeypatch.setenv("QFP8_KERNEL", "not-a-route")
    monkeypatch.setattr(routing, "_WARNED_KERNEL_VALUES", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            qfp8.quantize(nn.Sequential(nn.Linear(8, 8)), exclude=())
    messages = [str(w.message) for w in caught if "QFP8_KERNEL" in str(w.message)]
    assert messages == [
        "QFP8_KERNEL='not-a-route' is not a setting qfp8 knows (only 'reference' forces a route); ignored"
    ]


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_a_static_input_scale_that_is_not_finite_and_positive_is_refused(value):
    w = torch.randn(8, 16).to(torch.float8_e4m3fn)
    packed = torch.ops.qfp8.pack_weight_cpu(w)
    x = torch.randn(2, 16)
    args = (packed, torch.ones(1), None, torch.tensor([value]), 8, 16, [], "static", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"static input_scale must be finite and > 0"):
        torch.ops.qfp8.scaled_linear_cpu(x, *args)
    assert torch.isfinite(
        torch.ops.qfp8.scaled_linear_cpu(x, packed, torch.ones(1), None, torch.tensor([0.01]), *args[4:])
    ).all()
