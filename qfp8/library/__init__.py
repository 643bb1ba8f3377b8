"""Ops on plain tensors: schemas, reference and fake implementations, routing.

Importing this package defines every ``torch.ops.qfp8.*`` op and registers
the compiled kernels that could be loaded for this machine.
"""

from qfp8.library import (
    attention,  # noqa: F401  (defines torch.ops.qfp8.fp8_decode_attention)
    conv_cpu,  # noqa: F401  (the fake implementation of torch.ops.qfp8.scaled_conv_cpu, where qfp8._C defines it)
    experts,  # noqa: F401  (defines torch.ops.qfp8.experts_linear)
    ops,  # noqa: F401  (defines torch.ops.qfp8.scaled_linear)
)
from qfp8.library.routing import KernelRequest, LinearKernel, kernel_by_name, register_kernel, select_kernel

try:  # registers the CPU kernel when qfp8._C is built (cpu.py itself falls back if the extension is missing)
    from qfp8.library import cpu  # noqa: F401
except ModuleNotFoundError as error:  # a source tree without the CPU kernel module: reference route only
    if error.name != "qfp8.library.cpu":
        raise

try:  # defines the CUDA ops and registers the CUDA routes; touches no GPU until a layer is packed for one
    from qfp8.library import cuda  # noqa: F401
except ModuleNotFoundError as error:  # a source tree without the CUDA route module
    if error.name != "qfp8.library.cuda":
        raise

from qfp8.library.autograd import register_backward  # noqa: E402

register_backward("qfp8::scaled_linear")

__all__ = ["KernelRequest", "LinearKernel", "kernel_by_name", "register_kernel", "select_kernel"]
