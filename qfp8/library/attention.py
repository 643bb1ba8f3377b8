"""FP8 KV-cache decode attention: ``torch.ops.qfp8.fp8_decode_attention``.

``fp8_decode_attention(query, key_cache, value_cache, key_scale, value_scale,
mask, scaling)``: one query token per sequence (``query`` ``[B, Hq, 1, D]``)
against FP8 caches ``[B, Hkv, S, D]`` (grouped-query: ``Hq`` a multiple of
``Hkv``) holding ``k / key_scale`` and ``v / value_scale``, each scale float32
``[1]`` (per tensor) or ``B * Hkv`` values (per head, ``[B, Hkv, 1, 1]``);
``mask`` broadcastable to ``[B, 1, 1, S]``, bool (True attends) or additive
float, or None. Returns ``softmax(q k^T * scaling + mask) v`` as
``[B, Hq, 1, D]`` in the query's dtype, float32 inside.

The CPU kernel (``qfp8/ext/cpu``) reads each FP8 row once, converts it in
registers and never reads a masked position: a static cache costs what its
filled part costs, and no float copy of the cache is made. Elsewhere (and
when the extension is missing) the reference below runs: dequantize through
the lookup table, then the same arithmetic in float32. A sequence whose every
position is masked, or an empty cache, gets zeros (SDPA would give NaN).

``fp8_compensated_quantize(states, scale, factor, order, dtype)``: the FP8
KV cache's compensated key rounding (GPTQ's rounding applied to each key
row; :func:`fp8_compensated_quantize_reference` says what it computes), a
C++ kernel on CPU, bit-identical to that reference.
"""

from __future__ import annotations

import torch

from qfp8 import formats

__all__ = [
    "MASKED_BELOW",
    "check_decode_attention_args",
    "compensated_cpu_kernel",
    "fp8_compensated_quantize",
    "fp8_compensated_quantize_reference",
    "fp8_decode_attention",
    "fp8_decode_attention_reference",
]

torch.library.define(
    "qfp8::fp8_decode_attention",
    "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor key_scale, Tensor value_scale, Tensor? mask, "
    "float scaling) -> Tensor",
)

MASKED_BELOW = -1e30  # additive mask values at or below this mean "masked" (transformers uses finfo.min)


@torch.library.register_fake("qfp8::fp8_decode_attention")
def _(query, key_cache, value_cache, key_scale, value_scale, mask, scaling):
    return query.new_empty(query.shape)


def _additive_mask(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    mask = mask.to(torch.float32).expand(batch, 1, 1, length).reshape(batch, length)
    return torch.where(mask <= MASKED_BELOW, float("-inf"), mask)


def fp8_decode_attention_reference(query, key_cache, value_cache, key_scale, value_scale, mask, scaling):
    batch, heads, _, dim = query.shape
    kv_heads, length = key_cache.shape[1], key_cache.shape[2]
    if length == 0:  # an empty cache: nothing to attend to, zeros (as for a fully masked sequence)
        return query.new_zeros(query.shape)
    group = heads // kv_heads

    def scale_shape(scale):
        return (batch, kv_heads, 1, 1) if scale.numel() != 1 else (1, 1, 1, 1)

    keys = formats.fp8_to_float(key_cache) * key_scale.to(torch.float32).reshape(scale_shape(key_scale))
    values = formats.fp8_to_float(value_cache) * value_scale.to(torch.float32).reshape(scale_shape(value_scale))
    q = query.to(torch.float32).reshape(batch, kv_heads, group, dim) * scaling
    scores = q @ keys.transpose(-1, -2)  # [B, Hkv, G, S]
    additive = _additive_mask(mask, batch, length)
    if additive is not None:
        scores = scores + additive[:, None, None, :]
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isinf(top), 0.0, top))
    total = weights.sum(-1, keepdim=True)
    out = (weights @ values) / torch.where(total > 0, total, 1.0)
    return out.reshape(batch, heads, 1, dim).to(query.dtype)


# Every device but CPU (and CPU when the extension is missing) runs the reference.
torch.library.impl("qfp8::fp8_decode_attention", "CompositeExplicitAutograd")(fp8_decode_attention_reference)


def check_decode_attention_args(query, key_cache, value_cache, key_scale, value_scale, mask) -> None:
    """Full validation (``ValueError`` naming the sizes); the op itself only guards against bad memory access."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"fp8_decode_attention: query must be [B, Hq, 1, D], got {list(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"fp8_decode_attention: key and value caches must be [B, Hkv, S, D] alike, got "
            f"{list(key_cache.shape)} and {list(value_cache.shape)}"
        )
    if key_cache.dtype not in formats.FP8_DTYPES.values() or value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"fp8_decode_attention: caches must share one FP8 dtype, got {key_cache.dtype} and {value_cache.dtype}"
        )
    batch, heads, _, dim = query.shape
    if key_cache.shape[0] != batch or key_cache.shape[3] != dim or heads % key_cache.shape[1]:
        raise ValueError(
            f"fp8_decode_attention: query {list(query.shape)} does not fit caches {list(key_cache.shape)} "
            "(same B and D, Hq a multiple of Hkv)"
        )
    per_head = batch * key_cache.shape[1]
    for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scale.numel() not in (1, per_head):
            raise ValueError(
                f"fp8_decode_attention: {name} must have 1 or B * Hkv = {per_head} values, got {scale.numel()}"
            )
    if mask is not None and (
        mask.dim() != 4
        or mask.shape[1:3] != (1, 1)
        or mask.shape[3] != key_cache.shape[2]
        or mask.shape[0] not in (1, batch)
    ):
        raise ValueError(
            f"fp8_decode_attention: mask must broadcast to [B, 1, 1, S] = [{batch}, 1, 1, {key_cache.shape[2]}], "
            f"got {list(mask.shape)}"
        )


def fp8_decode_attention(query, key_cache, value_cache, key_scale, value_scale, mask=None, scaling=None):
    """Checked call of ``torch.ops.qfp8.fp8_decode_attention`` (``scaling`` defaults to ``D ** -0.5``)."""
    check_decode_attention_args(query, key_cache, value_cache, key_scale, value_scale, mask)
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return torch.ops.qfp8.fp8_decode_attention(query, key_cache, value_cache, key_scale, value_scale, mask, scaling)


# ------------------------------------------------- compensated K rounding

torch.library.define(
    "qfp8::fp8_compensated_quantize",
    "(Tensor states, Tensor scale, Tensor factor, Tensor order, ScalarType dtype) -> Tensor",
)
torch.library.register_fake("qfp8::fp8_compensated_quantize")(
    lambda states, scale, factor, order, dtype: states.new_empty(states.shape, dtype=dtype)
)


def fp8_compensated_quantize_reference(states, scale, factor, order, dtype):
    """``states`` ``[B, H, T, D]`` to FP8 codes of ``states / scale``, each row rounded with error feedback.

    Channel by channel in ``order[h]`` (``[H, D]``), each value is rounded to
    the nearest FP8 code (saturating) and its rounding error ``e`` is
    subtracted from the channels not yet rounded, ``e * factor[h, t, u] /
    factor[h, t, t]`` for the ``u``-th later one: ``factor`` (``[H, D, D]``,
    upper triangular, in ``order``'s channel order) is the upper Cholesky
    factor of ``H_h^-1`` for a weighting ``H_h`` of the channels, which makes
    this the rounding of GPTQ (Frantar et al., 2022) applied to one row: it
    keeps ``e^T H_h e`` small instead of each ``|e_i|``. The error of a
    saturated value is taken against the saturated value (what lies beyond
    the range is not fed forward), and a non-finite one feeds nothing
    forward. ``scale``: 1 value, or ``B * H`` (per head).
    """
    batch, heads, tokens, dim = states.shape
    x = states.to(torch.float32)
    if tokens == 0:
        return x.to(dtype)
    s = scale.to(torch.float32).reshape((batch, heads, 1) if scale.numel() != 1 else (1, 1, 1))
    fmax = torch.finfo(dtype).max
    limit = s * fmax
    index = order.to(torch.int64)[None, :, None, :].expand(batch, heads, tokens, dim)
    x = x.gather(-1, index).clone()  # channels in rounding order
    factor = factor.to(torch.float32)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for t in range(dim):
        code = (x[..., t] / s).clamp(-fmax, fmax).to(dtype)
        codes[..., t] = code.view(torch.uint8)
        kept = torch.minimum(torch.maximum(x[..., t], -limit), limit)  # the kernel's order (limit < 0 too)
        error = (kept - code.to(torch.float32) * s) / factor[None, :, None, t, t]
        error = torch.where(torch.isfinite(error), error, 0.0)
        if t + 1 < dim:
            x[..., t + 1 :] -= error[..., None] * factor[None, :, None, t, t + 1 :]
    return torch.empty_like(codes).scatter_(-1, index, codes).view(dtype)


torch.library.impl("qfp8::fp8_compensated_quantize", "CompositeExplicitAutograd")(fp8_compensated_quantize_reference)


def _compensated_setup(ctx, inputs, output):
    ctx.states_dtype = inputs[0].dtype


def _compensated_backward(ctx, grad):
    # Straight through, as for round to nearest (``x.to(fp8)``): a model trained or probed for gradients with
    # the FP8 cache still reaches k_proj through the cached keys.
    return grad.to(ctx.states_dtype), None, None, None, None


torch.library.register_autograd(
    "qfp8::fp8_compensated_quantize", _compensated_backward, setup_context=_compensated_setup
)


_COMPENSATED_CPU_KERNEL: bool | None = None


def compensated_cpu_kernel() -> bool:
    """Whether qfp8's extension gives ``fp8_compensated_quantize`` a CPU kernel (cached after the first call).

    The FP8 KV cache uses compensated rounding only then: the reference takes
    ``D`` sequential steps of small tensor ops per call, more than a decode
    step can afford (no GPU kernel exists yet).
    """
    global _COMPENSATED_CPU_KERNEL
    if _COMPENSATED_CPU_KERNEL is None:
        _COMPENSATED_CPU_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key(
            "qfp8::fp8_compensated_quantize", "CPU"
        )
    return _COMPENSATED_CPU_KERNEL


def fp8_compensated_quantize(states, scale, factor, order, dtype):
    """Checked call of ``torch.ops.qfp8.fp8_compensated_quantize`` (``ValueError`` naming the sizes)."""
    if states.dim() != 4:
        raise ValueError(f"fp8_compensated_quantize: states must be [B, H, T, D], got {list(states.shape)}")
    batch, heads, _, dim = states.shape
    if factor.shape != (heads, dim, dim) or order.shape != (heads, dim):
        raise ValueError(
            f"fp8_compensated_quantize: states {list(states.shape)} need factor [{heads}, {dim}, {dim}] and order "
            f"[{heads}, {dim}], got {list(factor.shape)} and {list(order.shape)}"
        )
    if scale.numel() not in (1, batch * heads):
        raise ValueError(
            f"fp8_compensated_quantize: scale must have 1 or B * H = {batch * heads} values, got {scale.numel()}"
        )
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"fp8_compensated_quantize: dtype must be an FP8 dtype (e4m3fn or e5m2), got {dtype}")
    return torch.ops.qfp8.fp8_compensated_quantize(states, scale, factor, order, dtype)
