"""Disk offload of a QLinear's FP8 weight under accelerate's ``dispatch_model``.

accelerate offloads a module's parameters and persistent buffers; a QLinear's
FP8 weight (``qweight``, in its kernel's layout) is a non-persistent buffer,
rebuilt from the checkpoint form, which accelerate leaves in memory. For each
QLinear of a module mapped to ``"disk"``, :func:`offload_fp8_weights` writes
``qweight``'s bytes to a file of the offload folder and leaves a meta tensor in
its place; a hook maps the file before the layer's forward and drops the
mapping after it, so the weight is read from disk when the layer runs and is
not held in memory between calls.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from qfp8.nn import QLinear

__all__ = [
    "offload_fp8_weights",
]


def _on_disk(name: str, device_map: dict) -> bool:
    """Whether module ``name`` falls under a ``"disk"`` entry of ``device_map`` (the longest prefix decides)."""
    best = None
    for prefix in device_map:
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return best is not None and device_map[best] == "disk"


def offload_fp8_weights(model: nn.Module, device_map: dict, folder: str | os.PathLike) -> list[str]:
    """Moves the FP8 weight of every QLinear mapped to disk into ``folder`` (see the module docstring); returns their names."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class MapFromDisk(ModelHook):
        def __init__(self, path: Path, shape: torch.Size, dtype: torch.dtype):
            self.path, self.shape, self.dtype = path, shape, dtype

        def pre_forward(self, module, *args, **kwargs):
            count = self.shape.numel()
            stored = torch.from_file(str(self.path), shared=False, size=count, dtype=torch.uint8)
            module._buffers["qweight"] = stored.view(self.dtype).reshape(self.shape)
            return args, kwargs

        def post_forward(self, module, output):
            module._buffers["qweight"] = torch.empty(self.shape, dtype=self.dtype, device="meta")
            return output

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    moved = []
    for name, module in model.named_modules():
        if not isinstance(module, QLinear) or not _on_disk(name, device_map) or module.qweight.device.type == "meta":
            continue
        weight = module.qweight.detach().contiguous()
        path = folder / f"{name}.qfp8-weight.bin"
        weight.view(torch.uint8).numpy().tofile(path)
        # Chained after accelerate's hook (which is re-attached, and reads the buffers as they are, on the way).
        add_hook_to_module(module, MapFromDisk(path, weight.shape, weight.dtype), append=True)
        module._buffers["qweight"] = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        moved.append(name)
        del weight
    return moved
