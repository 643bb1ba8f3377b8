"""FP8 cache layers for transformers' cache API: dynamic and static, each with a sliding-window variant, and
the recorder that stands in for a cache when calibration runs without one."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from qfp8.library import attention as attention_ops
from qfp8.nn.kv_cache.fused import FUSED_ATTENTION
from qfp8.nn.kv_cache.numerics import GROWTH_CHECK_TOKENS, dequantize_kv, per_head_scale, quantize_kv

__all__ = [
    "Float8DynamicLayer",
    "Float8DynamicSlidingWindowLayer",
    "Float8StaticLayer",
    "Float8StaticSlidingWindowLayer",
]


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
