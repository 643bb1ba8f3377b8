"""What a checkpoint may hold, checked before anything of it is used.

- **Config types**: ``quantization_config`` is checked against a strict
  schema of the keys qfp8 reads (compressed-tensors' ``QuantizationArgs``
  types: ``num_bits`` an int, ``dynamic`` a bool or ``"local"``, never the
  string ``"false"``), and so are the top-level keys qfp8 reads; a value of
  the wrong type is a ValueError naming the file and the key.
- **Scale bounds**: a scale multiplies FP8 values on dequantization, so
  ``fmax * scale`` must be a finite float32: every ``weight_scale``,
  ``input_scale``, ``k_scale`` and ``v_scale`` must lie in
  ``(0, float32 max / fmax]`` of the FP8 dtype it scales (7.6e35 for e4m3fn,
  5.9e33 for e5m2, 1.4e36 for e4m3fnuz). qfp8 never writes a larger one: its
  scales are ``amax / fmax`` of finite float32 values.
- **KV-cache scales**: when a checkpoint stores any ``k_scale``/``v_scale``,
  or its ``kv_cache_scheme`` is static, every attention layer must have both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qfp8 import formats

__all__ = [
    "CONFIG_GROUP",
    "QUANTIZATION_ARGS",
    "QUANTIZATION_CONFIG",
    "SCALE_SUFFIXES",
    "TOP_LEVEL",
    "check_config",
    "check_kv_dtype_key",
    "check_kv_scales",
    "check_quanto_map",
    "check_scale_bounds",
    "check_unused_input_scales",
    "kv_scheme_is_static",
    "largest_scale",
]

SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale")

_INT = "an int"
_STR = "a string"
_BOOL = "true or false"
_STRINGS = "a list of strings"
_OBJECT = "a JSON object"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS = {
    _INT: _is_int,
    _STR: lambda v: isinstance(v, str),
    _BOOL: lambda v: isinstance(v, bool),
    _STRINGS: lambda v: isinstance(v, list) and all(isinstance(item, str) for item in v),
    _OBJECT: lambda v: isinstance(v, dict),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "true, false or 'local'": lambda v: isinstance(v, bool) or v == "local",
    "a list of ints, or 'NxM'": lambda v: isinstance(v, str) or isinstance(v, list) and all(map(_is_int, v)),
    "a string or a JSON object": lambda v: isinstance(v, (str, dict)),
}

# key -> what its value must be (null is always allowed: it means "not set")
QUANTIZATION_ARGS = {
    "num_bits": _INT,
    "type": _STR,
    "symmetric": _BOOL,
    "group_size": _INT,
    "strategy": _STR,
    "block_structure": "a list of ints, or 'NxM'",
    "dynamic": "true, false or 'local'",
    "actorder": _STR,
    "observer": _STR,
}
CONFIG_GROUP = {"targets": _STRINGS, "format": _STR, "input_activations": _OBJECT, "output_activations": _OBJECT}
QUANTIZATION_CONFIG = {
    "quant_method": _STR,
    "qfp8_method": _STR,
    "format": _STR,
    "quantization_status": _STR,
    "config_groups": _OBJECT,
    "ignore": _STRINGS,
    "global_compression_ratio": "a number",
    "sparsity_config": _OBJECT,
    "qfp8_kv_cache_dtype": _STR,
    "qfp8_token_mse_groups": _STRINGS,
    "qfp8_tensor_weight_groups": _STRINGS,
    # vLLM / AutoFP8 "fp8"
    "activation_scheme": _STR,
    "ignored_layers": _STRINGS,
    "modules_to_not_convert": _STRINGS,
    "kv_cache_scheme": "a string or a JSON object",
}
TOP_LEVEL = {
    "model_type": _STR,
    "architectures": _STRINGS,
    "tie_word_embeddings": _BOOL,
    "quantization_config": _OBJECT,
}


def _check_keys(values: dict, schema: dict, path: Path, where: str) -> None:
    for key, kind in schema.items():
        value = values.get(key)
        if value is not None and not _CHECKS[kind](value):
            raise ValueError(f"{path}: {where}{key} must be {kind}, got {value!r:.200}")


def check_config(config: dict, path: Path) -> None:
    """ValueError naming ``path`` and the key for a value of the wrong type among those qfp8 reads."""
    _check_keys(config, TOP_LEVEL, path, "")
    qc = config.get("quantization_config")
    if qc is None:
        return
    _check_keys(qc, QUANTIZATION_CONFIG, path, "quantization_config.")
    kv = qc.get("kv_cache_scheme")
    if isinstance(kv, dict):
        _check_keys(kv, QUANTIZATION_ARGS, path, "quantization_config.kv_cache_scheme.")
    for name, group in (qc.get("config_groups") or {}).items():
        where = f"quantization_config.config_groups.{name}."
        if not isinstance(group, dict):
            raise ValueError(f"{path}: {where[:-1]} must be a JSON object, got {type(group).__name__}")
        _check_keys(group, {**CONFIG_GROUP, "weights": _OBJECT}, path, where)
        for part in ("weights", "input_activations", "output_activations"):
            if isinstance(group.get(part), dict):
                _check_keys(group[part], QUANTIZATION_ARGS, path, f"{where}{part}.")


def check_quanto_map(quanto_map, path: Path) -> None:
    """An optimum-quanto map: ``{module: {"weights": str, "activations": str}}``."""
    if not isinstance(quanto_map, dict):
        raise ValueError(f"{path}: an optimum-quanto map must be an object of module names")
    for module, entry in quanto_map.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: module {module!r} maps to {entry!r:.100}; expected an object of qtypes")
        for key in ("weights", "activations"):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                raise ValueError(f"{path}: module {module!r} {key} must be a qtype name, got {entry[key]!r:.100}")


def largest_scale(dtype: torch.dtype) -> float:
    """The largest scale of FP8 ``dtype`` values whose dequantized range stays finite in float32."""
    return torch.finfo(torch.float32).max / formats.fp8_max(dtype)


def _scaled_dtype(plan, key: str) -> torch.dtype | None:
    module, _, leaf = key.rpartition(".")
    if leaf in ("k_scale", "v_scale"):
        return plan.kv_cache_dtype or torch.float8_e4m3fn
    scheme = plan.schemes.get(module)
    if scheme is None:
        return None
    return scheme.weight_dtype if leaf == "weight_scale" else scheme.activation_dtype


def check_scale_bounds(plan) -> None:
    """ValueError naming the file and tensor for a stored scale above :func:`largest_scale` of its dtype."""
    for key, stored in plan.tensors.items():
        if not key.endswith(SCALE_SUFFIXES) or stored.scale_shape is None:
            continue
        dtype = _scaled_dtype(plan, key)
        if dtype is None:
            continue
        value = stored.file.get(stored.name)
        if not value.is_floating_point() or not value.numel():
            continue  # StoredTensor.load refuses these, naming them
        bound = largest_scale(dtype)
        value = value.to(torch.float32)
        large = torch.isfinite(value) & (value > bound)  # NaN/Inf: StoredTensor.load names them
        if large.any():
            raise ValueError(
                f"{stored.file.path}: {stored.name} holds {int(large.sum())} value(s) above {bound:.3g} (first: "
                f"{value[large][0].item():.3g}), the largest scale of {dtype} (float32 max / {formats.fp8_max(dtype):g}"
                "): its dequantized values would overflow to Inf. No quantizer writes such a scale"
            )


def check_unused_input_scales(plan, stored, where: str) -> None:
    """ValueError when the checkpoint stores a static ``input_scale`` for a module its config quantizes otherwise
    (dynamic or no input activations): the config and the tensors disagree, and dropping the calibrated scales
    would run another model than the one saved (``"dynamic": "false"`` had done that)."""
    unused = sorted(
        module
        for module, scheme in plan.schemes.items()
        if scheme.activations != "static" and module + ".input_scale" in stored
    )
    if unused:
        scheme = plan.schemes[unused[0]]
        said = "no input quantization" if scheme.activations is None else f"{scheme.activations} input activations"
        raise ValueError(
            f"{where}: module {unused[0]!r}"
            + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
            + f" stores a static input_scale, but its config group says {said}; the config does not describe "
            "these weights (a static group has input_activations dynamic: false)"
        )


def kv_scheme_is_static(qc: dict | None) -> bool:
    scheme = (qc or {}).get("kv_cache_scheme")
    return scheme == "static" or isinstance(scheme, dict) and not scheme.get("dynamic")


def check_kv_scales(model: torch.nn.Module, state: dict, plan) -> None:
    """ValueError naming the attention layers without ``k_scale``/``v_scale`` when the checkpoint stores some, or
    says its KV cache is static."""
    attention = [name for name, module in model.named_modules() if hasattr(module, "qfp8_kv_dtype")]
    stored = [key for key in state if key.endswith((".k_scale", ".v_scale"))]
    if not attention or not (stored or kv_scheme_is_static(plan.config.get("quantization_config"))):
        return
    missing = [
        f"{name}.{leaf}" for name in attention for leaf in ("k_scale", "v_scale") if f"{name}.{leaf}" not in state
    ]
    if missing:
        why = "its kv_cache_scheme is static" if not stored else f"it stores {len(stored)} of them"
        raise ValueError(
            f"{plan.directory}: the FP8 KV cache lacks {len(missing)} scale(s) although {why}: "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; every attention layer needs its "
            "k_scale and v_scale (calibrate and save again, or write kv_cache_scheme dynamic: true)"
        )


def check_kv_dtype_key(qc: dict, plan, path: Path) -> None:
    """A config marked ``qfp8_method`` with an FP8 KV cache names the cache's dtype: without the key, nothing
    tells an e5m2 cache from an e4m3fn one (read as e4m3fn, e5m2 scales give garbage)."""
    from qfp8.checkpoint import config as qconfig

    if qc.get("quant_method") is not None or qc.get(qconfig.QFP8_METHOD_KEY) != qconfig.QFP8_METHOD:
        return
    if not qc.get("kv_cache_scheme") or qconfig.KV_DTYPE_KEY in qc:
        return
    if not qconfig.qfp8_only_reasons(plan.schemes, None):  # nothing but the KV cache can have needed the mark
        raise ValueError(
            f"{path}: quantization_config is marked qfp8_method 'qfp8' for an FP8 KV cache that compressed-tensors "
            f"cannot describe, but has no {qconfig.KV_DTYPE_KEY} key naming the cache's dtype; restore it (for "
            "example 'float8_e5m2') rather than read the scales as e4m3fn"
        )
