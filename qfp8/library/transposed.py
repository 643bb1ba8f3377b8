"""The gradient of a linear op with respect to its input, on the compiled kernels: ``grad @ W`` with FP8 ``W``.

``y = x @ W^T`` with ``W = q * scale`` (``q`` FP8 ``[N, K]``) has
``grad_x = grad_y @ W``, which is itself a linear layer whose weight is
``q^T`` (``[K, N]``): the product the forward kernels compute, on the
transposed weight. Each scale kind carries over without any float copy of
the weight:

- tensor: the same scale;
- channel (one scale per output row ``n``): the scale multiplies the
  columns of ``grad_y`` (``grad_y * scale^T``, ``[M, N]``), and ``q^T``
  runs with a tensor scale (the largest scale, divided out of the first
  product);
- block (``[ceil(N/bn), ceil(K/bk)]``, blocks ``bn x bk``): the transposed
  scales are the blocks of ``q^T`` (``bk x bn``).

``q^T`` is packed once for the best kernel of the weight's device, at the
first backward through that weight, and kept while the weight tensor lives
(keyed by its identity; an in-place change of the weight, which bumps its
version counter, packs it again). That costs one more copy of the FP8
weight's bytes (plus the layout's padding) for each layer a backward has
run through; :func:`release` frees them. The product runs with W16
activations (``"none"``): with FP8 activations the gradient is the
straight-through one, as ``qfp8.library.autograd`` states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from qfp8 import formats
from qfp8.library.routing import KernelRequest, select_kernel

__all__ = [
    "cached_bytes",
    "grad_input",
    "release",
]


@dataclass
class _Packed:
    version: int
    x_dtype: torch.dtype
    op: Callable[..., torch.Tensor]  # the kernel's entry: its eager entry where it has one
    weight: torch.Tensor  # q^T in the kernel's layout
    extra_args: tuple
    # From the weight scales the last call used (kept while that tensor and its version stay): the tensor
    # scale of q^T, and for per-channel scales the factors grad's columns are multiplied by.
    scale: torch.Tensor | None = None
    scale_version: int = -1
    scale_t: torch.Tensor | None = None
    column_scale: torch.Tensor | None = None


# weight tensor (as the forward op holds it) -> its packed transpose.
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def release() -> None:
    """Frees every transposed weight kept for backward (the next backward through a layer packs it again)."""
    _CACHE.clear()


def cached_bytes() -> int:
    """Bytes held by the transposed weights kept for backward."""
    return sum(entry.weight.numel() * entry.weight.element_size() for entry in _CACHE.values())


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else weight._version  # inference tensors keep no version counter


def _packed(weight, unpack, n: int, k: int, block_size: list, x_dtype: torch.dtype) -> _Packed:
    """The packed ``q^T`` of ``weight`` (in its forward kernel's layout, unpacked by ``unpack``) for ``x_dtype``."""
    entry = _CACHE.get(weight)
    version = _version(weight)
    if entry is not None and entry.version == version and entry.x_dtype == x_dtype:
        return entry
    canonical = weight if unpack is None else unpack(weight, n, k)
    granularity = "block" if block_size else "tensor"
    request = KernelRequest(
        device=canonical.device,
        weight_dtype=canonical.dtype,
        granularity=granularity,
        block_size=tuple(reversed(block_size)),
        activation="none",
        activation_dtype=canonical.dtype,
        out_features=k,
        in_features=n,
        x_dtype=x_dtype,
    )
    kernel, _ = select_kernel(request)
    with torch.no_grad():
        packed_t = kernel.pack(canonical.t().contiguous())
    op = kernel.eager_op or (kernel.op.default if isinstance(kernel.op, torch._ops.OpOverloadPacket) else kernel.op)
    entry = _Packed(version, x_dtype, op, packed_t, tuple(kernel.extra_args(request)))
    _CACHE[weight] = entry
    return entry


def grad_input(
    grad: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    unpack,
    n: int,
    k: int,
    block_size: list,
) -> torch.Tensor:
    """``grad [M, N] @ dequant(weight) -> [M, K]`` through the linear kernel on the packed ``q^T``.

    ``weight`` is the FP8 weight as the forward op took it (``unpack(weight, n, k)`` gives the canonical
    ``[N, K]``; None when it is canonical), ``weight_scale`` its scales. The result is in
    ``grad``'s dtype (float32 for a ``grad`` of another dtype).
    """
    if grad.dtype not in formats.FLOAT_DTYPES:
        grad = grad.to(torch.float32)
    entry = _packed(weight, unpack, n, k, list(block_size), grad.dtype)
    if entry.scale is not weight_scale or entry.scale_version != _version(weight_scale):
        _set_scales(entry, weight_scale, n, bool(block_size))
    if entry.column_scale is not None:
        # Rounded once to grad's dtype: the kernel runs 16-bit inputs several times faster than float32 ones.
        grad = torch.mul(grad, entry.column_scale).to(grad.dtype)
    return entry.op(grad.contiguous(), entry.weight, entry.scale_t, None, None, *entry.extra_args)


def _set_scales(entry: _Packed, weight_scale: torch.Tensor, n: int, block: bool) -> None:
    """The scales of the product on q^T, from the layer's weight scales."""
    entry.scale, entry.scale_version, entry.column_scale = weight_scale, _version(weight_scale), None
    if block:
        entry.scale_t = weight_scale.t().contiguous()
    elif weight_scale.numel() == 1 or n == 1:
        entry.scale_t = weight_scale.reshape(1)
    else:
        # Per output row n: the scales over their largest multiply grad's columns (the largest divided out
        # keeps small scales clear of float16's subnormals) and the largest is q^T's tensor scale.
        entry.scale_t = weight_scale.amax().reshape(1)
        entry.column_scale = weight_scale.reshape(1, n) / entry.scale_t
