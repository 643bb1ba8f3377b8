"""FP8 KV-cache numerics: per-head scales, quantization and dequantization of K/V, the settings of the
dynamic scales and the static scale search, and the compensated key rounding of one attention module."""

from __future__ import annotations

import torch
from torch import nn

from qfp8 import formats, rounding
from qfp8.library import attention as attention_ops

__all__ = [
    "DYNAMIC_HEADROOM",
    "GROWTH_CHECK_TOKENS",
    "KV_CACHE_DTYPES",
    "KV_ROUNDING_BUFFERS",
    "KV_ROUNDING_DAMPING",
    "SCALE_SEARCH_ROWS",
    "SCALE_SEARCH_STEPS",
    "dequantize_kv",
    "per_head_scale",
    "quantize_kv",
    "set_k_rounding",
]

KV_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DYNAMIC_HEADROOM = 2.0
# One-token steps check whether a dynamic scale still fits while the cache holds fewer tokens than this (a
# scale taken from a short first update, a lone BOS token for one, may be far too small); updates of several
# tokens always do. Each check costs a few small ops per layer, so decoding past this skips it.
GROWTH_CHECK_TOKENS = 16
# Static scale search: candidate factors 1 + j/16 on amax / fmax, judged on at
# most this many K (V) rows per layer kept from calibration (every row until
# the cap, then every second, fourth, ... row: spread over all batches).
SCALE_SEARCH_STEPS = 16
SCALE_SEARCH_ROWS = 4096
# Compensated key rounding: the query second moment gets this fraction of its mean diagonal added (GPTQ's
# damping), which keeps the factorization stable when some directions are never seen.
KV_ROUNDING_DAMPING = 0.01
KV_ROUNDING_BUFFERS = ("k_rounding_hessian", "k_rounding_factor", "k_rounding_order")


def set_k_rounding(attention: nn.Module, hessian: torch.Tensor | None) -> None:
    """Gives ``attention`` compensated key rounding for the query second moment ``hessian`` ``[H_kv, D, D]``
    (None: round to nearest). Checks it: a floating ``[H_kv, D, D]`` tensor, finite, symmetric, positive
    semidefinite (what a second moment is); ``ValueError`` otherwise."""
    if hessian is None:
        for name in KV_ROUNDING_BUFFERS:
            setattr(attention, name, None)
        return
    if not hessian.is_floating_point() or hessian.dtype in KV_CACHE_DTYPES:
        raise ValueError(f"k_rounding_hessian must be float32 (or another float dtype), got {hessian.dtype}")
    if hessian.dim() != 3 or hessian.shape[-1] != hessian.shape[-2]:
        raise ValueError(f"k_rounding_hessian must be [H_kv, D, D], got {list(hessian.shape)}")
    h = hessian.detach().to(torch.float32)
    if not bool(torch.isfinite(h).all()) or bool((torch.diagonal(h, dim1=-2, dim2=-1) < 0).any()):
        raise ValueError("k_rounding_hessian holds non-finite values or a negative diagonal")
    asymmetry = float((h - h.transpose(-1, -2)).abs().max())
    if asymmetry > 1e-4 * float(h.abs().max()):
        raise ValueError(f"k_rounding_hessian is not symmetric (entries differ from their mirror by {asymmetry:.3g})")
    try:
        factor, order = rounding.gptq_factors(h, KV_ROUNDING_DAMPING)
    except torch.linalg.LinAlgError:
        raise ValueError("k_rounding_hessian is not positive semidefinite (not a second moment)") from None
    attention_ops.compensated_cpu_kernel()  # known before any compiled step reads it
    with torch.inference_mode(False):  # normal tensors even when calibrating under inference mode
        attention.k_rounding_hessian = h.clone()
        attention.k_rounding_factor = factor.contiguous().clone()  # contiguous: the kernel would copy it per call
        attention.k_rounding_order = order.clone()


def _real_queries(mask: torch.Tensor | None, batch: int, tokens: int) -> torch.Tensor | None:
    """``[B, T]`` bool: query ``t`` may attend to its own key position (the mask's last ``T`` columns are the
    queries' own positions); None when there is no usable 4-D mask (every query counts)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != tokens or mask.shape[-1] < tokens:
        return None
    own = torch.diagonal(mask[:, 0, :, mask.shape[-1] - tokens :], dim1=-2, dim2=-1)  # [B or 1, T]
    allowed = own if own.dtype == torch.bool else own > attention_ops.MASKED_BELOW
    return allowed.expand(batch, tokens)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().abs().to(torch.float32)
    return torch.where(torch.isfinite(a), a, 0.0)


def per_head_scale(x: torch.Tensor, dtype: torch.dtype, headroom: float = DYNAMIC_HEADROOM) -> torch.Tensor:
    """Dynamic scale of a ``[B, H, S, D]`` state: ``headroom * amax / fmax`` per (batch row, head), ``[B, H, 1, 1]``."""
    amax = _finite_abs(x).amax(dim=(-2, -1), keepdim=True)
    return formats.scale_from_amax(amax * headroom, dtype)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating FP8 cast of a ``[B, H, S, D]`` state; ``scale`` is ``[1]`` or ``[B, H, 1, 1]``."""
    return formats.quantize_with_scale(x, scale, dtype)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q.float() * scale`` rounded once to ``dtype``."""
    return (q.to(torch.float32) * scale).to(dtype)
