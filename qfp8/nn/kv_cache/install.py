"""Enabling the FP8 KV cache on a model: the forward pre-hook that installs FP8 layers in whatever cache the
attention modules are called with, loading static scales from a state dict, and the cache's size."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from qfp8 import formats
from qfp8.nn.kv_cache.fused import FUSED_ATTENTION, _select_fused_attention
from qfp8.nn.kv_cache.layers import (
    Float8DynamicLayer,
    Float8DynamicSlidingWindowLayer,
    Float8StaticLayer,
    Float8StaticSlidingWindowLayer,
    _CalibrationRecorder,
    _Float8LayerMixin,
)
from qfp8.nn.kv_cache.mixin import Float8KVAttentionMixin, _with_mixin, attention_modules, check_supported
from qfp8.nn.kv_cache.numerics import KV_CACHE_DTYPES, KV_ROUNDING_BUFFERS

__all__ = [
    "enable_fp8_kv_cache",
    "kv_cache_nbytes",
    "set_fp8_kv_cache_enabled",
]


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
