"""What the FP8 KV cache adds to an attention module (settings, static scales, calibration, the scale
search), which modules take it, and the key-rounding state saved beside a checkpoint."""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn

from qfp8 import formats
from qfp8.nn.kv_cache.fused import _register_fused_attention
from qfp8.nn.kv_cache.numerics import (
    KV_ROUNDING_BUFFERS,
    SCALE_SEARCH_ROWS,
    SCALE_SEARCH_STEPS,
    _finite_abs,
    _real_queries,
    dequantize_kv,
    quantize_kv,
    set_k_rounding,
)
from qfp8.nn.qlinear import keep_buffer_dtypes

__all__ = [
    "Float8KVAttentionMixin",
    "attention_modules",
    "check_supported",
    "k_rounding_state",
    "load_k_rounding",
    "search_scale",
]


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
