"""FP8 KV cache for Llama-family attention in transformers' cache API.

Layout
------
Each cache layer keeps ``keys``/``values`` as FP8 tensors ``[B, H_kv, S, D]``
(exactly half the bytes of bf16) and reads them back as ``q.float() * scale``
in the model's dtype. Scales are float32:

- static: per-tensor ``[1]`` buffers ``k_scale``/``v_scale`` on the attention
  module, set by :func:`qfp8.calibrate` and saved in the state dict as
  ``<attn>.k_scale``/``<attn>.v_scale`` (vLLM/compressed-tensors). Each is
  ``m * amax / fmax`` with ``m`` in ``[1, 2)`` (steps of 1/16) chosen to
  minimise the mean squared FP8 rounding error of the K (or V) rows seen in
  calibration (``scale_search``, the default; ``m = 1`` without it). FP8's
  precision is relative, so the factor costs no range (nothing seen in
  calibration clips), but it moves every value against the FP8 grid, and K/V
  hold channels of nearly constant magnitude whose rounding error does not
  average out over tokens (README: the measured effect);
- dynamic (no static scale for K or V): per-head ``[B, H_kv, 1, 1]``, taken from
  the first ``update`` of the sequence (the prefill) with ``DYNAMIC_HEADROOM``
  so later tokens fit. In eager mode a head's scale grows when a later update
  of several tokens, or a one-token step while the cache holds fewer than
  ``GROWTH_CHECK_TOKENS``, would saturate, and its stored states are quantized
  again (a short first update, a cached prefix before a prompt); otherwise
  anything beyond the headroom saturates, never overflows.

Compensated key rounding (``compensated_rounding=True``, the default): what
attention does with a key is ``q . k``, so what its rounding error ``e``
costs is ``q . e``, summed over the queries that will read it: ``e^T H e``
with ``H = E[q q^T]``, the second moment of the queries of the key's head
group (after RoPE, as attention sees them). :func:`qfp8.calibrate` measures
``H`` per KV head (``k_rounding_hessian`` ``[H_kv, D, D]``, float32, on the
attention module) and each key row is then rounded channel by channel with
its error fed into the channels still to round
(``torch.ops.qfp8.fp8_compensated_quantize``, GPTQ's rounding applied to one
key): the same FP8 format and scales, attention unchanged, a smaller error
where queries look. Only on CPU with qfp8's extension (its kernel); elsewhere
keys are rounded to nearest. Queries are recorded by qfp8's attention function
(:data:`FUSED_ATTENTION`, the default with sdpa attention); other attention
implementations calibrate scales only and keep round-to-nearest. ``H`` is not
part of the state dict (vLLM would refuse an unknown tensor):
:func:`qfp8.save_pretrained` writes it to ``qfp8_kv_rounding.st`` (safetensors)
beside the weights and :func:`qfp8.from_pretrained` reads it back.

Optional key centering (``center_keys=True``): the first update's per-channel
mean of K (``[B, H_kv, 1, D]``) is subtracted before quantizing and never added
back. ``q . (k - mu) = q . k - q . mu`` shifts every score of a query by the same
constant, which softmax ignores, so attention stays exact while the FP8 rounding
error shrinks with ``|k - mu|`` instead of ``|k|``.

How it plugs in
---------------
:func:`enable_fp8_kv_cache` gives every attention module (``layer_idx``,
``k_proj``, ``v_proj``) the scale buffers, calibration methods and a forward
pre-hook. The hook swaps the module's ``DynamicLayer``/``StaticLayer`` in
whatever ``Cache`` it is called with for :class:`Float8DynamicLayer` /
:class:`Float8StaticLayer`, and the sliding-window variants (Mistral, Qwen2
with ``use_sliding_window``) for :class:`Float8DynamicSlidingWindowLayer` /
:class:`Float8StaticSlidingWindowLayer`, which keep and return the same
tokens as transformers' layers; the module's own forward and RoPE are
untouched, and so is its attention implementation except as said below.

What is dequantized per step
----------------------------
With transformers' ``"sdpa"`` attention (the default), enabling the cache
switches the model to :data:`FUSED_ATTENTION`: the cache layers hand the
attention function their FP8 buffers, and each decode step (one query token)
runs ``torch.ops.qfp8.fp8_decode_attention``, which reads only the K/V rows
the mask lets through and converts them in registers. Nothing is
dequantized, and a static cache costs what its filled part costs.

Prefill, other attention implementations (eager, flex) and
``fused_attention=False`` take K/V dequantized into the model's dtype, one
layer at a time (never the whole cache):

- Dynamic cache: the stored tokens, all of which attention reads.
- Static cache, eager: only the filled prefix ``[0, seq_len)``; the rest of the
  returned buffer is zeros, which the causal mask hides.
- Static cache, compiled: shapes must not depend on the fill level, so the
  whole ``max_cache_len`` buffer is dequantized.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from qfp8 import formats, rounding
from qfp8.library import attention as attention_ops
from qfp8.nn.attention import PACKED_SDPA, packed_sdpa
from qfp8.nn.qlinear import keep_buffer_dtypes

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


# ----------------------------------------------------------------- numerics


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


def k_rounding_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<attention>.k_rounding_hessian`` of each FP8 KV-cache attention module that uses one (compensated
    rounding on): what a state dict leaves out (see the module docstring); :func:`load_k_rounding` puts it back."""
    return {
        f"{name}.k_rounding_hessian": module.k_rounding_hessian.detach().to("cpu", torch.float32).contiguous()
        for name, module in model.named_modules()
        if isinstance(module, Float8KVAttentionMixin)
        and module.k_rounding_hessian is not None
        and getattr(module, "qfp8_kv_compensate", False)
    }


def load_k_rounding(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Sets ``<attention>.k_rounding_hessian`` entries of ``tensors`` (as ``save_pretrained`` writes them) on
    ``model``'s FP8 KV-cache attention modules; ``ValueError`` naming ``source`` and the entry otherwise."""
    attentions = attention_modules(model)
    for key, value in tensors.items():
        name, _, field = key.rpartition(".")
        attention = attentions.get(name)
        if field != "k_rounding_hessian" or not isinstance(attention, Float8KVAttentionMixin):
            raise ValueError(f"{source}: {key!r} names no FP8 KV-cache attention module's k_rounding_hessian")
        heads = getattr(getattr(attention, "config", None), "num_key_value_heads", None)
        dim = getattr(attention, "head_dim", None)
        if heads is not None and dim is not None and tuple(value.shape) != (heads, dim, dim):
            raise ValueError(f"{source}: {key!r} has shape {list(value.shape)}, the layer needs {[heads, dim, dim]}")
        device = attention.k_proj.weight.device if hasattr(attention.k_proj, "weight") else None
        try:
            set_k_rounding(attention, value.to(device=device))
        except ValueError as error:
            raise ValueError(f"{source}: {key!r}: {error}") from None
    uncovered = [
        name
        for name, attention in attentions.items()
        if isinstance(attention, Float8KVAttentionMixin) and f"{name}.k_rounding_hessian" not in tensors
    ]
    if tensors and uncovered:
        shown = ", ".join(uncovered[:4]) + (f" and {len(uncovered) - 4} more" if len(uncovered) > 4 else "")
        warnings.warn(
            f"{source}: no key-rounding moments for {shown}; those layers round keys to nearest", stacklevel=2
        )


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


# ------------------------------------------------------------ cache layers


def _cat_tokens(stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """FP8 states joined along the tokens. Under torch.autocast, torch.cat refuses FP8 tensors ("Unexpected
    floating ScalarType in at::autocast::prioritize"): autocast is turned off around it (a cat of byte views
    would cut the keys' straight-through gradient)."""
    if torch.is_autocast_enabled(stored.device.type):
        with torch.autocast(stored.device.type, enabled=False):
            return torch.cat([stored, new], dim=-2)
    return torch.cat([stored, new], dim=-2)


class _Float8LayerMixin:
    """Shared by the dynamic and the static FP8 layer: scales, centering, quantize and read."""

    calibration_cache = False  # see _first_update_stats

    def _setup(self, attention: nn.Module) -> None:
        self.attention = attention
        self.fp8_dtype = attention.qfp8_kv_dtype
        self.center_keys = attention.qfp8_center_keys
        self.key_scale: torch.Tensor | None = None  # dynamic [B, H, 1, 1]
        self.value_scale: torch.Tensor | None = None
        self.key_mean: torch.Tensor | None = None  # [B, H, 1, D] when centering
        self.out_dtype: torch.dtype | None = None

    def __deepcopy__(self, memo):
        # A copied cache (transformers' prompt reuse: deepcopy a filled cache,
        # generate from the copy) serves the same model: its attention module
        # is shared, not copied with the model's weights.
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        memo.setdefault(id(self.attention), self.attention)
        for name, value in self.__dict__.items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        return copied

    def _static_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The module's static scales, as this cache uses them (none for a calibration cache)."""
        if self.calibration_cache:
            return None, None
        return self.attention.k_scale, self.attention.v_scale

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        k_scale, v_scale = self._static_scales()
        return (
            self.key_scale if k_scale is None else k_scale,
            self.value_scale if v_scale is None else v_scale,
        )

    def _first_update_stats(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Per-sequence statistics fixed by the first update: key mean, dynamic per-head scales.

        A sequence begun while the layer calibrates runs as in an uncalibrated layer (per-sequence scales,
        keys rounded to nearest), whatever an earlier calibration set: what a calibration measures in the
        layers after this one then does not depend on the ones before it. One begun outside (a reset cache
        included) uses the static scales.
        """
        self.calibration_cache = bool(getattr(self.attention, "qfp8_kv_calibrating", False))
        mean = key_states.to(torch.float32).mean(dim=-2, keepdim=True) if self.center_keys else None
        keys = key_states.to(torch.float32) - mean if mean is not None else key_states
        return mean, per_head_scale(keys, self.fp8_dtype), per_head_scale(value_states, self.fp8_dtype)

    def _quantize_new(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.attention.qfp8_kv_calibrating:
            self.attention._record_kv_amax(key_states, value_states)
        if not torch.compiler.is_compiling() and self._scales_may_grow():
            filled = self._filled()
            if filled > 0 and (key_states.shape[-2] > 1 or filled < GROWTH_CHECK_TOKENS):
                self._grow_dynamic_scales(key_states, value_states)
        k_scale, v_scale = self._scales()
        if self.key_mean is not None:
            key_states = key_states.to(torch.float32) - self.key_mean
        # (getattr: a module pickled before compensated rounding existed has neither)
        attention = self.attention
        compensate = getattr(attention, "qfp8_kv_compensate", 0) and not self.calibration_cache
        factor = getattr(attention, "k_rounding_factor", None) if compensate else None
        if factor is None or not (key_states.is_cpu and attention_ops.compensated_cpu_kernel()):
            keys = quantize_kv(key_states, k_scale, self.fp8_dtype)
        else:
            keys = attention_ops.fp8_compensated_quantize(
                key_states, k_scale, factor, attention.k_rounding_order, self.fp8_dtype
            )
        return keys, quantize_kv(value_states, v_scale, self.fp8_dtype)

    def _scales_may_grow(self) -> bool:
        k_static, v_static = self._static_scales()
        return (k_static is None and self.key_scale is not None) or (v_static is None and self.value_scale is not None)

    def _grow_dynamic_scales(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A later update whose K (V) a dynamic per-head scale would saturate (a prompt after a cached prefix,
        chunked prefill, assisted decoding's drafts, the first steps after a short prompt): that head's scale
        grows to fit it, with the usual headroom, and its stored states are quantized again to it (rounded
        twice). Checked for updates of several tokens, and for one-token steps while the cache holds fewer
        than GROWTH_CHECK_TOKENS (later, a step beyond the headroom saturates); not in compiled steps, which
        cannot branch on the data."""
        fmax = torch.finfo(self.fp8_dtype).max
        for name, states, static in zip(
            ("key", "value"), (key_states, value_states), self._static_scales(), strict=True
        ):
            scale = getattr(self, f"{name}_scale")
            if static is not None or scale is None:
                continue
            if name == "key" and self.key_mean is not None:
                states = states.to(torch.float32) - self.key_mean
            # The fewest small ops (the check runs at decode steps): a NaN amax compares False, as it should.
            over = states.detach().abs().amax(dim=(-2, -1), keepdim=True) > scale * fmax
            if not bool(over.any()):
                continue
            grown = torch.where(over, torch.maximum(scale, per_head_scale(states, self.fp8_dtype)), scale)
            stored = self._stored(name)
            self._store(name, quantize_kv(dequantize_kv(stored, scale, torch.float32), grown, self.fp8_dtype))
            self._set_scale(name, grown)

    def _read(self, keys: torch.Tensor, values: torch.Tensor):
        k_scale, v_scale = self._scales()
        return dequantize_kv(keys, k_scale, self.out_dtype), dequantize_kv(values, v_scale, self.out_dtype)

    def dequantized(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 states ``update`` returned, in the model dtype."""
        return self._read(keys, values)

    def _returned(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` gives attention: the FP8 states themselves when fused, else dequantized."""
        if self._fused():
            return keys, values
        return self.dequantized(keys, values)

    def _fused(self) -> bool:
        """True when the model's attention is qfp8's (:data:`FUSED_ATTENTION`): ``update`` then returns FP8."""
        config = getattr(self.attention, "config", None)
        return getattr(config, "_attn_implementation", None) == FUSED_ATTENTION

    def _select_batch(self, fn) -> None:
        for name in ("key_scale", "value_scale", "key_mean"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def scale_nbytes(self) -> int:
        """Bytes of the per-sequence scales and key means in use (static scales live on the module)."""
        k_static, v_static = self._static_scales()
        in_use = (
            self.key_scale if k_static is None else None,
            self.value_scale if v_static is None else None,
            self.key_mean,
        )
        return sum(t.numel() * t.element_size() for t in in_use if t is not None)


class _Float8DynamicMixin(_Float8LayerMixin):
    """Shared by the growing FP8 layers (full and sliding-window): FP8 buffers, per-sequence stats, batch edits."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.out_dtype = key_states.dtype
        b, h, _, dk = key_states.shape
        self.keys = torch.empty(b, h, 0, dk, dtype=self.fp8_dtype, device=self.device)
        self.values = torch.empty(b, h, 0, value_states.shape[-1], dtype=self.fp8_dtype, device=self.device)
        self.key_mean, self.key_scale, self.value_scale = self._first_update_stats(key_states, value_states)
        self.is_initialized = True

    def reset(self) -> None:
        super().reset()
        self.key_scale = self.value_scale = self.key_mean = None

    def _filled(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def _stored(self, name: str) -> torch.Tensor:
        return self.keys if name == "key" else self.values

    def _store(self, name: str, states: torch.Tensor) -> None:
        setattr(self, "keys" if name == "key" else "values", states)

    def _set_scale(self, name: str, scale: torch.Tensor) -> None:
        setattr(self, f"{name}_scale", scale)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            super().reorder_cache(beam_idx)
            self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            super().batch_repeat_interleave(repeats)
            self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            super().batch_select_indices(indices)
            self._select_batch(lambda t: t[indices, ...])


class Float8DynamicLayer(_Float8DynamicMixin, DynamicLayer):
    """A growing cache layer storing K/V in FP8; ``update`` returns the dequantized states."""

    is_croppable = True

    def __init__(self, attention: nn.Module):
        super().__init__()
        self._setup(attention)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_values = self._quantize_new(key_states, value_states)
        self.keys = _cat_tokens(self.keys, new_keys)
        self.values = _cat_tokens(self.values, new_values)
        return self._returned(self.keys, self.values)


class Float8DynamicSlidingWindowLayer(_Float8DynamicMixin, DynamicSlidingWindowLayer):
    """:class:`DynamicSlidingWindowLayer` in FP8: keeps the last ``sliding_window - 1`` tokens, as transformers does.

    ``update`` returns the kept tokens followed by the new ones (what the
    sliding-window mask from ``get_mask_sizes`` covers); ``crop`` and past
    recording are transformers' own, on the FP8 buffers.
    """

    def __init__(self, sliding_window: int, attention: nn.Module):
        super().__init__(sliding_window=sliding_window)
        self._setup(attention)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_values = self._quantize_new(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = _cat_tokens(self.keys, new_keys)
        values = _cat_tokens(self.values, new_values)
        if self.record_past:
            # Everything is kept until `crop` trims it; attention gets only what the mask covers.
            self.keys, self.values = keys, values
            visible = self.sliding_window - 1 + key_states.shape[-2]
            keys, values = keys[:, :, -visible:], values[:, :, -visible:]
        else:
            self.keys = keys[:, :, -self.sliding_window + 1 :]
            self.values = values[:, :, -self.sliding_window + 1 :]
        return self._returned(keys, values)


def _fp8_view_of(bytes_name: str) -> property:
    """An attribute that reads as the FP8 view of the byte buffer ``bytes_name`` and stores what it is given as bytes."""

    def get(self):
        data = getattr(self, bytes_name)
        return None if data is None else data.view(self.fp8_dtype)

    def put(self, value):
        setattr(self, bytes_name, None if value is None else value.view(torch.uint8))

    return property(get, put)


class _Float8StaticMixin(_Float8LayerMixin):
    """Shared by the preallocated FP8 layers (full and sliding-window): static buffers, stats filled in place.

    The buffers are held as bytes (``key_bytes``, ``value_bytes``) and ``keys`` /
    ``values`` are their FP8 views, made on each access: the writes go to
    the bytes (``index_copy_`` has no FP8 kernel), and a compiled graph then
    sees one tensor per buffer (inductor cannot write through a dtype view of
    an FP8 buffer made inside the graph, and AOT autograd refuses two inputs
    of different dtypes on one storage when one is written).
    """

    key_bytes = value_bytes = None
    keys = _fp8_view_of("key_bytes")
    values = _fp8_view_of("value_bytes")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.out_dtype = key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        # Bytes, viewed as FP8 by keys / values (see the class docstring).
        self.key_bytes = torch.zeros(*shape, self.k_head_dim, dtype=torch.uint8, device=self.device)
        self.value_bytes = torch.zeros(*shape, self.v_head_dim, dtype=torch.uint8, device=self.device)
        scale_shape = (self.batch_size, self.num_heads, 1, 1)
        self.key_scale = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
        self.value_scale = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
        if self.center_keys:
            self.key_mean = torch.zeros(self.batch_size, self.num_heads, 1, self.k_head_dim, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            static = (self.key_bytes, self.value_bytes, self.cumulative_length, self.key_scale, self.value_scale)
            for tensor in static:
                torch._dynamo.mark_static_address(tensor)
            if self.key_mean is not None:
                torch._dynamo.mark_static_address(self.key_mean)
        self.is_initialized = True

    def _quantize_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Lazy initialization and the per-sequence stats on the first update, then the new states in FP8."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.needs_stats:
            # Filled in place: the tensors keep the static addresses compiled decode steps read.
            mean, key_scale, value_scale = self._first_update_stats(key_states, value_states)
            self.key_scale.copy_(key_scale)
            self.value_scale.copy_(value_scale)
            if mean is not None:
                self.key_mean.copy_(mean)
            self.needs_stats = False
        return self._quantize_new(key_states, value_states)

    def _write(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Writes FP8 states at ``cumulative_length`` in place and advances it."""
        length = new_keys.shape[-2]
        position = torch.arange(length, device=self.device) + self.cumulative_length
        self.key_bytes.index_copy_(2, position, new_keys.view(torch.uint8))
        self.value_bytes.index_copy_(2, position, new_values.view(torch.uint8))
        self.cumulative_length.add_(length)

    def _filled(self) -> int:
        """Tokens held in the buffer (eager only: reads the count)."""
        if not self.is_initialized:
            return 0
        return min(int(getattr(self, "cumulative_length_int", None) or self.cumulative_length), self.max_cache_len)

    def _stored(self, name: str) -> torch.Tensor:
        return (self.keys if name == "key" else self.values)[:, :, : self._filled()]

    def _store(self, name: str, states: torch.Tensor) -> None:
        data = self.key_bytes if name == "key" else self.value_bytes
        data[:, :, : states.shape[-2]].copy_(states.view(torch.uint8))

    def _set_scale(self, name: str, scale: torch.Tensor) -> None:
        getattr(self, f"{name}_scale").copy_(scale)  # in place: compiled steps read this address

    def dequantized(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States ``update`` returned, in the model dtype; of the whole buffer, eager converts only the filled part."""
        # Compiled graphs read the whole buffer (no data_ptr under dynamo, which refuses pointer comparisons).
        if torch.compiler.is_compiling():
            return self._read(keys, values)
        if keys.shape != self.key_bytes.shape or keys.data_ptr() != self.key_bytes.data_ptr():
            return self._read(keys, values)
        # Eager: dequantize only the filled prefix; the zeros behind it are masked out.
        filled = min(int(self.get_seq_length()), self.max_cache_len)
        keys, values = self._read(self.keys[:, :, :filled], self.values[:, :, :filled])
        pad = (0, 0, 0, self.max_cache_len - filled)
        return nn.functional.pad(keys, pad), nn.functional.pad(values, pad)

    def reset(self) -> None:
        if self.is_initialized:
            self.key_bytes.zero_()
            self.value_bytes.zero_()
        self.cumulative_length.zero_()
        self.needs_stats = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for name in ("key_bytes", "value_bytes", "key_scale", "value_scale", "key_mean"):
                tensor = getattr(self, name)
                if tensor is not None:
                    tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


class Float8StaticLayer(_Float8StaticMixin, StaticLayer):
    """A preallocated cache layer storing K/V in FP8, for ``torch.compile`` (static addresses, in-place writes)."""

    def __init__(self, max_cache_len: int, attention: nn.Module):
        super().__init__(max_cache_len=max_cache_len)
        self._setup(attention)
        self.needs_stats = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new_keys, new_values = self._quantize_update(key_states, value_states)
        self._write(new_keys, new_values)
        return self._returned(self.keys, self.values)


class Float8StaticSlidingWindowLayer(_Float8StaticMixin, StaticSlidingWindowLayer):
    """:class:`StaticSlidingWindowLayer` in FP8: a ``min(max_cache_len, sliding_window)`` buffer holding the last tokens.

    Until the window is full, tokens are written in place as in
    :class:`Float8StaticLayer`. A one-token update of a full window (a decode
    step) shifts the buffer left by one in place and writes the token last,
    so compiled steps keep reading the same addresses. An update that runs
    past the window with several tokens returns the tokens kept so far
    followed by the new ones (what the mask covers) and keeps the last
    ``max_cache_len``, as transformers' layer does.
    """

    def __init__(self, max_cache_len: int, sliding_window: int, attention: nn.Module):
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window)
        self._setup(attention)
        self.needs_stats = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new_keys, new_values = self._quantize_update(key_states, value_states)
        length, stored = key_states.shape[-2], self.cumulative_length_int
        self.cumulative_length_int += length
        if stored + length <= self.max_cache_len:
            self._write(new_keys, new_values)
            return self._returned(self.keys, self.values)
        if stored >= self.max_cache_len and length == 1:
            for data, new in ((self.key_bytes, new_keys), (self.value_bytes, new_values)):
                data.copy_(data.roll(-1, dims=-2))
                data[:, :, -1:].copy_(new.view(torch.uint8))
            return self._returned(self.keys, self.values)
        # A full window keeps its last max_cache_len - 1 tokens for the new ones; a filling one keeps them all.
        kept = slice(1, None) if stored >= self.max_cache_len else slice(0, stored)
        keys = _cat_tokens(self.keys[:, :, kept], new_keys)
        values = _cat_tokens(self.values[:, :, kept], new_values)
        self.key_bytes.copy_(keys[:, :, -self.max_cache_len :].view(torch.uint8))
        self.value_bytes.copy_(values[:, :, -self.max_cache_len :].view(torch.uint8))
        return self._returned(keys, values)

    def reset(self) -> None:
        super().reset()
        self.cumulative_length_int = 0


class _CalibrationRecorder:
    """Stands in for a cache when calibration runs with ``use_cache=False``: records K/V amax, returns them as is."""

    def __init__(self, attention: nn.Module):
        self.attention = attention

    def update(self, key_states, value_states, *args, **kwargs):
        self.attention._record_kv_amax(key_states, value_states)
        return key_states, value_states


# ------------------------------------------------------- attention modules


class Float8KVAttentionMixin:
    """Added to each attention module's class: FP8 KV-cache settings, static scales, calibration."""

    qfp8_kv_dtype: torch.dtype
    qfp8_center_keys: bool
    qfp8_kv_scale_search: bool
    qfp8_kv_compensate: bool
    qfp8_kv_calibrating: bool

    def __reduce_ex__(self, protocol):
        # The mixed class is made at run time, so pickle cannot find it by
        # name: rebuild it from the attention class it was mixed into.
        base = type(self).__mro__[type(self).__mro__.index(Float8KVAttentionMixin) + 1]
        return _unpickle_attention, (base,), self.__getstate__()

    def _apply(self, fn, recurse=True):
        # Scales stay float32 when the model's dtype changes (model.to(torch.bfloat16) casts every floating
        # buffer); only their device follows. The contract: scales are float32 in memory and on disk.
        with keep_buffer_dtypes(self, ("k_scale", "v_scale", *KV_ROUNDING_BUFFERS)):
            super()._apply(fn, recurse)
        return self

    def abort_calibration(self) -> None:
        """Leaves calibration without using what it recorded: the scales stay as they were before it."""
        self.qfp8_kv_calibrating = False
        self._kv_amax = None
        self._kv_rows = ([], [])
        self._query_moment = None
        self._calibration_mask = None

    def start_calibration(self) -> None:
        self.qfp8_kv_calibrating = True
        self._kv_amax: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kv_rows: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._kv_row_stride = 1
        self._query_moment: tuple[torch.Tensor, int] | None = None  # (sum of q q^T per KV head, rows)

    def end_calibration(self) -> None:
        self.qfp8_kv_calibrating = False
        self._calibration_mask = None
        if self._kv_amax is None:
            self._query_moment = None
            return  # never ran: stays dynamic
        k_amax, v_amax = self._kv_amax
        # Calibration may run under torch.inference_mode(); scales made there would be inference tensors, which a
        # later forward with autograd on cannot use. Made outside it, they are normal tensors.
        with torch.inference_mode(False):
            k_scale = formats.scale_from_amax(k_amax, self.qfp8_kv_dtype).reshape(1)
            v_scale = formats.scale_from_amax(v_amax, self.qfp8_kv_dtype).reshape(1)
            if self.qfp8_kv_scale_search and self._kv_rows[0]:
                k_scale = search_scale(torch.cat(self._kv_rows[0]), k_scale, self.qfp8_kv_dtype)
                v_scale = search_scale(torch.cat(self._kv_rows[1]), v_scale, self.qfp8_kv_dtype)
            hessian = None
            if self.qfp8_kv_compensate and self._query_moment is not None:
                moment, rows = self._query_moment
                hessian = (moment / rows).to(torch.float32)
        self.k_scale, self.v_scale = k_scale, v_scale
        if hessian is not None:  # none recorded (compensation off, another attention): a measured one is kept
            set_k_rounding(self, hessian)
        self._kv_amax = None
        self._kv_rows = ([], [])
        self._query_moment = None

    def _record_queries(self, query: torch.Tensor) -> None:
        """Adds ``q q^T`` of every finite query row ``[B, Hq, T, D]`` of a real token to its KV head's sum (float64).

        A query is a padded position's when the layer's mask (``_calibration_mask``, ``[B, 1, T, S]``, bool or
        additive, the last ``T`` key positions being the queries' own) does not let it attend to its own position.
        """
        batch, heads, tokens, dim = query.shape
        groups = getattr(self, "num_key_value_groups", None)
        if not groups or heads % groups or query.numel() == 0:
            return
        kv_heads = heads // groups
        # Query head j reads KV head j // (heads / kv_heads) (transformers' repeat_kv).
        rows = query.detach().to(torch.float64).reshape(batch, kv_heads, -1, tokens, dim)
        keep = torch.isfinite(rows).all(-1, keepdim=True)  # [B, Hkv, G, T, 1]
        real = _real_queries(getattr(self, "_calibration_mask", None), batch, tokens)
        if real is not None:
            keep = keep & real[:, None, None, :, None]
        rows = rows.transpose(0, 1).reshape(kv_heads, -1, dim)
        finite = keep.transpose(0, 1).reshape(kv_heads, -1, 1)
        rows = torch.where(finite, rows, 0.0)
        moment = rows.transpose(1, 2) @ rows
        count = int(finite.sum()) // kv_heads
        if self._query_moment is not None:
            moment, count = moment + self._query_moment[0], count + self._query_moment[1]
        if count > 0:
            self._query_moment = (moment, count)

    def _record_kv_amax(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.numel() == 0 or value_states.numel() == 0:
            return
        # Padded positions of the batch (the mask keeps them from attending to themselves) count as zeros,
        # which change no amax, and their rows are not kept for the search.
        real = _real_queries(getattr(self, "_calibration_mask", None), key_states.shape[0], key_states.shape[2])
        if real is not None:
            key_states = torch.where(real[:, None, :, None], key_states, 0.0)
            value_states = torch.where(real[:, None, :, None], value_states, 0.0)
        k_amax, v_amax = _finite_abs(key_states).amax(), _finite_abs(value_states).amax()
        if not bool((k_amax > 0) & (v_amax > 0)):
            return  # no finite nonzero K or V (all zeros, NaN/Inf) counts as none: amax 0 gives a scale that saturates
        if self._kv_amax is not None:
            k_amax, v_amax = torch.maximum(k_amax, self._kv_amax[0]), torch.maximum(v_amax, self._kv_amax[1])
        self._kv_amax = (k_amax, v_amax)
        if self.qfp8_kv_scale_search:
            self._keep_kv_rows(key_states, value_states, real)

    def _keep_kv_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, real=None) -> None:
        """Keeps a spread sample of at most SCALE_SEARCH_ROWS token rows ``[H * D]`` of K and V (of the real
        tokens ``real`` ``[B, T]``, when given)."""
        kept_k, kept_v = self._kv_rows
        for states, kept in ((key_states, kept_k), (value_states, kept_v)):
            rows = states.detach().transpose(1, 2).reshape(-1, states.shape[1] * states.shape[3])
            if real is not None:
                rows = rows[real.reshape(-1)]
            kept.append(torch.nan_to_num(rows[:: self._kv_row_stride], nan=0.0, posinf=0.0, neginf=0.0))
        while sum(t.shape[0] for t in kept_k) > SCALE_SEARCH_ROWS:
            self._kv_row_stride *= 2
            for kept in (kept_k, kept_v):
                kept[:] = [torch.cat(kept)[::2]]


def search_scale(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * m``, ``m`` in ``1 + j / SCALE_SEARCH_STEPS``, with the least mean squared FP8 error on ``rows``.

    ``scale`` is ``amax / fmax`` of at least these rows, so no candidate
    clips them; ties keep the smallest factor.
    """
    x = rows.to(torch.float32)
    best, best_error = scale, None
    for j in range(SCALE_SEARCH_STEPS):
        candidate = scale * (1.0 + j / SCALE_SEARCH_STEPS)
        error = (dequantize_kv(quantize_kv(x, candidate, dtype), candidate, torch.float32) - x).square().mean()
        if best_error is None or error < best_error:
            best, best_error = candidate, error
    return best


_MIXED_CLASSES: dict[type, type] = {}


def _with_mixin(cls: type) -> type:
    mixed = _MIXED_CLASSES.get(cls)
    if mixed is None:
        mixed = type(f"Float8KV{cls.__name__}", (Float8KVAttentionMixin, cls), {"__module__": cls.__module__})
        _MIXED_CLASSES[cls] = mixed
    return mixed


def _unpickle_attention(base: type) -> nn.Module:
    """An empty FP8-cache attention module of ``base``'s mixed class; pickle then restores its state."""
    _register_fused_attention()  # the unpickled model's config may name it
    mixed = _with_mixin(base)
    return mixed.__new__(mixed)


def _is_llama_attention(module: nn.Module) -> bool:
    if not all(hasattr(module, name) for name in ("layer_idx", "k_proj", "v_proj", "head_dim")):
        return False
    parameters = inspect.signature(type(module).forward).parameters
    return "cache" in parameters or "past_key_values" in parameters


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The Llama-family attention modules of ``model`` by name."""
    return {name: module for name, module in model.named_modules() if _is_llama_attention(module)}


def check_supported(model: nn.Module, caller: str) -> dict[str, nn.Module]:
    """:func:`attention_modules` of ``model``; a ``ValueError`` naming ``caller`` unless it is a decoder with some."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{caller}: {type(model).__name__} is an encoder-decoder model; the FP8 KV cache serves decoder-only "
            "models (transformers' EncoderDecoderCache is not supported)"
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{caller}: {type(model).__name__} has no Llama-family attention module (one with layer_idx, k_proj, "
            "v_proj, head_dim and a forward taking `cache`)"
        )
    return modules


def _cache_from(kwargs: dict):
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def _install_layer(cache, attention: nn.Module) -> None:
    """Replaces the attention module's layer in ``cache`` by an FP8 one (once per cache)."""
    index = attention.layer_idx
    layers = cache.layers
    if index < len(layers):
        layer = layers[index]
        if isinstance(layer, _Float8LayerMixin):
            if layer.attention is not attention:
                raise ValueError(
                    f"cache layer {index} belongs to another model's attention module; pass each model its own cache"
                )
            return
    else:
        replicate = getattr(cache, "layer_class_to_replicate", None)
        if replicate is None:
            raise ValueError(f"cache {type(cache).__name__} has {len(layers)} layers, attention layer_idx is {index}")
        while len(layers) <= index:
            layers.append(replicate())
        layer = layers[index]
    if type(layer) is StaticLayer:
        new_layer = Float8StaticLayer(layer.max_cache_len, attention)
    elif type(layer) is StaticSlidingWindowLayer:
        # Its max_cache_len is already min(max_cache_len, sliding_window); croppable says which was smaller.
        new_layer = Float8StaticSlidingWindowLayer(layer.max_cache_len, layer.max_cache_len, attention)
        new_layer._is_croppable = layer.is_croppable
    elif type(layer) is DynamicLayer:
        new_layer = Float8DynamicLayer(attention)
    elif type(layer) is DynamicSlidingWindowLayer:
        new_layer = Float8DynamicSlidingWindowLayer(layer.sliding_window, attention)
        new_layer.record_past = layer.record_past
    else:
        raise NotImplementedError(
            f"FP8 KV cache: layer {index} is a {type(layer).__name__}; only DynamicLayer, StaticLayer and their "
            "sliding-window variants (DynamicCache / StaticCache) are supported"
        )
    if layer.is_initialized and not _holds_nothing(layer):
        raise ValueError(
            f"FP8 KV cache: cache layer {index} already holds unquantized states; start from a fresh cache"
        )
    layers[index] = new_layer


def _holds_nothing(layer) -> bool:
    """A static layer allocated ahead of its first update (``StaticCache.early_initialization``, which transformers
    calls for chunked prefill and export): its float buffers are replaced, not read."""
    if not isinstance(layer, StaticLayer):
        return False
    if torch.compiler.is_compiling():
        return True  # the count is a tensor a graph cannot branch on; a float cache filled first is not supported
    return int(layer.cumulative_length) == 0 and getattr(layer, "cumulative_length_int", 0) == 0


def _pre_forward(module: nn.Module, args, kwargs):
    cache = _cache_from(kwargs)
    if module.qfp8_kv_calibrating:  # which tokens are padding: they count in no scale or moment
        module._calibration_mask = kwargs.get("attention_mask")
    if cache is None:
        if module.qfp8_kv_enabled and module.qfp8_kv_calibrating:
            kwargs = dict(kwargs)
            kwargs.pop("past_key_values", None)
            kwargs["cache"] = _CalibrationRecorder(module)
            return args, kwargs
        return None
    if module.qfp8_kv_enabled:
        _install_layer(cache, module)
    # Turned off (set_fp8_kv_cache_enabled), a cache met from now on stays float, but one already holding this
    # module's FP8 layer stays FP8. Either way, the attention function (_fused_sdpa) needs the FP8 layer for
    # its scales.
    layers = getattr(cache, "layers", ())
    layer = layers[module.layer_idx] if module.layer_idx < len(layers) else None
    if isinstance(layer, _Float8LayerMixin) and layer.attention is module and layer._fused():
        return args, {**kwargs, "qfp8_kv_layer": layer}
    return None


# ------------------------------------------------------ fused attention

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


def _take_scale(attention: nn.Module, scale_name: str, state_dict, key: str) -> None:
    """Checks the stored scale ``state_dict[key]`` (one finite value > 0), puts it in float32 ``[1]`` form and
    gives ``attention`` the buffer slot it loads into."""
    value = state_dict[key]
    if value.numel() != 1:
        raise ValueError(f"{key}: an FP8 KV-cache scale is per tensor (1 value), got shape {tuple(value.shape)}")
    value = value.detach().reshape(1).to(torch.float32)
    problem = formats.scale_problem(value, getattr(attention, "qfp8_kv_dtype", None))
    if problem is not None:
        raise ValueError(f"{key}: an FP8 KV-cache scale holds {problem}")
    state_dict[key] = value
    if getattr(attention, scale_name) is None:
        device = attention.k_proj.weight.device if hasattr(attention.k_proj, "weight") else None
        with torch.inference_mode(False):  # a normal tensor even when loading under inference mode
            attention._buffers[scale_name] = torch.empty(1, dtype=torch.float32, device=device)


def _attention_load_pre_hook(attention, state_dict, prefix, *args) -> None:
    """The same slots when a submodule holding the attention is loaded on its own (``model.model``): the
    model's hook (which also handles missing scales) does not run then."""
    for scale_name in ("k_scale", "v_scale"):
        key = prefix + scale_name
        if key in state_dict:
            _take_scale(attention, scale_name, state_dict, key)


def _load_state_dict_pre_hook(model, state_dict, prefix, *args) -> None:
    """Creates the scale buffers a state dict holds; a layer whose scale is missing falls back to dynamic."""
    carries_scales = any(key.startswith(prefix) and key.endswith((".k_scale", ".v_scale")) for key in state_dict)
    missing = []
    for name, attention in attention_modules(model).items():
        if not isinstance(attention, Float8KVAttentionMixin):
            continue
        for scale_name in ("k_scale", "v_scale"):
            key = f"{prefix}{name}.{scale_name}"
            if key in state_dict:
                _take_scale(attention, scale_name, state_dict, key)
            elif carries_scales:
                attention._buffers[scale_name] = None
                missing.append(key)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        warnings.warn(
            f"FP8 KV cache: the state dict has no {shown}; those caches use dynamic per-head scales instead",
            stacklevel=3,
        )


def enable_fp8_kv_cache(
    model: nn.Module,
    dtype=torch.float8_e4m3fn,
    center_keys: bool = False,
    fused_attention: bool = True,
    scale_search: bool = True,
    compensated_rounding: bool = True,
) -> list[str]:
    """Stores the KV cache of every Llama-family attention module of ``model`` in FP8 (in place).

    ``dtype``: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or their names).
    ``center_keys``: subtract each key channel's prefill mean before quantizing
    (attention output unchanged, smaller rounding error; runtime only).
    ``scale_search``: static scales from :func:`qfp8.calibrate` are
    ``m * amax / fmax`` with ``m`` chosen in ``[1, 2)`` for the least FP8
    error on the calibration K/V (see the module docstring); False keeps
    ``amax / fmax``.
    ``compensated_rounding``: :func:`qfp8.calibrate` also measures each
    layer's query second moment and keys are rounded to keep the error
    queries see small (see the module docstring; needs ``fused_attention``
    during calibration). False: round to nearest (a moment already measured
    is kept, unused, until then).
    ``fused_attention``: when the model uses transformers' ``"sdpa"``
    attention (or qfp8's :data:`~qfp8.nn.attention.PACKED_SDPA`), switch it
    to :data:`FUSED_ATTENTION`, whose decode steps read the FP8 cache in
    qfp8's kernel instead of dequantizing it first (prefill and everything
    else still run SDPA). Other attention implementations are left alone and
    get dequantized K/V.
    Returns the names of the attention modules. Static scales come from
    :func:`qfp8.calibrate` or a checkpoint; without them scales are dynamic.
    """
    dtype = formats.fp8_dtype(dtype)
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"FP8 KV cache dtype must be one of {[str(d) for d in KV_CACHE_DTYPES]}, got {dtype}")
    modules = check_supported(model, "enable_fp8_kv_cache")
    for module in modules.values():
        if isinstance(module, Float8KVAttentionMixin):
            if module.qfp8_kv_dtype != dtype:  # scales of another format no longer hold
                module.qfp8_kv_dtype = dtype
                module.k_scale = module.v_scale = None
            module.qfp8_center_keys = center_keys
            module.qfp8_kv_scale_search = scale_search
            module.qfp8_kv_compensate = compensated_rounding
            module.qfp8_kv_enabled = True
            continue
        module.__class__ = _with_mixin(type(module))
        module.qfp8_kv_dtype = dtype
        module.qfp8_center_keys = center_keys
        module.qfp8_kv_scale_search = scale_search
        module.qfp8_kv_compensate = compensated_rounding
        module.qfp8_kv_calibrating = False
        module.qfp8_kv_enabled = True
        module._kv_amax = None
        module.register_buffer("k_scale", None)
        module.register_buffer("v_scale", None)
        for name in KV_ROUNDING_BUFFERS:  # not in the state dict: see the module docstring
            module.register_buffer(name, None, persistent=False)
        module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
        module.register_load_state_dict_pre_hook(_attention_load_pre_hook)
    if not getattr(model, "_qfp8_kv_load_hook", False):
        model.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
        model._qfp8_kv_load_hook = True
    model.qfp8_kv_cache_dtype = dtype
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if fused_attention and (before := _select_fused_attention(config)) is not None:
        model._qfp8_attention_before_fused = before
    elif not fused_attention and attention == FUSED_ATTENTION:  # enabled before with the fused path: switch back
        config._attn_implementation = getattr(model, "_qfp8_attention_before_fused", "sdpa")
    return list(modules)


def set_fp8_kv_cache_enabled(model: nn.Module, enabled: bool) -> None:
    """Turns the FP8 cache off (or back on) for caches the model meets from then on; scales are kept.

    For A/B runs in one process: a cache already holding FP8 layers stays FP8.
    """
    modules = [m for m in model.modules() if isinstance(m, Float8KVAttentionMixin)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no FP8 KV cache; call enable_fp8_kv_cache first")
    for module in modules:
        module.qfp8_kv_enabled = enabled


def kv_cache_nbytes(cache) -> dict[str, int]:
    """Bytes held by a cache: ``data`` (K and V states) and ``scales`` (scales, key means, static scales)."""
    data = scales = 0
    seen_modules = set()
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        data += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        if isinstance(layer, _Float8LayerMixin):
            scales += layer.scale_nbytes()
            attention = layer.attention
            if id(attention) not in seen_modules:
                seen_modules.add(id(attention))
                scales += sum(
                    t.numel() * t.element_size() for t in (attention.k_scale, attention.v_scale) if t is not None
                )
    return {"data": data, "scales": scales}
