"""FP8 formats, scales and the reference quantize / dequantize.

Every other module takes its numerics from here (docs/design.md, "Numerics"):

- a scale multiplies on dequantization: ``x ~= q.float() * scale``;
- ``scale = max(amax, EPS) / fmax`` in float32, so an all-zero row gets
  zeros back, never NaN;
- quantization saturates: ``q = clamp(x / scale, -fmax, fmax).to(fp8)``.

Granularities
-------------
Weights ``[N, K]``: ``"tensor"`` (scale ``[1]``), ``"channel"`` (``[N, 1]``),
``"block"`` (``[ceil(N/bn), ceil(K/bk)]``, partial tail blocks).
Activations ``[..., K]`` (flattened to ``[M, K]``): ``"tensor"`` (``[1]``),
``"token"`` (``[M, 1]``), ``"group"`` (``[M, ceil(K/128)]``, 1x128 groups),
``"token-mse"`` (``[M, 1]``; each row's scale is the candidate
``amax / fmax * 2^(j/16)``, ``j = 0..15``, with the least squared rounding
error of that row: an accuracy option of qfp8's own kernels, see
:func:`token_mse_scale`).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ACTIVATION_GRANULARITIES",
    "ACTIVATION_GROUP_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "EPS",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "TOKEN_MSE_FACTORS",
    "WEIGHT_CHUNK_ELEMENTS",
    "WEIGHT_GRANULARITIES",
    "abs_max",
    "activation_amax",
    "activation_dtype_for",
    "block_scale_shape",
    "dequantize_activation",
    "dequantize_table",
    "dequantize_weight",
    "expand_block_scale",
    "expand_group_scale",
    "first_nonfinite",
    "fitted_block_size",
    "fp8_dtype",
    "fp8_max",
    "fp8_to_float",
    "nonfinite_count",
    "quantize_activation",
    "quantize_weight",
    "quantize_with_scale",
    "scale_from_amax",
    "scale_problem",
    "smallest_scale",
    "sqnr",
    "token_mse_scale",
    "weight_amax",
    "weight_scale_shape",
]

EPS = 1e-12
DEFAULT_BLOCK_SIZE = (128, 128)
ACTIVATION_GROUP_SIZE = 128

FP8_DTYPES = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}
WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_GRANULARITIES = ("tensor", "token", "group", "token-mse")
# "token-mse" candidates: amax / fmax times these float32 factors, 2^(j/16).
# None is below 1, so no candidate clips the row's largest value.
TOKEN_MSE_FACTORS = tuple(float(torch.tensor(2.0 ** (j / 16), dtype=torch.float32, device="cpu")) for j in range(16))
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_dtype(name: str | torch.dtype) -> torch.dtype:
    """Returns the torch FP8 dtype for ``name`` ("float8_e4m3fn", ... or a dtype)."""
    if isinstance(name, torch.dtype):
        if name in FP8_DTYPES.values():
            return name
        raise TypeError(f"{name} is not an FP8 dtype; expected one of {sorted(FP8_DTYPES)}")
    if not isinstance(name, str) or name not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 dtype {name!r}; expected one of {sorted(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def activation_dtype_for(weight_dtype: torch.dtype) -> torch.dtype:
    """FP8 dtype of the activations that go with ``weight_dtype`` weights.

    Activations are e4m3 (more mantissa, enough range once scaled), in the
    fnuz variant when the weights are fnuz (AMD MI300 hardware takes only fnuz).
    """
    return torch.float8_e4m3fnuz if weight_dtype == torch.float8_e4m3fnuz else torch.float8_e4m3fn


_DEQUANT_TABLES: dict[torch.dtype, torch.Tensor] = {}


def dequantize_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 float32 values of an FP8 dtype, indexed by the code's bits."""
    table = _DEQUANT_TABLES.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device="cpu").view(dtype).to(torch.float32)
        _DEQUANT_TABLES[dtype] = table
    return table


def fp8_to_float(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes to exact float values through a 256-entry lookup table.

    torch's own FP8 cast is an elementwise loop that is slow on CPU eagerly; a
    table lookup keeps the reference path usable on whole models. Under
    ``torch.compile`` / ``torch.export`` the cast itself is used: the cached
    table is a real tensor that a traced graph cannot hold, and the cast is
    exact (the table is made by it, NaN and Inf codes included), while the
    compiled code has no eager loop to avoid.
    """
    if torch.compiler.is_compiling():
        return q.to(torch.float32).to(dtype)
    table = dequantize_table(q.dtype).to(q.device)
    return table[q.view(torch.uint8).long()].to(dtype)


# NaN/Inf codes per FP8 dtype: (mask, code) with ``bits & mask == code``.
_NONFINITE_CODES = {
    torch.float8_e4m3fn: (0x7F, 0x7F),  # NaN (no Inf)
    torch.float8_e5m2: (0x7C, 0x7C),  # all exponent bits: Inf or NaN
    torch.float8_e4m3fnuz: (0xFF, 0x80),  # NaN (the negative zero's code)
}


def _extension_scan(q: torch.Tensor):
    return getattr(torch.ops.qfp8, "_cpu_fp8_first_nonfinite", None) if q.device.type == "cpu" else None


def first_nonfinite(q: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN/Inf code of an FP8 tensor, or None when every code is finite.

    A CPU tensor is scanned by the extension at memory speed (a model's
    weights are checked when a checkpoint loads); other devices, or a build
    without the extension, compare the codes with torch. Meta tensors have no
    codes: None.
    """
    if q.dtype not in _NONFINITE_CODES:
        raise TypeError(f"first_nonfinite takes an FP8 tensor, got {q.dtype}")
    if q.device.type == "meta" or q.numel() == 0:
        return None
    scan = _extension_scan(q)
    if scan is not None:
        flat = scan(q)
    else:
        mask, code = _NONFINITE_CODES[q.dtype]
        hits = ((q.reshape(-1).view(torch.uint8) & mask) == code).nonzero()
        flat = int(hits[0, 0]) if hits.numel() else -1
    if flat < 0:
        return None
    index = []
    for size in reversed(q.shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def smallest_scale(dtype: torch.dtype) -> float:
    """The smallest scale qfp8 makes for ``dtype``: ``1e-12 / fmax`` in float32 (:func:`scale_from_amax`)."""
    return float(scale_from_amax(torch.zeros(()), dtype))


def scale_problem(scale: torch.Tensor, divides: torch.dtype | None = None) -> str | None:
    """What is wrong with a scale's values for the kernels, or None: a scale multiplies on dequantization, so
    NaN/Inf gives NaN outputs and zero or negative wrong ones. Meta tensors have no values: None.

    ``divides``: the FP8 dtype of a scale that values are divided by when quantized (an activation or KV-cache
    scale). Such a scale below :func:`smallest_scale` is refused too: ``x / scale`` overflows float32 for
    ordinary ``x`` (every ``|x|`` above 0.034 at 1e-40), and an overflowed quotient is NaN."""
    if scale.device.type == "meta":
        return None
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bad.any():
        return (
            f"{int(bad.sum())} of {scale.numel()} value(s) that are NaN/Inf, zero or negative (first: "
            f"{scale[bad][0].item()}); scales must be finite and > 0"
        )
    if divides is None:
        return None
    floor = smallest_scale(divides)
    small = scale.to(torch.float32) < floor
    if not small.any():
        return None
    first = scale[small][0].item()
    return (
        f"{int(small.sum())} of {scale.numel()} value(s) below {floor:.4g}, the smallest scale qfp8 makes for "
        f"{divides} ({EPS:g} / {fp8_max(divides):g}) (first: {first:.4g}); values are divided by it when "
        f"quantized, and every |x| above {first * torch.finfo(torch.float32).max:.3g} would quantize to NaN"
    )


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (amax.to(torch.float32).clamp(min=EPS) / fp8_max(dtype)).to(torch.float32)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: ``clamp(x / scale, -fmax, fmax).to(dtype)``; scale broadcasts."""
    fmax = fp8_max(dtype)
    return (x.to(torch.float32) / scale).clamp(-fmax, fmax).to(dtype)


# ---------------------------------------------------------------- weights


def block_scale_shape(shape: tuple[int, int], block_size: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    bn, bk = block_size
    return (math.ceil(n / bn), math.ceil(k / bk))


def weight_scale_shape(shape: tuple[int, int], granularity: str, block_size=None) -> tuple[int, ...]:
    """The weight scale's shape for an ``[N, K]`` weight: ``[1]``, ``[N, 1]`` or the block grid."""
    if granularity == "tensor":
        return (1,)
    if granularity == "channel":
        return (shape[0], 1)
    return block_scale_shape(shape, block_size)


def _check_block_size(block_size) -> tuple[int, int]:
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)
    ):
        raise ValueError(f"block_size must be two positive ints (bn, bk), got {block_size!r}")
    return (int(block_size[0]), int(block_size[1]))


def fitted_block_size(shape: tuple[int, int], block_size) -> tuple[int, int]:
    """``block_size`` with each side at most the weight's (at least 1): the same block grid, so padding to it
    never allocates more than about twice the weight (a block_size of 10^6 had padded a 64 x 128 weight to
    10^12 elements)."""
    n, k = shape
    bn, bk = block_size
    return (max(1, min(int(bn), n)), max(1, min(int(bk), k)))


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block_size) -> torch.Tensor:
    """A ``[ceil(N/bn), ceil(K/bk)]`` block scale broadcast to ``[N, K]``."""
    n, k = shape
    bn, bk = fitted_block_size(shape, block_size)
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


# A weight larger than this many elements is scaled and quantized a band of rows at a time: float32
# temporaries of a whole weight would be 4-6x its bf16 bytes (4 GB for a Llama-3 lm_head). Bitwise the same result.
WEIGHT_CHUNK_ELEMENTS = 1 << 22


def row_bands(rows: int, band_rows: int, align: int = 1) -> list[tuple[int, int]]:
    """Ranges ``[start, stop)`` covering ``rows`` rows in bands of ``band_rows`` rounded down to a multiple of
    ``align`` (a block scale's rows: a band never splits a block), at least ``align``."""
    step = max(align, band_rows // align * align)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _row_bands(weight: torch.Tensor, align: int = 1) -> list[tuple[int, int]] | None:
    """:func:`row_bands` of about ``WEIGHT_CHUNK_ELEMENTS`` elements each, or None when the ``[N, K]`` weight is
    small enough to take whole."""
    n, k = weight.shape
    if weight.numel() <= WEIGHT_CHUNK_ELEMENTS:
        return None
    return row_bands(n, WEIGHT_CHUNK_ELEMENTS // max(k, 1), align)


def _bands_of(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` (any shape; rows along its last dimension) as bands of about ``WEIGHT_CHUNK_ELEMENTS`` elements,
    for reductions."""
    if weight.numel() == 0:
        return []
    flat = weight.detach().reshape(-1, weight.shape[-1]) if weight.dim() >= 2 else weight.detach().reshape(1, -1)
    bands = _row_bands(flat)
    return [flat] if bands is None else [flat[start:stop] for start, stop in bands]


def nonfinite_count(weight: torch.Tensor) -> int:
    """How many values of ``weight`` are NaN or Inf (a band at a time: no full-size temporaries)."""
    return sum(int((~torch.isfinite(band)).sum()) for band in _bands_of(weight))


def abs_max(weight: torch.Tensor) -> torch.Tensor:
    """``weight.abs().amax()`` in ``weight``'s dtype, a band at a time (0-dim; NaN if any value is NaN)."""
    return torch.stack([band.abs().amax() for band in _bands_of(weight)]).amax()


def weight_amax(weight: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Per-granularity amax of a ``[N, K]`` float weight, in float32."""
    if granularity in WEIGHT_GRANULARITIES and weight.dim() == 2:
        align = _check_block_size(block_size)[0] if granularity == "block" else 1
        bands = _row_bands(weight, align)
        if bands is not None:
            parts = [_weight_amax(weight[start:stop], granularity, block_size) for start, stop in bands]
            return torch.stack(parts).amax(dim=0) if granularity == "tensor" else torch.cat(parts)
    return _weight_amax(weight, granularity, block_size)


def _weight_amax(weight: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    w = weight.detach().abs().to(torch.float32)
    if granularity == "tensor":
        return w.amax().reshape(1)
    if granularity == "channel":
        return w.amax(dim=1, keepdim=True)
    if granularity == "block":
        n, k = w.shape
        bn, bk = fitted_block_size((n, k), _check_block_size(block_size))
        nb, kb = block_scale_shape((n, k), (bn, bk))
        padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
        padded[:n, :k] = w
        return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))
    raise ValueError(f"unknown weight scale granularity {granularity!r}; expected one of {WEIGHT_GRANULARITIES}")


def quantize_weight(
    weight: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "channel",
    block_size=DEFAULT_BLOCK_SIZE,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float ``[N, K]`` weight; returns ``(q [N, K] fp8, scale float32)``.

    ``scale`` may be given (for example by the accuracy mode); otherwise it is
    ``amax / fmax`` at the chosen granularity.
    """
    if weight.dim() != 2:
        raise ValueError(f"a weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if scale is None:
        scale = scale_from_amax(weight_amax(weight, granularity, block_size), dtype)
    block = _check_block_size(block_size) if granularity == "block" else None
    bands = _row_bands(weight, block[0] if block else 1)
    if bands is None:
        full_scale = expand_block_scale(scale, tuple(weight.shape), block) if block else scale
        return quantize_with_scale(weight, full_scale, dtype), scale.to(torch.float32)
    q = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for start, stop in bands:
        if block:
            part = scale[start // block[0] : -(-stop // block[0])]
            part = expand_block_scale(part, (stop - start, weight.shape[1]), block)
        else:
            part = scale if scale.numel() == 1 else scale[start:stop]
        q[start:stop] = quantize_with_scale(weight[start:stop], part, dtype)
    return q, scale.to(torch.float32)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, block_size=None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale`` for any weight granularity (block when ``block_size`` is set)."""
    values = fp8_to_float(q)
    if scale.numel() == 1:
        out = values * scale.reshape(())
    elif block_size:
        out = values * expand_block_scale(scale, tuple(q.shape), block_size)
    else:
        out = values * scale.reshape(-1, 1)
    return out.to(dtype)


# ------------------------------------------------------------ activations


def activation_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """amax over the finite values of an ``[M, K]`` activation.

    ``[1]`` (tensor), ``[M, 1]`` (token), ``[M, G]`` (group). Non-finite values
    are left out so that one Inf cannot zero every other value of its scale
    group; they are turned into NaN by :func:`quantize_activation` instead.
    """
    a = x.detach().abs().to(torch.float32)
    a = torch.where(torch.isfinite(a), a, 0.0)
    if granularity == "tensor":
        return a.amax().reshape(1) if a.numel() else torch.zeros(1, device=a.device)
    if granularity in ("token", "token-mse"):
        return a.amax(dim=-1, keepdim=True)
    if granularity == "group":
        m, k = a.shape
        groups = math.ceil(k / ACTIVATION_GROUP_SIZE)
        padded = torch.zeros(m, groups * ACTIVATION_GROUP_SIZE, dtype=torch.float32, device=a.device)
        padded[:, :k] = a
        return padded.view(m, groups, ACTIVATION_GROUP_SIZE).amax(dim=-1)
    raise ValueError(
        f"unknown activation scale granularity {granularity!r}; expected one of {ACTIVATION_GRANULARITIES}"
    )


def expand_group_scale(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(ACTIVATION_GROUP_SIZE, dim=-1)[..., :k]


def token_mse_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``"token-mse"`` scale ``[M, 1]`` of an ``[M, K]`` activation.

    Among ``s = amax / fmax * f`` for ``f`` in :data:`TOKEN_MSE_FACTORS`
    (float32 products), each row takes the candidate whose rounding error
    ``s^2 * sum((round(u) - u)^2)``, ``u = clamp(x * (1 / s))``, over its
    finite values is least (float32 terms, float64 sum; the first candidate
    on a tie, so a row that every candidate represents exactly keeps
    ``amax / fmax``). The search multiplies by the float32 reciprocal, which
    is cheaper than the division the quantization itself does and differs
    from it only where a value lies within an ulp of a rounding boundary.
    FP8's error sits in each token's few largest values; moving them within
    their binades by a factor below 2 changes it by up to 2x, while the
    candidates never clip.
    docs/accuracy.md gives its effect on SmolLM2. vLLM computes ``amax / fmax``: the option holds in
    qfp8's own kernels, the checkpoint stays a plain per-token one.
    """
    x32 = x.to(torch.float32)
    finite = torch.isfinite(x32)
    x32 = torch.where(finite, x32, 0.0)
    base = scale_from_amax(activation_amax(x32, "token"), dtype)
    fmax = fp8_max(dtype)
    best_scale, best_error = base, None
    for factor in TOKEN_MSE_FACTORS:
        candidate = base * factor
        scaled = (x32 * (1.0 / candidate)).clamp(-fmax, fmax)
        error = (fp8_to_float(scaled.to(dtype)) - scaled).to(torch.float64).square().sum(dim=-1, keepdim=True)
        error = error * candidate.to(torch.float64).square()
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best_scale = torch.where(better, candidate, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_scale


def quantize_activation(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "token",
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes an ``[M, K]`` activation; returns ``(q, scale)``.

    A given ``scale`` (static, calibrated) is a per-tensor ``[1]`` scale.
    A non-finite input value becomes NaN, so it spoils exactly the outputs of
    its own token row, as it would in a bf16 matmul; other rows are untouched.
    """
    if x.dim() != 2:
        raise ValueError(f"activations are quantized as [M, K], got shape {tuple(x.shape)}")
    if scale is None and granularity == "token-mse":
        scale = full_scale = token_mse_scale(x, dtype)
    elif scale is None:
        scale = scale_from_amax(activation_amax(x, granularity), dtype)
        full_scale = expand_group_scale(scale, x.shape[1]) if granularity == "group" else scale
    else:
        full_scale = scale.to(torch.float32).reshape(1)
        scale = full_scale
    fmax = fp8_max(dtype)
    scaled = x.to(torch.float32) / full_scale
    scaled = torch.where(torch.isfinite(scaled), scaled.clamp(-fmax, fmax), float("nan"))
    return scaled.to(dtype), scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale`` for tensor ``[1]``, token ``[M, 1]`` or group ``[M, G]`` scales."""
    values = fp8_to_float(q)
    if scale.dim() == 2 and scale.shape[-1] > 1:
        scale = expand_group_scale(scale, q.shape[-1])
    return (values * scale).to(dtype)


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(|x| / |x - y|)``."""
    ref = reference.detach().to(torch.float64)
    err = ref - approximation.detach().to(torch.float64)
    noise = err.norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))
