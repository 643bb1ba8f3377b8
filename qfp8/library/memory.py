"""Process memory around quantizing and loading: what the allocator and file mappings keep after tensors go.

- :func:`return_freed_memory`: glibc keeps freed heap memory; ``malloc_trim`` gives it back.
- :func:`copy_out_of_file_mappings`: a model transformers loaded maps its safetensors files. Every tensor
  of a file keeps the whole mapping, and so every page read from it, resident: once ``quantize`` has
  replaced the Linears, the few float tensors left (a model's norms: kilobytes) would keep the whole bf16
  file resident beside the FP8 weights. Copied out, the mapping goes.
- :func:`release_large_frees`: for a process that streams tensors (the CLI), freed large blocks go back
  to the system at once instead of piling up in glibc's heap from shard to shard.
"""

from __future__ import annotations

import bisect
import ctypes

import torch
from torch import nn

__all__ = [
    "copy_out_of_file_mappings",
    "release_large_frees",
    "return_freed_memory",
]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def return_freed_memory() -> None:
    """Gives freed heap memory back to the system (glibc; nothing elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def release_large_frees(threshold: int = 1 << 20) -> None:
    """Serves allocations of ``threshold`` bytes and more by their own mappings, returned on free (glibc).

    For a whole process that streams tensors: it also stops glibc's adjusting of the threshold, so it is
    not for a library call inside a user's process."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


def _file_mapped_ranges() -> tuple[list[int], list[int]]:
    """Start and end addresses of this process's file-backed mappings, sorted by start (empty off Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return [], []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    ranges.sort()
    return [start for start, _ in ranges], [end for _, end in ranges]


def copy_out_of_file_mappings(model: nn.Module) -> int:
    """Replaces each CPU parameter and buffer of ``model`` whose memory lies in a file mapping by a copy in
    memory (the same Parameter object keeps its identity: its ``.data`` changes). Returns the bytes copied."""
    starts, ends = _file_mapped_ranges()
    if not starts:
        return 0

    def mapped(tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        address = tensor.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < ends[i]

    copied, done = 0, {}
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is None or id(param) in done or not mapped(param):
                    continue
                param.data = param.data.clone()
                done[id(param)] = (param, param)
                copied += param.nbytes
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if id(buffer) in done:  # one buffer held by several modules stays one
                    module._buffers[name] = done[id(buffer)][1]
                elif mapped(buffer):
                    done[id(buffer)] = (buffer, buffer.clone())  # the old one held: its id stays its own
                    module._buffers[name] = done[id(buffer)][1]
                    copied += buffer.nbytes
    return copied
