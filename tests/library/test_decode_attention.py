"""``torch.ops.qfp8.fp8_decode_attention``: one query token against an FP8 K/V cache.

Judged against float64 attention over the dequantized FP8 values (what the
kernel must compute exactly, up to float32 summation): relative error
<= 1e-5 for float32 outputs, <= 1e-2 for bf16. Every ISA variant this machine
runs, grouped-query shapes, odd head dims, both FP8 formats, per-tensor and
per-head scales, bool and additive masks; masked positions are never read.
"""

from __future__ import annotations

import pytest
import torch

from qfp8 import formats
from qfp8.library import attention, cpu
from qfp8.library.testing import opcheck

pytestmark = pytest.mark.skipif(cpu.cpu_kernel_isa() is None, reason="the qfp8 CPU extension is not built")

# The attention kernel has two variants: AVX2 (used by every vector ISA) and scalar.
ISA_PARAMS = [
    pytest.param(
        isa,
        id=isa,
        marks=pytest.mark.skipif(isa not in cpu.usable_isas(), reason=f"this CPU or build does not run {isa}"),
    )
    for isa in ("avx2", "scalar")
]


@pytest.fixture(params=ISA_PARAMS)
def isa(request):
    with cpu.cpu_kernel_isa_forced(request.param):
        yield request.param


def make_case(b, hq, hkv, s, d, dtype, per_head, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hq, 1, d, generator=g)
    keys = torch.randn(b, hkv, s, d, generator=g) * 3
    values = torch.randn(b, hkv, s, d, generator=g)
    if per_head:
        k_scale = keys.abs().amax((-2, -1), keepdim=True) / formats.fp8_max(dtype)
        v_scale = values.abs().amax((-2, -1), keepdim=True) / formats.fp8_max(dtype)
    else:
        k_scale = (keys.abs().amax() / formats.fp8_max(dtype)).reshape(1)
        v_scale = (values.abs().amax() / formats.fp8_max(dtype)).reshape(1)
    kq = formats.quantize_with_scale(keys, k_scale, dtype)
    vq = formats.quantize_with_scale(values, v_scale, dtype)
    return query, kq, vq, k_scale, v_scale


def float64_attention(query, kq, vq, k_scale, v_scale, mask, scaling):
    b, hq, _, d = query.shape
    hkv = kq.shape[1]

    def full(scale):
        return scale.double().reshape((b, hkv, 1, 1) if scale.numel() > 1 else (1, 1, 1, 1))

    k = formats.fp8_to_float(kq).double() * full(k_scale)
    v = formats.fp8_to_float(vq).double() * full(v_scale)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = (query.double() * scaling) @ k.transpose(-1, -2)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v


def relative_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


SHAPES = [  # (B, Hq, Hkv, S, D)
    (1, 4, 2, 1, 64),
    (1, 8, 8, 33, 64),
    (2, 6, 1, 200, 64),
    (2, 4, 2, 57, 17),
    (1, 2, 1, 130, 128),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
def test_matches_float64(isa, shape, dtype, per_head):
    b, hq, hkv, s, d = shape
    query, kq, vq, ks, vs = make_case(b, hq, hkv, s, d, dtype, per_head)
    scaling = d**-0.5
    # A bool mask that differs per sequence: sequence i sees its first s - 3 * i positions.
    valid = torch.arange(s)[None, :] < torch.tensor([max(1, s - 3 * i) for i in range(b)])[:, None]
    mask = valid[:, None, None, :]
    for m in (None, mask):
        out = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, m, scaling)
        assert out.shape == query.shape and out.dtype == torch.float32
        assert relative_error(out, float64_attention(query, kq, vq, ks, vs, m, scaling)) <= 1e-5
        reference = attention.fp8_decode_attention_reference(query, kq, vq, ks, vs, m, scaling)
        assert relative_error(out, reference.double()) <= 1e-5
    out = torch.ops.qfp8.fp8_decode_attention(query.bfloat16(), kq, vq, ks, vs, mask, scaling)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, float64_attention(query.bfloat16(), kq, vq, ks, vs, mask, scaling)) <= 1e-2


@pytest.mark.parametrize("per_head_key", [False, True], ids=["k-tensor-v-head", "k-head-v-tensor"])
def test_one_scale_per_tensor_and_the_other_per_head(isa, per_head_key):
    # A layer with one static scale and one dynamic (a checkpoint that lacks one of the two).
    query, kq, vq, ks_head, vs_head = make_case(3, 8, 2, 40, 64, torch.float8_e4m3fn, True, seed=4)
    ks, vs = (ks_head, vs_head.amax().reshape(1)) if per_head_key else (ks_head.amax().reshape(1), vs_head)
    out = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, None, 0.125)
    assert relative_error(out, float64_attention(query, kq, vq, ks, vs, None, 0.125)) <= 1e-5
    reference = attention.fp8_decode_attention_reference(query, kq, vq, ks, vs, None, 0.125)
    assert relative_error(out, reference.double()) <= 1e-5


def test_empty_cache_gives_zeros(isa):
    query, kq, vq, ks, vs = make_case(2, 4, 2, 1, 16, torch.float8_e4m3fn, True, seed=5)
    empty_k, empty_v = kq[:, :, :0], vq[:, :, :0]
    for op in (torch.ops.qfp8.fp8_decode_attention, attention.fp8_decode_attention_reference):
        out = op(query, empty_k, empty_v, ks, vs, None, 0.25)
        assert out.shape == query.shape and torch.equal(out, torch.zeros_like(query))


def test_additive_mask_and_masked_rows_are_never_read(isa):
    query, kq, vq, ks, vs = make_case(2, 4, 2, 64, 64, torch.float8_e4m3fn, False, seed=3)
    minimum = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 1, 1, 64)
    mask[0, ..., 40:] = minimum  # transformers' additive masks use finfo.min
    mask[1, ..., 10:] = float("-inf")
    mask[..., :5] = torch.randn(2, 1, 1, 5)  # finite biases are added
    expected = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, mask, 0.125)
    assert relative_error(expected, float64_attention(query, kq, vq, ks, vs, mask, 0.125)) <= 1e-5
    # NaN bytes in every masked row: the result does not change, so they were not read.
    poisoned_k, poisoned_v = kq.clone(), vq.clone()
    for t in (poisoned_k, poisoned_v):
        t.view(torch.uint8)[0, :, 40:] = 0x7F
        t.view(torch.uint8)[1, :, 10:] = 0x7F
    out = torch.ops.qfp8.fp8_decode_attention(query, poisoned_k, poisoned_v, ks, vs, mask, 0.125)
    assert torch.equal(out, expected)


def test_fully_masked_sequence_gives_zeros(isa):
    query, kq, vq, ks, vs = make_case(2, 4, 2, 16, 64, torch.float8_e4m3fn, True, seed=4)
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[1] = False
    out = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, mask, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all() and out[0].abs().sum() > 0


def test_small_scales_and_subnormal_codes(isa):
    # Tiny key and value scales (1e-6 / 1e-8) and FP8 subnormal codes in the cache.
    query, kq, vq, _, _ = make_case(1, 4, 2, 40, 64, torch.float8_e4m3fn, False, seed=5)
    kq.view(torch.uint8)[..., :3] = torch.tensor([0x01, 0x83, 0x07], dtype=torch.uint8)
    ks, vs = torch.tensor([1e-6]), torch.tensor([1e-8])
    out = torch.ops.qfp8.fp8_decode_attention(query * 1e5, kq, vq, ks, vs, None, 0.125)
    assert relative_error(out, float64_attention(query * 1e5, kq, vq, ks, vs, None, 0.125)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_codes_give_nan_where_attention_reads_them(isa, dtype, where):
    """A NaN K or V (its cache code) spoils the heads that read it, as in float attention; not the others."""
    query, kq, vq, ks, vs = make_case(2, 4, 2, 40, 64, dtype, False, seed=7)
    clean = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, None, 0.125)
    nan_code = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.float8_e4m3fnuz: 0x80}[dtype]
    for code in {nan_code, nan_code | 0x80}:  # both signs (e4m3fnuz has one NaN code)
        cache = (kq if where == "key" else vq).clone()
        cache.view(torch.uint8)[1, 0, 17, 5 if where == "key" else 3] = code  # sequence 1, KV head 0, channel 3/5
        k, v = (cache, vq) if where == "key" else (kq, cache)
        out = torch.ops.qfp8.fp8_decode_attention(query, k, v, ks, vs, None, 0.125)
        want = float64_attention(query, k, v, ks, vs, None, 0.125)
        assert torch.equal(torch.isnan(out), torch.isnan(want)), code
        assert torch.isnan(out).any() and torch.equal(out[0], clean[0]) and torch.equal(out[1, 2:], clean[1, 2:])


def test_same_result_on_any_thread_count():
    query, kq, vq, ks, vs = make_case(2, 8, 4, 300, 64, torch.float8_e4m3fn, True, seed=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, None, 0.125)
        torch.set_num_threads(2)
        two = torch.ops.qfp8.fp8_decode_attention(query, kq, vq, ks, vs, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_opcheck():
    query, kq, vq, ks, vs = make_case(1, 4, 2, 24, 64, torch.float8_e4m3fn, True, seed=7)
    mask = torch.ones(1, 1, 1, 24, dtype=torch.bool)
    opcheck(torch.ops.qfp8.fp8_decode_attention.default, (query, kq, vq, ks, vs, mask, 0.125))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "query": a["query"][:, :, :, :32]}, ValueError, r"query \[1, 4, 1, 32\] does not fit"),
        (lambda a: {**a, "query": a["query"].expand(1, 4, 2, 64)}, ValueError, r"query must be \[B, Hq, 1, D\]"),
        (lambda a: {**a, "value_cache": a["value_cache"][:, :, :8]}, ValueError, r"alike, got \[1, 2, 16, 64\]"),
        (lambda a: {**a, "key_cache": a["key_cache"].float()}, TypeError, "one FP8 dtype"),
        (lambda a: {**a, "key_scale": torch.ones(3)}, ValueError, r"key_scale must have 1 or B \* Hkv = 2"),
        (lambda a: {**a, "mask": torch.ones(1, 1, 1, 15, dtype=torch.bool)}, ValueError, r"got \[1, 1, 1, 15\]"),
    ],
)
def test_bad_arguments(change, error, match):
    query, kq, vq, ks, vs = make_case(1, 4, 2, 16, 64, torch.float8_e4m3fn, False)
    args = dict(query=query, key_cache=kq, value_cache=vq, key_scale=ks, value_scale=vs, mask=None)
    with pytest.raises(error, match=match):
        attention.fp8_decode_attention(**change(args))
