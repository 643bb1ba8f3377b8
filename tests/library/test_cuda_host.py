"""The CUDA routes' arithmetic and Python, checked on the CPU.

- ``qfp8/ext/cuda/fp8_layout.cuh`` (compiled into ``qfp8._C`` through
  ``qfp8/ext/cpu/cuda_host_layout.cpp``): FP8 -> fp16/bf16 bits for every code,
  the pack permutation and its inverse, and a simulation of the kernel's
  loads and MMA fragments on the packed layout that must give ``x @ W^T``;
- ``qfp8/library/cuda.py``: routing decisions for given GPU capabilities, the
  ``_scaled_mm`` route (torch's ``_scaled_mm`` runs on CPU too) and the
  weight-only route's Python around an emulated kernel, against the reference.
"""

import pytest
import torch

from qfp8 import formats
from qfp8.library import cuda, routing
from qfp8.library.routing import KernelRequest
from qfp8.library.testing import opcheck
from tests.conftest import FP8_DTYPES, FP8_IDS, sqnr

HOST_OPS = hasattr(torch.ops.qfp8, "cuda_pack_weight_host")
needs_host_ops = pytest.mark.skipif(
    not HOST_OPS,
    reason="qfp8._C was built without qfp8/ext/cpu/cuda_host_layout.cpp; rebuild: pip install --no-build-isolation -e .",
)
HALF_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
SHAPES = [(1, 1), (32, 32), (33, 65), (70, 100), (31, 257), (96, 64)]


def random_fp8(n, k, dtype):
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8).view(dtype)
    finite = torch.isfinite(codes.to(torch.float32))
    return torch.where(finite, codes.view(torch.uint8), 0).view(dtype)  # weights are finite by contract


# ------------------------------------------------------------ conversion


@needs_host_ops
@pytest.mark.parametrize("half", list(HALF_IDS), ids=list(HALF_IDS.values()))
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=[FP8_IDS[d] for d in FP8_DTYPES])
def test_fp8_to_half_bits_every_code(fp8, half):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    bits = torch.ops.qfp8.fp8_to_half_bits_host(codes, half)
    expected = codes.to(half).view(torch.int16)
    finite = torch.isfinite(codes.to(torch.float32))
    mismatched = ((bits != expected) & finite).nonzero().flatten().tolist()
    assert mismatched == [], f"codes {mismatched} of {fp8} convert to wrong {half} bits"
    # Non-finite codes are documented not to be preserved; they never reach the kernel.
    assert int((~finite).sum()) == {torch.float8_e4m3fn: 2, torch.float8_e5m2: 8, torch.float8_e4m3fnuz: 1}[fp8]


@needs_host_ops
def test_fp8_to_half_bits_rejects_non_fp8():
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.qfp8.fp8_to_half_bits_host(torch.zeros(4, dtype=torch.uint8), torch.float16)


# --------------------------------------------------------------- packing


def documented_offset(n, k, in_features):
    """fp8_layout.cuh: packed[nt][kt][lane][s][j][e] holds weight[32 nt + 8 j + lane/4][32 kt + 8 (lane%4) + 4 s + e]."""
    kt_count = -(-in_features // 32)
    nt, j, g = n // 32, (n % 32) // 8, n % 8
    kt, t, s, e = k // 32, (k % 32) // 8, (k % 8) // 4, k % 4
    return (nt * kt_count + kt) * 1024 + (4 * g + t) * 32 + s * 16 + j * 4 + e


@needs_host_ops
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=[FP8_IDS[d] for d in FP8_DTYPES])
def test_pack_roundtrip_and_python_pack_agree(fp8, shape):
    n, k = shape
    w = random_fp8(n, k, fp8)
    host = torch.ops.qfp8.cuda_pack_weight_host(w)
    python = cuda.pack_weight_cuda(w)
    assert host.dtype == fp8 and tuple(host.shape) == cuda.packed_shape(n, k)
    assert torch.equal(host.view(torch.uint8), python.view(torch.uint8))
    for unpack in (torch.ops.qfp8.cuda_unpack_weight_host, cuda.unpack_weight_cuda):
        assert torch.equal(unpack(host, n, k).view(torch.uint8), w.view(torch.uint8))
    # Every byte outside [N, K] is zero padding.
    flat = host.view(torch.uint8).flatten()
    assert int(flat.count_nonzero()) == int(w.view(torch.uint8).count_nonzero())


@needs_host_ops
def test_pack_follows_documented_offsets():
    n, k = 70, 100
    w = torch.arange(n * k, dtype=torch.int64).remainder(251).add(1).to(torch.uint8).reshape(n, k)
    flat = torch.ops.qfp8.cuda_pack_weight_host(w.view(torch.float8_e4m3fn)).view(torch.uint8).flatten()
    for row, col in [(0, 0), (1, 0), (0, 1), (8, 3), (31, 31), (32, 32), (69, 99), (45, 70), (7, 95)]:
        assert int(flat[documented_offset(row, col, k)]) == int(w[row, col]), (row, col)


@needs_host_ops
def test_pack_errors_name_sizes():
    with pytest.raises(RuntimeError, match="2-D"):
        torch.ops.qfp8.cuda_pack_weight_host(torch.zeros(4, dtype=torch.float8_e4m3fn))
    packed = torch.ops.qfp8.cuda_pack_weight_host(torch.zeros(40, 40, dtype=torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="out_features=100, in_features=40"):
        torch.ops.qfp8.cuda_unpack_weight_host(packed, 100, 40)


# ------------------------------------------- the kernel's reads, simulated


def simulate_kernel(x, packed, weight_scale, block_size, n_out, k_in, fp8, half):
    """y = x @ dequant(W)^T computed the way fp8_linear.cu reads and multiplies.

    Per warp tile (nt), K tile (kt), lane (g, t), MMA step s and n8 tile j: the
    lane's 32 bytes at lane_tile_offset, word (s, j), bytes 0-1 -> B k-slots
    2t, 2t+1 and bytes 2-3 -> slots 2t+8, 2t+9 of column g; A row r slot
    2t+i <- x[r, 32 kt + 8 t + 4 s + i], slot 2t+8+i <- x[r, 32 kt + 8 t + 4 s + 2 + i];
    then the m16n8k16 product of those fragments (PTX fragment layout).
    """
    m = x.shape[0]
    nt_count, kt_count, _ = cuda.packed_shape(n_out, k_in)
    flat = packed.view(torch.uint8).flatten()
    values = torch.ops.qfp8.fp8_to_half_bits_host(flat.view(fp8), half).view(half).to(torch.float64)
    x_cols = -(-k_in // 8) * 8
    xp = torch.zeros(m, kt_count * 32, dtype=torch.float64)
    xp[:, :k_in] = x.to(torch.float64)
    xp[:, x_cols:] = float("nan")  # the kernel never reads columns past x_cols: NaN would show it
    y = torch.zeros(m, nt_count * 32, dtype=torch.float64)
    lanes = torch.arange(32)
    g, t = lanes // 4, lanes % 4
    blocked = bool(block_size)
    for nt in range(nt_count):
        for kt in range(kt_count):
            lane_bytes = values[(nt * kt_count + kt) * 1024 + lanes[:, None] * 32 + torch.arange(32)]  # [lane, 32]
            column = kt * 32 + 8 * t  # [lane]
            chunk = torch.zeros(m, 32, 8, dtype=torch.float64)  # x[r, column(lane) .. +8], zero past x_cols
            for lane in range(32):
                if column[lane] < x_cols:
                    chunk[:, lane] = xp[:, column[lane] : column[lane] + 8]
            for s in range(2):
                a = torch.zeros(m, 16, dtype=torch.float64)  # A[r, slot]: every lane of a row agrees
                for lane in range(32):
                    ti = int(t[lane])
                    a[:, 2 * ti : 2 * ti + 2] = chunk[:, lane, 4 * s : 4 * s + 2]
                    a[:, 2 * ti + 8 : 2 * ti + 10] = chunk[:, lane, 4 * s + 2 : 4 * s + 4]
                for j in range(4):
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    word = lane_bytes[:, 16 * s + 4 * j : 16 * s + 4 * j + 4]  # [lane, e]
                    n = nt * 32 + 8 * j + g  # column of each lane's word
                    if blocked:
                        bn, bk = block_size
                        rows = n.clamp(max=n_out - 1) // bn
                        block_scale = weight_scale[rows, (kt * 32) // bk]  # float32 multiply, one rounding
                        word = (word.to(torch.float32) * block_scale[:, None]).to(half).to(torch.float64)
                    for lane in range(32):
                        ti, gi = int(t[lane]), int(g[lane])
                        b[2 * ti : 2 * ti + 2, gi] = word[lane, 0:2]
                        b[2 * ti + 8 : 2 * ti + 10, gi] = word[lane, 2:4]
                    y[:, nt * 32 + 8 * j : nt * 32 + 8 * j + 8] += a @ b
    y = y[:, :n_out]
    if not blocked:
        y = y * weight_scale.reshape(-1).to(torch.float64)
    return y


CASES = [
    ("channel", (37, 70), ()),
    ("tensor", (64, 96), ()),
    ("block", (70, 128), (48, 64)),
]


@needs_host_ops
@pytest.mark.parametrize("half", list(HALF_IDS), ids=list(HALF_IDS.values()))
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=[FP8_IDS[d] for d in FP8_DTYPES])
@pytest.mark.parametrize("granularity,shape,block", CASES, ids=[c[0] for c in CASES])
def test_simulated_kernel_reads_compute_the_product(granularity, shape, block, fp8, half):
    n, k = shape
    weight = torch.randn(n, k)
    q, scale = formats.quantize_weight(weight, fp8, granularity, block or None)
    x = torch.randn(5, k).to(half)
    packed = torch.ops.qfp8.cuda_pack_weight_host(q)
    simulated = simulate_kernel(x, packed, scale, block, n, k, fp8, half)
    values = formats.fp8_to_float(q, torch.float64)
    if block:  # the kernel rounds q * s (float32) once to fp16/bf16 (fp8_layout.cuh)
        w = formats.dequantize_weight(q, scale, block).to(half).to(torch.float64)
    else:
        w = values * scale.to(torch.float64).reshape(-1, 1)
    reference = x.to(torch.float64) @ w.t()
    torch.testing.assert_close(simulated, reference, rtol=1e-12, atol=1e-12)
    exact = x.to(torch.float64) @ formats.dequantize_weight(q, scale, block or None, torch.float64).t()
    assert sqnr(exact, simulated) > 40


# ---------------------------------------------------------------- routing


def request(activation="token", granularity="channel", n=4096, k=4096, block=(), weight=torch.float8_e4m3fn):
    return KernelRequest(
        device=torch.device("cuda", 0),
        weight_dtype=weight,
        granularity=granularity,
        block_size=block,
        activation=activation,
        activation_dtype=formats.activation_dtype_for(weight),
        out_features=n,
        in_features=k,
    )


@pytest.fixture
def gpu(monkeypatch):
    """Pretends a GPU of the given capability with the kernels enabled and the extension built."""

    def set_capability(capability):
        monkeypatch.setattr(cuda, "device_capability", lambda device: capability)

    monkeypatch.setenv(cuda.CUDA_KERNELS_ENV, "1")
    monkeypatch.delenv("QFP8_KERNEL", raising=False)
    monkeypatch.setattr(cuda, "load_cuda_extension", lambda: True)
    set_capability((9, 0))
    return set_capability


ROUTES = [
    # (capability, request kwargs, expected kernel, words in the reason the best kernel passed over)
    ((9, 0), {}, "cuda-scaled-mm", None),
    ((9, 0), {"n": 4100}, "cuda-scaled-mm-padded16", "out_features=4100"),
    ((9, 0), {"k": 4101}, "cuda-scaled-mm-padded16", "in_features=4101"),
    ((9, 0), {"activation": "none"}, "cuda-fp8-marlin", "per-token or per-tensor"),
    ((9, 0), {"activation": "group"}, "cuda-fp8-marlin", "'group'"),
    ((9, 0), {"granularity": "block", "block": (128, 128)}, "cuda-fp8-marlin", "block weight scales"),
    ((9, 0), {"granularity": "block", "block": (128, 100)}, "reference", "multiple of 32"),
    ((9, 0), {"weight": torch.float8_e4m3fnuz}, "cuda-fp8-marlin", "float8_e4m3fnuz"),
    ((8, 9), {}, "cuda-fp8-marlin", "rowwise"),
    ((8, 9), {"activation": "tensor", "granularity": "tensor"}, "cuda-scaled-mm", None),
    ((8, 6), {}, "cuda-fp8-marlin", "8.9+"),
    ((8, 0), {"activation": "none"}, "cuda-fp8-marlin", "8.9+"),
    ((7, 5), {"activation": "none"}, "reference", "8.0+"),
]


@pytest.mark.parametrize(
    "capability,kwargs,expected,reason",
    ROUTES,
    ids=[f"sm{c[0]}{c[1]}-{e}-{i}" for i, (c, _, e, _r) in enumerate(ROUTES)],
)
def test_cuda_routing(gpu, capability, kwargs, expected, reason):
    gpu(capability)
    kernel, passed_over = routing.select_kernel(request(**kwargs))
    assert kernel.name == expected, passed_over
    if reason is not None:
        assert reason in " | ".join(passed_over), passed_over


def test_cuda_routes_off_by_default(gpu, monkeypatch):
    monkeypatch.delenv(cuda.CUDA_KERNELS_ENV)
    kernel, passed_over = routing.select_kernel(request())
    assert kernel.name == "reference"
    assert len(passed_over) == 3 and all(cuda.CUDA_KERNELS_ENV in reason for reason in passed_over)


def test_marlin_needs_the_extension(gpu, monkeypatch):
    monkeypatch.setattr(cuda, "load_cuda_extension", lambda: False)
    kernel, passed_over = routing.select_kernel(request(activation="none"))
    assert kernel.name == "reference" and "extension is not built" in passed_over[-1]


def test_no_route_claims_a_cpu_request():
    cpu_request = KernelRequest(
        torch.device("cpu"), torch.float8_e4m3fn, "channel", (), "token", torch.float8_e4m3fn, 64, 64
    )
    for kernel in (cuda.SCALED_MM_KERNEL, cuda.SCALED_MM_PADDED_KERNEL, cuda.MARLIN_KERNEL):
        assert "not a CUDA device" in kernel.supports(cpu_request)


# -------------------------------------------- the _scaled_mm route on CPU


SCALED_MM_CASES = [
    ("token", "channel", 48, 64),
    ("tensor", "tensor", 48, 64),
    ("static", "channel", 37, 70),
    ("token", "tensor", 37, 70),
]


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "activation,granularity,n,k", SCALED_MM_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}" for c in SCALED_MM_CASES]
)
def test_scaled_mm_linear_matches_reference(activation, granularity, n, k, xdtype):
    q, scale = formats.quantize_weight(torch.randn(n, k), torch.float8_e4m3fn, granularity)
    x = torch.randn(2, 3, k).to(xdtype)
    bias = torch.randn(n).to(xdtype)
    input_scale = torch.tensor([x.abs().max().item() / 448.0]) if activation == "static" else None
    packed = cuda.pack_weight_scaled_mm(q)
    assert packed.shape[0] % 16 == 0 and packed.shape[1] % 16 == 0
    args = (x, packed, scale, bias, input_scale, n, k, activation, torch.float8_e4m3fn)
    y = torch.ops.qfp8.scaled_mm_linear(*args)
    reference = torch.ops.qfp8.scaled_linear(x, q, scale, bias, input_scale, [], activation, torch.float8_e4m3fn)
    assert y.shape == reference.shape and y.dtype == xdtype
    assert sqnr(reference, y) > 40  # same FP8 products; bf16 output rounding at most
    assert torch.equal(cuda.unpack_weight_scaled_mm(packed, n, k).view(torch.uint8), q.view(torch.uint8))
    opcheck(torch.ops.qfp8.scaled_mm_linear, args)


def test_scaled_mm_scales_shapes():
    a, b, rowwise = cuda.scaled_mm_scales(torch.tensor([0.5]), torch.tensor([2.0]), 7, 48)
    assert not rowwise and a.shape == () and b.shape == ()
    a, b, rowwise = cuda.scaled_mm_scales(torch.rand(7, 1), torch.rand(37, 1), 7, 48)
    assert rowwise and a.shape == (7, 1) and b.shape == (1, 48) and torch.all(b[0, 37:] == 1)
    a, b, rowwise = cuda.scaled_mm_scales(torch.tensor([0.5]), torch.rand(48, 1), 7, 48)
    assert rowwise and a.shape == (7, 1) and torch.all(a == 0.5) and b.is_contiguous()


def test_scaled_mm_activation_padding_is_zero():
    x = torch.randn(3, 70)
    q, scale = cuda.quantize_for_scaled_mm(x, "token", torch.float8_e4m3fn, None, 80)
    assert q.shape == (3, 80) and scale.shape == (3, 1)
    assert int(q[:, 70:].view(torch.uint8).count_nonzero()) == 0
    with pytest.raises(ValueError, match="input_scale"):
        cuda.quantize_for_scaled_mm(x, "static", torch.float8_e4m3fn, None, 80)


# ------------------------------- the weight-only route around an emulated kernel


MARLIN_CASES = [
    ("none", "channel", (), 5, 40, 64),
    ("none", "tensor", (), 3, 33, 70),  # K % 8 != 0: x is padded for the kernel
    ("none", "block", (32, 64), 4, 70, 128),
    ("token", "channel", (), 2, 48, 64),  # W8A8 on sm80-86: quantize-dequantize + W8A16
    ("group", "block", (64, 128), 2, 64, 256),
    ("none", "channel", (), cuda.LARGE_M, 40, 64),  # dequantize + matmul
]


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "activation,granularity,block,m,n,k",
    MARLIN_CASES,
    ids=[f"{c[0]}-{c[1]}-m{c[3]}-{c[4]}x{c[5]}" for c in MARLIN_CASES],
)
def test_scaled_linear_cuda_emulated_matches_reference(activation, granularity, block, m, n, k, xdtype):
    q, scale = formats.quantize_weight(torch.randn(n, k), torch.float8_e4m3fn, granularity, block or None)
    x = torch.randn(m, k).to(xdtype)
    bias = torch.randn(n, dtype=torch.float32)
    packed = cuda.pack_weight_cuda(q)
    args = (x, packed, scale, bias, None, n, k, list(block), activation, torch.float8_e4m3fn)
    y = torch.ops.qfp8.scaled_linear_cuda(*args)
    reference = torch.ops.qfp8.scaled_linear(x, q, scale, bias, None, list(block), activation, torch.float8_e4m3fn)
    assert y.shape == reference.shape and y.dtype == xdtype
    assert sqnr(reference, y) > 35
    if m < 16:
        opcheck(torch.ops.qfp8.scaled_linear_cuda, args)


def test_kernel_input_is_padded_to_eight_columns():
    x = torch.randn(3, 70)
    padded = cuda._kernel_input(x, 70)
    assert padded.shape == (3, 72) and torch.all(padded[:, 70:] == 0)
    aligned = torch.randn(3, 64)
    assert cuda._kernel_input(aligned, 64) is aligned
    assert cuda._kernel_input(aligned.t().contiguous().t(), 64).is_contiguous()


def test_pack_ops_opcheck_and_compile():
    q = random_fp8(40, 70, torch.float8_e4m3fn)
    opcheck(torch.ops.qfp8.pack_weight_cuda, (q,))
    packed = cuda.pack_weight_cuda(q)
    opcheck(torch.ops.qfp8.unpack_weight_cuda, (packed, 40, 70))
    opcheck(torch.ops.qfp8.pack_weight_scaled_mm, (q,))

    def layer(x, packed, scale):
        return torch.ops.qfp8.scaled_mm_linear(x, packed, scale, None, None, 40, 70, "token", torch.float8_e4m3fn)

    _, scale = formats.quantize_weight(torch.randn(40, 70), torch.float8_e4m3fn, "channel")
    mm_packed = cuda.pack_weight_scaled_mm(q)
    x = torch.randn(3, 70, dtype=torch.bfloat16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, mm_packed, scale), layer(x, mm_packed, scale))
