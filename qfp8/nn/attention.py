"""One-token decode attention with grouped-query heads packed, eager and compiled.

transformers' ``"sdpa"`` attention runs a decode step (one query token) of a
grouped-query model by folding the ``G`` query heads that share a K/V head
into ``G`` query rows of that head (``pack_gqa``), but only in eager mode.
Under ``torch.compile`` it expands K and V to every query head instead
(``repeat_kv``): a copy of the whole cache per layer and step, and ``G``
times the heads for torch's CPU attention kernel: enough to make a compiled
FP8 decode step slower than an eager one (docs/benchmarks.md).

:data:`PACKED_SDPA` is transformers' ``"sdpa"`` with that packing done in
both modes. :func:`qfp8.quantize` (and :func:`qfp8.from_pretrained`) switch
a model whose attention is ``"sdpa"`` to it; everything but one-token
grouped-query steps goes to transformers' function unchanged, and the
packed step computes the same attention (the same query rows against the
same keys, batched differently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PACKED_SDPA",
    "packable",
    "packed_sdpa",
    "register",
    "use_packed_sdpa",
]

try:  # transformers is optional: a model whose attention is "sdpa" comes with it
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:  # pragma: no cover - exercised only without transformers
    sdpa_attention_forward = None

PACKED_SDPA = "qfp8_sdpa"
# Keyword arguments that change what transformers' SDPA computes; a step with any of them is left to it.
_UNPACKED_KWARGS = ("position_bias", "softcap", "s_aux", "output_attentions")


def packable(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """Whether a step can run with its query heads packed: one token, G > 1, a mask shared by every head."""
    groups = _groups(module)
    if query.shape[2] != 1 or groups <= 1:
        return False
    if key.dim() != 4 or query.shape[1] != key.shape[1] * groups:
        return False
    if any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _UNPACKED_KWARGS):
        return False
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)


def packed_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the signature of its ``sdpa_attention_forward``), see the module docstring.

    ``query`` ``[B, Hq, 1, D]`` becomes ``[B, Hkv, G, D]``: the ``G`` heads of a
    group are rows of their K/V head, and the mask ``[B, 1, 1, S]`` broadcasts
    over both. Returns ``[B, 1, Hq, Dv]``, as transformers' function does.
    """
    if not packable(module, query, key, attention_mask, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    rows = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers :data:`PACKED_SDPA` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_sdpa(model: nn.Module) -> bool:
    """Switches ``model`` from transformers' ``"sdpa"`` attention to :data:`PACKED_SDPA`; True when it did.

    Only a decoder with grouped-query attention modules (``num_key_value_groups``
    above 1) is switched: nothing else has heads to pack. Any other attention
    implementation (eager, flex, qfp8's FP8-cache attention, a user's own) is
    left as it is.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "is_encoder_decoder", False):
        return False
    if not any(_groups(module) > 1 for module in model.modules()):
        return False
    register()
    config._attn_implementation = PACKED_SDPA
    return True


def _groups(module: nn.Module) -> int:
    groups = getattr(module, "num_key_value_groups", 1)
    return groups if isinstance(groups, int) else 1
