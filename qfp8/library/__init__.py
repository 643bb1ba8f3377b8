"""Ops on plain tensors: schemas, reference and fake implementations, routing.

Importing this package defines every ``torch.ops.qfp8.*`` op and registers
the compiled kernels that could be loaded for this machine.
"""

from qfp8.library import ops  # noqa: F401  (defines torch.ops.qfp8.scaled_linear)
from qfp8.library.routing import KernelRequest, LinearKernel, kernel_by_name, register_kernel, select_kernel

__all__ = ["KernelRequest", "LinearKernel", "kernel_by_name", "register_kernel", "select_kernel"]
