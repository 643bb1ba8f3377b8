"""Dropping the resident pages of tensors that view a memory-mapped checkpoint file."""

from __future__ import annotations

import torch

from qfp8.nn import QLinear

__all__ = ["release_if_copied", "release_pages"]


def release_pages(tensor: torch.Tensor) -> None:
    """Drops the resident pages of a tensor that views a private file mapping (re-read from the file if used).

    ``madvise(MADV_DONTNEED)`` on whole pages inside the tensor's bytes; a
    no-op where libc or madvise is not available.
    """
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


def release_if_copied(module: QLinear, stored: torch.Tensor) -> None:
    """Drops the pages of ``stored`` (a tensor mapped from a checkpoint file, never one a caller holds:
    ``MADV_DONTNEED`` zeroes anonymous memory) once the kernel has packed its own copy."""
    if module.qweight.untyped_storage().data_ptr() != stored.untyped_storage().data_ptr():
        release_pages(stored)
