"""The attention function the FP8 KV cache selects in place of sdpa: decode steps read the FP8 cache
directly through ``torch.ops.qfp8.fp8_decode_attention``."""

from __future__ import annotations

import contextlib

import torch

from qfp8.nn.attention import PACKED_SDPA, packed_sdpa
from qfp8.nn.kv_cache.numerics import KV_CACHE_DTYPES

__all__ = [
    "FUSED_ATTENTION",
    "fused_attention_on",
]

FUSED_ATTENTION = "qfp8_fp8_kv_sdpa"


def _fused_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: decode steps read the FP8 cache directly, everything else is SDPA.

    With one query token, no dropout and a mask that is the same for every
    head, ``torch.ops.qfp8.fp8_decode_attention`` reads the FP8 K/V rows the
    mask lets through, converting them in registers: no float copy of the
    cache. Otherwise (prefill, or a cache that is not FP8) the layer's K/V are
    dequantized and transformers' SDPA function runs, with the query heads of
    a one-token step packed as in :mod:`qfp8.nn.attention`.
    """
    layer = kwargs.pop("qfp8_kv_layer", None)
    if getattr(module, "qfp8_kv_calibrating", False) and getattr(module, "qfp8_kv_compensate", False):
        module._record_queries(query)
    if layer is not None and key.dtype in KV_CACHE_DTYPES:
        mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
        if query.shape[2] == 1 and not dropout and kwargs.get("softcap") is None and mask_ok:
            k_scale, v_scale = layer._scales()
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            out = torch.ops.qfp8.fp8_decode_attention(query, key, value, k_scale, v_scale, attention_mask, scale)
            return out.transpose(1, 2).contiguous(), None
        key, value = layer.dequantized(key, value)
    return packed_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _select_fused_attention(config) -> str | None:
    """Switches ``config`` from sdpa (or :data:`PACKED_SDPA`) to :data:`FUSED_ATTENTION`; returns the
    implementation it replaced, or None when it left another one alone."""
    before = getattr(config, "_attn_implementation", None)
    if before not in ("sdpa", PACKED_SDPA):
        return None
    _register_fused_attention()
    config._attn_implementation = FUSED_ATTENTION
    return before


def _register_fused_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FUSED_ATTENTION, _fused_sdpa)
    AttentionMaskInterface.register(FUSED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def fused_attention_on(config):
    """Within the block, ``config`` (of an sdpa model) selects :data:`FUSED_ATTENTION`, which records the queries
    compensated key rounding needs: for layers calibrated on their own, outside a model that
    :func:`enable_fp8_kv_cache` switched. Other attention implementations are left as they are."""
    before = _select_fused_attention(config)
    if before is None:
        yield
        return
    try:
        yield
    finally:
        config._attn_implementation = before
