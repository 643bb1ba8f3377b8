"""The FP8 KV cache of a loaded checkpoint: its scale slots and its key-rounding file."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from qfp8.checkpoint.naming import KV_ROUNDING_FILE
from qfp8.checkpoint.safetensors_io import SafetensorsFile

__all__ = ["enable_kv_cache_skeleton", "load_kv_rounding"]


def enable_kv_cache_skeleton(model: nn.Module, dtype: torch.dtype) -> None:
    """Adds the FP8 KV cache (``k_scale``/``v_scale`` on attention modules) that the checkpoint's scales load into."""
    try:
        from qfp8.nn.kv_cache import enable_fp8_kv_cache
    except ImportError as error:
        raise NotImplementedError(
            "this checkpoint has an FP8 KV cache (kv_cache_scheme / k_scale, v_scale) but qfp8.nn.kv_cache is not "
            f"available in this build: {error}"
        ) from error
    enable_fp8_kv_cache(model, dtype)
    model.qfp8_kv_cache_dtype = dtype


def load_kv_rounding(model: nn.Module, directory: Path, has_kv_cache: bool) -> None:
    """The FP8 KV cache's query second moments from ``qfp8_kv_rounding.st`` (safetensors), when the folder has it."""
    path = Path(directory) / KV_ROUNDING_FILE
    if not path.is_file():
        return
    if not has_kv_cache:
        warnings.warn(f"{path}: the checkpoint has no FP8 KV cache; its key-rounding file is ignored", stacklevel=3)
        return
    from qfp8.nn.kv_cache import load_k_rounding

    file = SafetensorsFile(path)
    load_k_rounding(model, {name: file.read(name) for name in file.keys()}, str(path))
