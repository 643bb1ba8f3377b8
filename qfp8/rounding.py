"""Accuracy mode: FP8 weights chosen to minimise a layer's output error, not its weight error.

The result is the same on-disk format as plain quantization (FP8 ``[N, K]``
plus tensor / channel / block scales, which vLLM loads); only the values differ.

Why it pays: FP8 error is relative, so a weight's rounding error depends on
where its values fall inside their binade, and that is set by the scale. The
usual ``scale = amax / fmax`` is one arbitrary choice among all the scales
``amax / fmax * c`` with ``c`` in ``[1, 2)`` (beyond 2 the pattern repeats one
binade lower). Weights converted from a 4-bit GGUF sit on a coarse grid
(``d * q + m`` per 32 values), so the choice of ``c`` decides how many of
their values land on, or far from, FP8 points. No per-channel scale makes a
Q4_1 row exact (each block's offset ``m / d`` is an arbitrary fraction, and a
row has 18 blocks), and a finer search than 16 candidates gains little. And rounding each weight to its nearest FP8 value
ignores that the errors of one output row add up through the correlated inputs.

Given ``H = sum_x x^T x`` over calibration inputs (``[K, K]``), the output error
of a row ``n`` with weight error ``e_n`` is ``e_n H e_n^T``. Two steps:

``"scale"``: for each scale group (tensor, row, or block) pick ``c`` from
:data:`SCALE_CANDIDATES` minimising ``sum_k e_k^2 H_kk`` (the diagonal of H,
cheap enough to try every candidate on every group).

``"gptq"``: the scales of ``"scale"``, then rounding in the spirit of GPTQ
(Frantar et al., 2022) on the FP8 grid: columns are rounded one at a time, in
decreasing order of ``H_kk``, each rounding error being spread over the
columns still to be rounded through the Cholesky factor of ``H^-1``, so that
the errors cancel in the output instead of adding up.

``"gptq"`` fits each layer to its calibration inputs, so it wants several
thousand calibration tokens. The weight SQNR goes *down* with ``"gptq"``: the
error moves to where the inputs are weak. docs/accuracy.md has the
measurements, and the variants tried and not adopted.
"""

from __future__ import annotations

import contextlib

import torch

from qfp8 import formats

__all__ = [
    "ACCURACY_MODES",
    "GPTQ_BLOCK",
    "GPTQ_DAMPING",
    "SCALE_CANDIDATES",
    "check_mode",
    "gptq_factors",
    "gptq_round",
    "quantize_weight",
    "search_scale",
]

ACCURACY_MODES = (None, "scale", "gptq")
# c in [1, 2): 16 evenly spaced multipliers of amax / fmax (32 gained little, at twice the time).
SCALE_CANDIDATES = tuple(1.0 + i / 16 for i in range(16))
GPTQ_DAMPING = 0.01  # fraction of mean(diag H) added to the diagonal (keeps H invertible)
GPTQ_BLOCK = 128  # columns updated together (lazy batch updates)


def check_mode(mode) -> None:
    if mode not in ACCURACY_MODES:
        raise ValueError(f"unknown accuracy mode {mode!r}; expected one of {list(ACCURACY_MODES)}")


def _round_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (already divided by its scale) rounded to the nearest FP8 value, saturating, as float32."""
    fmax = formats.fp8_max(dtype)
    return x.clamp(-fmax, fmax).to(dtype).to(torch.float32)


def _full_scale(scale: torch.Tensor, shape, granularity: str, block_size) -> torch.Tensor:
    if granularity == "block":
        return formats.expand_block_scale(scale, tuple(shape), block_size)
    return scale.expand(shape) if scale.numel() > 1 else scale.reshape(1, 1).expand(shape)


def _group_sum(values: torch.Tensor, granularity: str, block_size) -> torch.Tensor:
    """Sums an ``[N, K]`` tensor over each scale group: ``[1]``, ``[N, 1]`` or block-shaped."""
    if granularity == "tensor":
        return values.sum().reshape(1)
    if granularity == "channel":
        return values.sum(dim=1, keepdim=True)
    n, k = values.shape
    bn, bk = formats.fitted_block_size((n, k), block_size)
    nb, kb = formats.block_scale_shape((n, k), (bn, bk))
    padded = values.new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = values
    return padded.view(nb, bn, kb, bk).sum(dim=(1, 3))


def search_scale(
    weight: torch.Tensor,
    column_weight: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size=None,
) -> torch.Tensor:
    """The scale of each group, among ``amax / fmax * c``, minimising ``sum_k e_k^2 w_k``.

    ``column_weight``: ``[K]`` non-negative importance of each input column
    (``diag(H)``; all ones gives the plain weight error).
    """
    w = weight.detach().to(torch.float32)
    base = formats.scale_from_amax(formats.weight_amax(w, granularity, block_size), dtype)
    importance = column_weight.to(torch.float32).reshape(1, -1)
    best_scale = base.clone()
    best_error = torch.full_like(base, float("inf"))
    for c in SCALE_CANDIDATES:
        scale = base * c
        full = _full_scale(scale, w.shape, granularity, block_size)
        error = (w - _round_fp8(w / full, dtype) * full).square() * importance
        group_error = _group_sum(error, granularity, block_size)
        better = group_error < best_error
        best_error = torch.where(better, group_error, best_error)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale


def gptq_factors(hessian: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(factor, order)`` of GPTQ's rounding for channel weightings ``hessian`` ``[..., K, K]``.

    ``order``: the channels by decreasing weight (the heaviest are rounded
    first, with the most channels left to take their error); ``factor``: the
    upper Cholesky factor of ``(H + damping * mean(diag H) * I)^-1`` in that
    order, float32. A channel of weight 0 gets weight 1 (never active: its
    rounding cannot matter). Used by :func:`gptq_round` (one weight's ``[K, K]``)
    and the FP8 KV cache's compensated key rounding (``[H_kv, D, D]``).
    """
    h = hessian.detach().to(torch.float64).clone()
    diagonal = torch.diagonal(h, dim1=-2, dim2=-1)
    diagonal.copy_(torch.where(diagonal == 0, 1.0, diagonal))
    order = torch.argsort(diagonal, dim=-1, descending=True)
    k = h.shape[-1]
    h = h.gather(-2, order[..., :, None].expand(h.shape)).gather(-1, order[..., None, :].expand(h.shape))
    h = h + damping * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(k, dtype=h.dtype)
    factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    return factor, order


def gptq_round(
    weight: torch.Tensor, hessian: torch.Tensor, full_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Error-compensating rounding of ``weight`` to ``full_scale * FP8`` values; returns the FP8 codes ``[N, K]``."""
    w = weight.detach().to(torch.float32).clone()
    hinv, order = gptq_factors(hessian, GPTQ_DAMPING)
    w = w[:, order]
    scale = full_scale.to(torch.float32)[:, order].contiguous()

    with _one_thread():
        codes = _gptq_columns(w, scale, hinv, dtype)
    inverse = torch.argsort(order)
    fmax = formats.fp8_max(dtype)
    return codes[:, inverse].clamp(-fmax, fmax).to(dtype)


@contextlib.contextmanager
def _one_thread():
    # The column loop runs thousands of small ops: with more threads their
    # start-up costs more than the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gptq_columns(w: torch.Tensor, scale: torch.Tensor, hinv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = w.shape[1]
    # Rows of the transposed weight are the columns being rounded: contiguous.
    wt = w.t().contiguous()
    st = scale.t().contiguous()
    codes = torch.empty_like(wt)
    for start in range(0, k, GPTQ_BLOCK):
        end = min(start + GPTQ_BLOCK, k)
        block = wt[start:end].clone()
        errors = torch.empty_like(block)
        hblock = hinv[start:end, start:end]
        for i in range(end - start):
            q = _round_fp8(block[i] / st[start + i], dtype)
            codes[start + i] = q
            error = (block[i] - q * st[start + i]).div_(hblock[i, i])
            block[i:].addr_(hblock[i, i:], error, alpha=-1.0)
            errors[i] = error
        wt[end:].addmm_(hinv[start:end, end:].t(), errors, alpha=-1.0)
    return codes.t()


def quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    mode: str,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "channel",
    block_size=formats.DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``[N, K]`` ``weight`` for inputs with ``hessian = sum x^T x`` (``[K, K]``); returns ``(q, scale)``.

    ``mode``: ``"scale"`` (output-aware scale search, nearest rounding) or
    ``"gptq"`` (that scale, then error-compensating rounding). ``"scale"``
    reads only the diagonal, which may be given alone (``[K]``).
    """
    check_mode(mode)
    if weight.dim() != 2:
        raise ValueError(f"a weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    diagonal_only = mode == "scale" and tuple(hessian.shape) == (k,)
    if tuple(hessian.shape) != (k, k) and not diagonal_only:
        wanted = f"[{k}, {k}]" + (f" or its diagonal [{k}]" if mode == "scale" else "")
        raise ValueError(f"hessian must be {wanted} for a weight {list(weight.shape)}, got {list(hessian.shape)}")
    if mode is None:
        return formats.quantize_weight(weight, dtype, granularity, block_size)
    block = formats._check_block_size(block_size) if granularity == "block" else None
    diagonal = hessian if diagonal_only else torch.diag(hessian)
    scale = search_scale(weight, diagonal.clamp(min=0), dtype, granularity, block)
    if mode == "scale":
        return formats.quantize_weight(weight, dtype, granularity, block, scale=scale)
    full = _full_scale(scale, weight.shape, granularity, block)
    return gptq_round(weight, hessian, full, dtype), scale
