"""Routing: (device, dtypes, scheme, shape) -> the linear kernel that runs it.

Kernels register here with a predicate that says whether they take a given
request and, if not, why; ``select_kernel`` walks the kernels of the device
in priority order and falls back to the reference op, which takes
everything. Routing is decided once per module, at ``freeze``: the module
then keeps the packed weight and calls the chosen op directly.

``QFP8_KERNEL=reference`` in the environment forces the reference route
(used to compare kernels against the oracle end to end).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qfp8 import formats
from qfp8.library import ops  # noqa: F401  (defines torch.ops.qfp8.scaled_linear)

__all__ = [
    "KernelRequest",
    "LinearKernel",
    "REFERENCE_KERNEL",
    "dequantized_rows",
    "kernel_by_name",
    "register_kernel",
    "registered_kernels",
    "select_kernel",
]


@dataclass(frozen=True)
class KernelRequest:
    """What a linear layer asks of a kernel."""

    device: torch.device
    weight_dtype: torch.dtype
    granularity: str  # "tensor" | "channel" | "block"
    block_size: tuple[int, ...]  # () unless granularity == "block"
    activation: str  # "none" | "token" | "tensor" | "group" | "static"
    activation_dtype: torch.dtype
    out_features: int
    in_features: int
    x_dtype: torch.dtype | None = None  # the layer's activation dtype (None: not known)


@dataclass(frozen=True)
class LinearKernel:
    """A linear implementation and the weight layout it streams.

    ``op(x, weight, weight_scale, bias, input_scale, *extra_args(request))``
    computes the layer; ``pack`` turns a canonical ``[N, K]`` FP8 weight into
    the kernel's layout and ``unpack(packed, N, K)`` gives it back, bit-exact.
    ``supports`` returns None when the kernel takes the request, else the
    reason it does not (shown in the quantize report). ``eager_op``, when set,
    takes the same arguments as ``op`` and gives the same result with less
    per-call overhead in eager mode; it must itself hand any call that needs
    the dispatcher (modes, subclasses, autograd, profiling) to ``op``.
    """

    name: str
    op: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]
    unpack: Callable[[torch.Tensor, int, int], torch.Tensor]
    extra_args: Callable[[KernelRequest], tuple]
    supports: Callable[[KernelRequest], str | None] = field(default=lambda request: None)
    eager_op: Callable[..., torch.Tensor] | None = None
    # rows(packed, ids, N, K): rows ``ids`` (1-D int64) of the canonical weight, [len(ids), K], read
    # from the layout without unpacking the others (an embedding lookup); None: unpack, then index.
    rows: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None = None


def _identity_pack(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _identity_unpack(weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    return weight


REFERENCE_KERNEL = LinearKernel(
    name="reference",
    op=torch.ops.qfp8.scaled_linear,
    pack=_identity_pack,
    unpack=_identity_unpack,
    extra_args=lambda r: (list(r.block_size), r.activation, r.activation_dtype),
    rows=lambda packed, ids, out_features, in_features: packed.index_select(0, ids),
)

_KERNELS: dict[str, list[tuple[int, LinearKernel]]] = {}


def register_kernel(device_type: str, kernel: LinearKernel, priority: int = 0) -> None:
    """Adds ``kernel`` for ``device_type``; higher priority is tried first."""
    entries = [entry for entry in _KERNELS.get(device_type, []) if entry[1].name != kernel.name]
    entries.append((priority, kernel))
    entries.sort(key=lambda entry: -entry[0])
    _KERNELS[device_type] = entries


def registered_kernels(device_type: str) -> list[LinearKernel]:
    return [kernel for _, kernel in _KERNELS.get(device_type, [])]


def kernel_by_name(name: str) -> LinearKernel:
    """The registered kernel called ``name`` (the layout a weight is packed in)."""
    if name == REFERENCE_KERNEL.name:
        return REFERENCE_KERNEL
    for entries in _KERNELS.values():
        for _, kernel in entries:
            if kernel.name == name:
                return kernel
    raise ValueError(f"no linear kernel named {name!r} is registered; known: {sorted(_known_names())}")


def _known_names() -> set[str]:
    return {REFERENCE_KERNEL.name} | {k.name for entries in _KERNELS.values() for _, k in entries}


_WARNED_KERNEL_VALUES: set[str] = set()


def select_kernel(request: KernelRequest) -> tuple[LinearKernel, list[str]]:
    """The kernel for ``request`` and, for each better kernel passed over, why."""
    forced = os.environ.get("QFP8_KERNEL", "")
    if forced == "reference":
        return REFERENCE_KERNEL, ["QFP8_KERNEL=reference"]
    if forced and forced not in _WARNED_KERNEL_VALUES:
        _WARNED_KERNEL_VALUES.add(forced)
        warnings.warn(
            f"QFP8_KERNEL={forced!r} is not a setting qfp8 knows (only 'reference' forces a route); ignored",
            RuntimeWarning,
            stacklevel=2,
        )
    passed_over = []
    for kernel in registered_kernels(request.device.type):
        reason = kernel.supports(request)
        if reason is None:
            return kernel, passed_over
        passed_over.append(f"{kernel.name}: {reason}")
    return REFERENCE_KERNEL, passed_over


def dequantized_rows(
    packing: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block_size,
    ids: torch.Tensor,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the dequantized ``[N, K]`` weight held in ``packing``'s layout:
    ``[*ids.shape, K]`` in ``dtype``, the bits of ``formats.dequantize_weight(...)[ids]`` (the same
    float32 products), without unpacking the other rows. An embedding lookup of the FP8 weight."""
    flat = ids.reshape(-1)
    kernel = kernel_by_name(packing)
    if kernel.rows is not None:
        codes = kernel.rows(packed, flat, out_features, in_features)
    else:
        codes = kernel.unpack(packed, out_features, in_features).index_select(0, flat)
    values = formats.fp8_to_float(codes)
    if scale.numel() == 1:
        values = values * scale.reshape(())
    elif block_size:
        block_n, block_k = formats.fitted_block_size((out_features, in_features), block_size)
        row_scale = scale.index_select(0, flat // block_n).repeat_interleave(block_k, dim=1)
        values = values * row_scale[:, :in_features]
    else:
        values = values * scale.reshape(-1, 1).index_select(0, flat)
    return values.to(dtype).reshape(*ids.shape, in_features)
