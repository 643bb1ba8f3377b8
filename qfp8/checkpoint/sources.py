"""Where a checkpoint comes from and where the loaded model goes: transformers' loading arguments for qfp8.

:func:`checkpoint_folder` turns ``from_pretrained``'s source arguments (a
folder or a Hub repo id, ``revision``, ``subfolder``, ``token``,
``cache_dir``, ``local_files_only``) into a local folder, as transformers'
``from_pretrained`` resolves them; :func:`place_model` puts a loaded model on
the ``device_map`` it was asked for (one device, or accelerate's dispatch
with CPU and disk offload).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from qfp8.checkpoint.naming import KV_ROUNDING_FILE
from qfp8.checkpoint.readers import resolve

__all__ = [
    "HUB_FILES",
    "SINGLE_DEVICE_MAPS",
    "checkpoint_folder",
    "place_model",
    "single_device",
]

HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py", KV_ROUNDING_FILE]


def _check_text(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str):
        raise TypeError(f"from_pretrained: {name} must be a str, got {type(value).__name__}")


def checkpoint_folder(
    path: str | os.PathLike,
    revision: str | None = None,
    subfolder: str = "",
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """The local folder holding the checkpoint: ``path`` itself, or a Hub repo's snapshot (``subfolder`` inside either).

    A Hub repo is fetched with ``huggingface_hub.snapshot_download`` (only
    config, tokenizer and safetensors files); ``HF_HUB_OFFLINE`` and
    ``local_files_only`` keep it to the local cache.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: path must be a folder or a Hub repo id, got {type(path).__name__}")
    _check_text("revision", revision)
    _check_text("subfolder", subfolder or "", allow_none=False)
    if subfolder and (Path(subfolder).is_absolute() or ".." in Path(subfolder).parts):
        raise ValueError(f"from_pretrained: subfolder {subfolder!r} must be a relative path inside {path}")
    if token is not None and not isinstance(token, (str, bool)):
        raise TypeError(f"from_pretrained: token must be a str or bool, got {type(token).__name__}")
    hub_arguments = revision is not None or token is not None or cache_dir is not None or local_files_only
    local = Path(path)
    if local.exists() or not hub_arguments and not subfolder:
        folder = resolve(path)
    else:
        folder = _download(str(path), revision, subfolder, token, cache_dir, local_files_only)
    if subfolder:
        folder = folder / subfolder
        if not folder.is_dir():
            raise FileNotFoundError(f"{path}: has no subfolder {subfolder!r}")
    return folder


def _download(repo_id: str, revision, subfolder: str, token, cache_dir, local_files_only: bool) -> Path:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        raise FileNotFoundError(f"{repo_id}: no such checkpoint folder, and not a Hub repo id (org/name)")
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(f"{repo_id}: no such folder (and huggingface_hub is not installed)") from None
    patterns = [f"{subfolder}/{pattern}" for pattern in HUB_FILES] if subfolder else HUB_FILES
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                allow_patterns=patterns,
            )
        )
    except Exception as error:  # the hub's errors differ between versions; re-raise as one
        where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
        raise FileNotFoundError(f"{where}: not a folder, and the Hub repo could not be resolved: {error}") from error


SINGLE_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def single_device(device_map) -> torch.device | None:
    """The one device a ``device_map`` names (None: it spreads the model, a dict naming several devices or disk)."""
    if device_map is None:
        return None
    if isinstance(device_map, (str, torch.device, int)) and device_map not in SINGLE_DEVICE_MAPS:
        return torch.device(device_map)
    if isinstance(device_map, dict):
        if not device_map:
            raise ValueError("from_pretrained: device_map is an empty dict; map module names to devices")
        places = {
            str(torch.device(v)) if not isinstance(v, str) or v != "disk" else "disk" for v in device_map.values()
        }
        return torch.device(places.pop()) if len(places) == 1 and "disk" not in places else None
    if isinstance(device_map, str):
        return None  # "auto" and the like: accelerate plans it
    raise TypeError(
        f"from_pretrained: device_map must be a device, one of {list(SINGLE_DEVICE_MAPS)} or a dict of module names "
        f"to devices, got {type(device_map).__name__}"
    )


def place_model(model: nn.Module, device_map, offload_folder: str | os.PathLike | None = None) -> nn.Module:
    """Puts a loaded model where ``device_map`` says: one device (moved), else accelerate's ``dispatch_model``.

    A string map (``"auto"``) is planned by accelerate's ``infer_auto_device_map``
    over the devices torch sees (the CPU alone on a CPU machine). Modules mapped
    to ``"disk"`` are written to ``offload_folder`` and their FP8 weights leave memory.
    """
    device = single_device(device_map) if device_map is not None else torch.device("cpu")
    if device is not None:
        return model if device.type == "cpu" else model.to(device)
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        raise ImportError("from_pretrained: a device_map that spreads the model needs accelerate") from None
    if isinstance(device_map, str):
        no_split = getattr(model, "_no_split_modules", None) or []
        device_map = infer_auto_device_map(model, no_split_module_classes=list(no_split))
        if single_device(device_map) is not None:
            return place_model(model, device_map)
    else:
        known = dict(model.named_modules())
        unknown = [name for name in device_map if name and name not in known]
        if unknown:
            raise ValueError(f"from_pretrained: device_map names module(s) the model does not have: {unknown[:5]}")
    if "disk" in device_map.values() and offload_folder is None:
        raise ValueError("from_pretrained: device_map offloads to 'disk'; pass offload_folder=<a folder for them>")
    model = dispatch_model(model, device_map=device_map, offload_dir=offload_folder)
    if "disk" in device_map.values():
        from qfp8.checkpoint.offload import offload_fp8_weights

        offload_fp8_weights(model, device_map, offload_folder)  # accelerate leaves the FP8 weights (buffers) in memory
    return model
