"""CPU kernel ops: FP8 linear on pre-packed weights (qfp8/ext/cpu).

Importing this module defines

- ``qfp8::pack_weight_cpu(Tensor weight) -> Tensor``: canonical FP8 ``[N, K]``
  to the kernel layout (same dtype): ``[ceil(N/32), ceil(K/2), 64]`` with
  ``packed[t, p, 2c + j] = weight[32t + c, 2p + j]``, zero padded; see
  ``qfp8/ext/cpu/kernel.h``;
- ``qfp8::unpack_weight_cpu(Tensor packed, int out_features, int in_features)``,
  its bitwise inverse;
- ``qfp8::scaled_linear_cpu(x, packed_weight, weight_scale, bias, input_scale,
  out_features, in_features, block_size, activation, activation_dtype)``, with
  the semantics of the reference ``torch.ops.qfp8.scaled_linear``,

with fake implementations for ``torch.compile``, and registers the kernel in
the routing table for CPU. The op checks its arguments cheaply in C++ on
every call (errors name the sizes); :func:`check_linear_args` is the full
validation, raising ``ValueError`` that names the sizes, that callers run once (at
freeze) before calling the op directly.

ISA: the best variant this CPU and build support (amx > avx512bf16 > avx512
> avx2 > scalar) is picked at import; avx512bf16 (FP8 -> bf16 by table lookup,
``vdpbf16ps`` products) also needs AVX512-VBMI; amx (the same conversion into
bf16 tiles multiplied by ``tdpbf16ps``) also needs AMX-BF16 and the OS's grant
of the tile state.
``QFP8_CPU_ISA=scalar|avx2|avx512|avx512bf16|amx``
forces one; forcing one the CPU or build lacks warns and keeps the best
supported one (a model still runs). :func:`set_cpu_kernel_isa` does the same
but raises ``ValueError``. If the extension is missing, ``scaled_linear_cpu``
still works (it unpacks and runs the reference op) but is not registered
for routing, so quantized models take the reference route.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch

from qfp8 import formats
from qfp8.ext import load_cpu_extension
from qfp8.library import (
    autograd,
    experts,
    ops,  # noqa: F401  (defines torch.ops.qfp8.scaled_linear)
)
from qfp8.library.ops import ACTIVATION_MODES
from qfp8.library.routing import KernelRequest, LinearKernel, register_kernel

__all__ = [
    "EMULATED_ISAS",
    "HUGEPAGE_MIN_BYTES",
    "ISAS",
    "KERNEL_VERIFIED",
    "SELF_CHECK_TOLERANCE",
    "TILE_N",
    "check_linear_args",
    "compiled_isas",
    "cpu_kernel_isa",
    "cpu_kernel_isa_forced",
    "emulated_isas",
    "packed_shape",
    "scaled_linear_cpu",
    "set_cpu_kernel_isa",
    "usable_isas",
    "verify_cpu_kernel_isa",
]

TILE_N = 32  # output channels per packed tile
ISAS = ("amx", "avx512bf16", "avx512", "avx2", "scalar")
# Test-only variants, never chosen automatically: "avx512emu" is the AVX512
# kernel's code with each 512-bit intrinsic done on two AVX2 halves, so that
# the tests run that code (bitwise its results) on CPUs without AVX512.
EMULATED_ISAS = ("avx512emu",)

torch.library.define("qfp8::pack_weight_cpu", "(Tensor weight) -> Tensor")
torch.library.define("qfp8::unpack_weight_cpu", "(Tensor packed, int out_features, int in_features) -> Tensor")
torch.library.define(
    "qfp8::scaled_linear_cpu",
    "(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, Tensor? input_scale, int out_features, "
    "int in_features, int[] block_size, str activation, ScalarType activation_dtype) -> Tensor",
)


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """Shape of the packed weight of an ``[out_features, in_features]`` layer."""
    return (math.ceil(out_features / TILE_N), math.ceil(in_features / 2), 2 * TILE_N)


def _check_fp8(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in formats.FP8_DTYPES.values():
        raise TypeError(f"{what} must be an FP8 tensor, got {tensor.dtype}")


@torch.library.impl("qfp8::pack_weight_cpu", "CPU")
def _pack_weight_cpu(weight: torch.Tensor) -> torch.Tensor:
    _check_fp8(weight, "qfp8::pack_weight_cpu: weight")
    if weight.dim() != 2:
        raise ValueError(f"qfp8::pack_weight_cpu: weight must be [N, K], got shape {list(weight.shape)}")
    n, k = weight.shape
    tiles, pairs, _ = packed_shape(n, k)
    padded = torch.zeros(tiles * TILE_N, 2 * pairs, dtype=torch.uint8)
    padded[:n, :k] = weight.view(torch.uint8)
    packed = _packed_buffer(tiles * pairs * 2 * TILE_N).view(tiles, pairs, TILE_N, 2)
    packed.copy_(padded.view(tiles, TILE_N, pairs, 2).permute(0, 2, 1, 3))
    return packed.view(tiles, pairs, 2 * TILE_N).view(weight.dtype)


HUGEPAGE_MIN_BYTES = 2 << 20  # a packed weight of at least one 2 MiB page is backed by huge pages where THP allows


def _packed_buffer(nbytes: int) -> torch.Tensor:
    """Uninitialised uint8 storage for a packed weight.

    The kernels stream the whole packed weight at every call. From one huge
    page up, the buffer comes from the extension's 2 MiB-aligned allocator,
    advised for transparent huge pages (fewer TLB misses, prefetchers not
    stopped every 4 KiB; docs/cpu-kernels.md). Smaller weights, or a build without the extension,
    use torch's allocator.
    """
    if _EXTENSION is not None and nbytes >= HUGEPAGE_MIN_BYTES:
        return torch.ops.qfp8._cpu_empty_hugepage(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


@torch.library.impl("qfp8::unpack_weight_cpu", "CPU")
def _unpack_weight_cpu(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    _check_fp8(packed, "qfp8::unpack_weight_cpu: packed")
    if out_features < 1 or in_features < 1:
        raise ValueError(f"qfp8::unpack_weight_cpu: sizes must be positive, got [{out_features}, {in_features}]")
    tiles, pairs, _ = packed_shape(out_features, in_features)
    if tuple(packed.shape) != packed_shape(out_features, in_features):
        raise ValueError(
            f"qfp8::unpack_weight_cpu: a packed [{out_features}, {in_features}] weight has shape "
            f"{list(packed_shape(out_features, in_features))}, got {list(packed.shape)}"
        )
    grouped = packed.view(torch.uint8).view(tiles, pairs, TILE_N, 2).permute(0, 2, 1, 3)
    full = grouped.reshape(tiles * TILE_N, 2 * pairs)
    return full[:out_features, :in_features].clone().view(packed.dtype)


@torch.library.register_fake("qfp8::pack_weight_cpu")
def _(weight):
    return weight.new_empty(packed_shape(weight.shape[0], weight.shape[1]))


@torch.library.register_fake("qfp8::unpack_weight_cpu")
def _(packed, out_features, in_features):
    return packed.new_empty((out_features, in_features))


@torch.library.register_fake("qfp8::scaled_linear_cpu")
def _(x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, block_size, activation, dtype):
    return x.new_empty((*x.shape[:-1], out_features))


def _eager_fallback(*args):
    """Every call the eager entry hands back: the op, through autograd.linear when a gradient is needed."""
    op = torch.ops.qfp8.scaled_linear_cpu.default
    if len(args) == 10 and isinstance(args[0], torch.Tensor):
        with torch._C.DisableTorchFunction():  # the check is no call a torch function mode should see
            grad = autograd.needs_grad(args[0], args[3] if isinstance(args[3], torch.Tensor) else None)
        if grad:
            return autograd.linear(op, torch.ops.qfp8.unpack_weight_cpu.default, *args)
    return op(*args)


def _differentiable(*args):
    """A call of the op that needs a gradient, sent here by its Autograd kernel: the op under autograd.linear."""
    op, unpack = torch.ops.qfp8.scaled_linear_cpu.default, torch.ops.qfp8.unpack_weight_cpu.default
    return autograd.apply_linear(op, unpack, *args)


_EXTENSION = load_cpu_extension()
if _EXTENSION is not None:
    # QLinear's eager fast path calls qfp8._C.scaled_linear_cpu_eager, which
    # parses its arguments itself (cheaper than torch.ops' boxing)
    # and hands any call that needs the dispatcher to the op.
    _EXTENSION._set_eager_fallback(_eager_fallback, torch.nn.Parameter)
    # The extension's Autograd kernel of these ops sends each call that needs
    # a gradient here (a graph torch.export traced calls the ops directly).
    _EXTENSION._set_differentiable("qfp8::scaled_linear_cpu", _differentiable)
    _EXTENSION._set_differentiable("qfp8::experts_linear", experts.apply_differentiable)

if _EXTENSION is None:
    # No compiled kernel: the op still has its meaning (unpack, then the
    # reference op), so direct callers and tests keep working.
    @torch.library.impl("qfp8::scaled_linear_cpu", "CPU")
    def _scaled_linear_cpu_reference(
        x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, block_size, activation, dtype
    ):
        weight = _unpack_weight_cpu(packed_weight, out_features, in_features)
        return torch.ops.qfp8.scaled_linear(x, weight, weight_scale, bias, input_scale, block_size, activation, dtype)

    # Without the extension's Autograd kernel, direct calls that need a
    # gradient get the formulas as Python autograd kernels (nothing here is
    # fast enough for their cost per call to matter).
    autograd.register_backward("qfp8::scaled_linear_cpu", torch.ops.qfp8.unpack_weight_cpu.default)
    experts.register_backward()


def usable_isas() -> list[str]:
    """ISAs compiled into this build that this CPU runs, best first (["scalar"] at least)."""
    if _EXTENSION is None:
        return []
    return list(torch.ops.qfp8._cpu_usable_isas())


def compiled_isas() -> list[str]:
    if _EXTENSION is None:
        return []
    return list(torch.ops.qfp8._cpu_compiled_isas())


def emulated_isas() -> list[str]:
    """Test-only variants (see ``EMULATED_ISAS``) this build and CPU run."""
    if _EXTENSION is None:
        return []
    return list(torch.ops.qfp8._cpu_emulated_isas())


def cpu_kernel_isa() -> str | None:
    """The ISA the CPU kernel runs with now ("avx2", ...), or None without the extension."""
    if _EXTENSION is None:
        return None
    return str(torch.ops.qfp8._cpu_get_isa())


def set_cpu_kernel_isa(isa: str) -> None:
    """Makes every later call use ``isa``; ``ValueError`` if unknown or not runnable here.

    The test-only ``EMULATED_ISAS`` are accepted too where they run.
    """
    if isa not in ISAS + EMULATED_ISAS:
        raise ValueError(f"unknown CPU kernel ISA {isa!r}; expected one of {ISAS}")
    if _EXTENSION is None:
        raise ValueError("the qfp8 CPU extension is not loaded; no CPU kernel ISA can be selected")
    if isa in EMULATED_ISAS:
        if isa not in emulated_isas():
            raise ValueError(f"the test-only CPU kernel variant {isa!r} does not run here (it needs AVX2)")
        torch.ops.qfp8._cpu_set_isa(isa)
        return
    usable = usable_isas()
    if isa not in usable:
        why = "was not compiled into this build" if isa not in compiled_isas() else "is not supported by this CPU"
        raise ValueError(f"CPU kernel ISA {isa!r} {why}; usable here: {usable}")
    torch.ops.qfp8._cpu_set_isa(isa)


@contextlib.contextmanager
def cpu_kernel_isa_forced(isa: str):
    """Runs the block with ``isa`` selected (tests), then restores the previous one."""
    previous = cpu_kernel_isa()
    set_cpu_kernel_isa(isa)
    try:
        yield
    finally:
        torch.ops.qfp8._cpu_set_isa(previous)


def _apply_isa_environment() -> None:
    requested = os.environ.get("QFP8_CPU_ISA", "").strip().lower()
    if not requested or _EXTENSION is None:
        return
    try:
        set_cpu_kernel_isa(requested)
    except ValueError as error:
        warnings.warn(f"QFP8_CPU_ISA={requested}: {error}; using {cpu_kernel_isa()}", RuntimeWarning, stacklevel=2)


_apply_isa_environment()


# ------------------------------------------------------------ self-check
#
# The tests run every variant the test machine supports, and a build can
# meet a CPU (or compiler) its tests never ran on. So at import the variant
# picked for this CPU runs small problems through every code path it has and
# is compared with the reference op's math; one that disagrees is not used
# (one warning, then the next variant down). It costs a few to tens of
# milliseconds once per process.

# Relative L2 error of the output: float32 outputs differ from the float64
# reference only by the sum order, bf16 / fp16 ones also by the final
# rounding; a wrong lane, tail or conversion gives errors of order 1.
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _self_check_cases():
    """(x, weight, scale, bias, input_scale, block_size, activation, fp8 dtype) reaching every kernel path.

    Each FP8 format x each scale kind (tensor, channel, block with an even
    and an odd k block) runs M = 1 (the streamed row), M = 3 (a few rows at
    once) and M = 9 (the converted panel: one full register block of rows
    and a tail, for 6- and 8-row blocks alike); the activation modes and the
    dtype of x cycle with periods (7 and 4) prime to the 3 of M, so that
    every mode meets every M. N and K have tails.
    """
    generator = torch.Generator().manual_seed(20261130)
    n, k = 45, 37
    # Explicit device and dtype: the check runs at import, under whatever
    # torch.set_default_device / set_default_dtype the user has set.
    cpu32 = {"device": "cpu", "dtype": torch.float32, "generator": generator}
    granularities = (("tensor", ()), ("channel", ()), ("block", (16, 10)), ("block", (16, 5)))
    activations = ("none", "token", "static", "none", "tensor", "token-mse", "group")
    x_dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float16)
    cases, turn = [], 0
    for dtype in formats.FP8_DTYPES.values():
        for granularity, block_size in granularities:
            w = torch.randn(n, k, **cpu32) * torch.rand(n, 1, **cpu32).add(0.1)
            q, scale = formats.quantize_weight(w, dtype, granularity, block_size or formats.DEFAULT_BLOCK_SIZE)
            bias = torch.randn(n, **cpu32) if turn % 2 else None
            for m in (1, 3, 9):
                x = torch.randn(m, k, **cpu32).to(x_dtypes[turn % len(x_dtypes)])
                input_scale = formats.scale_from_amax(x.float().abs().amax().reshape(1), dtype)
                activation = activations[turn % len(activations)]
                cases.append((x, q, scale, bias, input_scale, list(block_size), activation, dtype))
                turn += 1
    return cases


def verify_cpu_kernel_isa(isa: str) -> str | None:
    """Runs the ``isa`` variant on :func:`_self_check_cases` against the reference op's math in float64.

    Returns None when every output agrees within ``SELF_CHECK_TOLERANCE``
    (for the dtype of x), else a description of the first case that does not
    (or of the error it raised). The previously selected variant is restored.
    """
    if _EXTENSION is None:
        raise ValueError("the qfp8 CPU extension is not loaded; there is no CPU kernel to check")
    with torch.no_grad(), cpu_kernel_isa_forced(isa):
        for x, q, scale, bias, input_scale, block_size, activation, dtype in _self_check_cases():
            n, k = q.shape
            what = (
                f"M={x.shape[0]}, N={n}, K={k}, x {x.dtype}, weight {dtype}, scale {tuple(scale.shape)}, "
                f"block_size={block_size}, activation={activation!r}"
            )
            args = (scale, bias, input_scale)
            try:
                got = _kernel_op(x, torch.ops.qfp8.pack_weight_cpu(q), *args, n, k, block_size, activation, dtype)
            except Exception as error:  # a kernel that raises on valid input is as unusable as a wrong one
                return f"{what}: raised {type(error).__name__}: {error}"
            # The reference op's math in float64, as a broadcast product: a
            # BLAS call may wake a thread pool, which costs more than the check.
            x_values = ops.reference_activation(x, activation, dtype, input_scale).double()
            w = formats.dequantize_weight(q, scale, block_size or None).double()
            want = (x_values[:, None, :] * w[None]).sum(-1) + (0.0 if bias is None else bias.double())
            error = (got.double() - want).norm() / want.norm()
            if not bool(torch.isfinite(error)) or error > SELF_CHECK_TOLERANCE[x.dtype]:
                return f"{what}: relative error {float(error):.3g} against the reference op"
    return None


def _kernel_op(*args):
    return torch.ops.qfp8.scaled_linear_cpu(*args)


def _use_verified_isa() -> bool:
    """Keeps the selected variant if it passes the self-check, else steps down; False if none passes."""
    while True:
        isa = cpu_kernel_isa()
        problem = verify_cpu_kernel_isa(isa)
        if problem is None:
            return True
        below = usable_isas()[usable_isas().index(isa) + 1 :]
        fallback = below[0] if below else "the reference op (no CPU kernel)"
        warnings.warn(
            f"qfp8: the {isa} CPU kernel disagrees with the reference op on this machine ({problem}); "
            f"using {fallback} instead. Please report this with your CPU model.",
            RuntimeWarning,
            stacklevel=2,
        )
        if not below:
            return False
        torch.ops.qfp8._cpu_set_isa(below[0])


KERNEL_VERIFIED = _EXTENSION is not None and _use_verified_isa()


# ------------------------------------------------------------ validation


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_linear_args(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out_features: int,
    in_features: int,
    block_size,
    activation: str,
    activation_dtype: torch.dtype,
) -> None:
    """Full validation of ``scaled_linear_cpu`` arguments; raises ValueError naming the sizes."""
    n, k = out_features, in_features
    if not isinstance(n, int) or not isinstance(k, int) or n < 1 or k < 1:
        raise ValueError(f"out_features and in_features must be positive ints, got {n!r} and {k!r}")
    tensors = {"x": x, "packed_weight": packed_weight, "weight_scale": weight_scale}
    if bias is not None:
        tensors["bias"] = bias
    if input_scale is not None:
        tensors["input_scale"] = input_scale
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU for the CPU kernel, got {_describe(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got {_describe(t)} with strides {t.stride()}")
    if x.dtype not in formats.FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {_describe(x)}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {_describe(x)} but the layer has in_features={k} (out_features={n})")
    if packed_weight.dtype not in formats.FP8_DTYPES.values():
        raise ValueError(f"packed_weight must be an FP8 tensor, got {_describe(packed_weight)}")
    expected = packed_shape(n, k)
    if tuple(packed_weight.shape) != expected:
        raise ValueError(
            f"packed_weight has {_describe(packed_weight)}, expected shape {expected} for out_features={n}, "
            f"in_features={k}; pack the [N, K] weight with torch.ops.qfp8.pack_weight_cpu"
        )
    if weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32, got {_describe(weight_scale)}")
    block_size = list(block_size)
    if block_size:
        if len(block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in block_size):
            raise ValueError(f"block_size must be [bn, bk] of positive ints or [], got {block_size}")
        expected_scale = formats.block_scale_shape((n, k), tuple(block_size))
        if tuple(weight_scale.shape) != expected_scale:
            raise ValueError(
                f"block weight_scale has {_describe(weight_scale)}, expected {expected_scale} for "
                f"out_features={n}, in_features={k}, block_size={block_size}"
            )
    elif weight_scale.numel() != 1 and tuple(weight_scale.shape) != (n, 1):
        raise ValueError(f"weight_scale has {_describe(weight_scale)}, expected [1] or [{n}, 1] (out_features={n})")
    if bias is not None:
        if bias.dtype not in formats.FLOAT_DTYPES:
            raise ValueError(f"bias must be float32, bfloat16 or float16, got {_describe(bias)}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has {_describe(bias)}, expected [{n}] (out_features={n})")
    if activation not in ACTIVATION_MODES:
        raise ValueError(f"unknown activation mode {activation!r}; expected one of {ACTIVATION_MODES}")
    if activation != "none" and activation_dtype not in formats.FP8_DTYPES.values():
        raise ValueError(f"activation_dtype must be an FP8 dtype for activation={activation!r}, got {activation_dtype}")
    if activation == "static":
        if input_scale is None or input_scale.numel() != 1 or input_scale.dtype != torch.float32:
            got = "None" if input_scale is None else _describe(input_scale)
            raise ValueError(f"activation='static' needs a float32 input_scale of shape [1], got {got}")


def scaled_linear_cpu(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out_features: int,
    in_features: int,
    block_size=(),
    activation: str = "none",
    activation_dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """Validates with :func:`check_linear_args`, then runs ``torch.ops.qfp8.scaled_linear_cpu``."""
    args = (x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, list(block_size))
    check_linear_args(*args, activation, activation_dtype)
    return torch.ops.qfp8.scaled_linear_cpu(*args, activation, activation_dtype)


# --------------------------------------------------------------- routing


def _supports(request: KernelRequest) -> str | None:
    if request.device.type != "cpu":
        return f"device {request.device} is not the CPU"
    if request.weight_dtype not in formats.FP8_DTYPES.values():
        return f"weight dtype {request.weight_dtype} is not FP8"
    if request.activation not in ACTIVATION_MODES:
        return f"activation mode {request.activation!r} is not supported"
    if request.x_dtype is not None and request.x_dtype not in formats.FLOAT_DTYPES:
        return f"activations in {request.x_dtype}: the CPU kernel takes float32, bfloat16 and float16"
    if request.granularity == "block" and len(request.block_size) != 2:
        return f"block scales need block_size [bn, bk], got {request.block_size}"
    return None


def _packed_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the canonical weight from the CPU layout (``packed[t][p][2 c + j] = W[32 t + c][2 p + j]``,
    see kernel.h): ``[len(ids), K]``, the same FP8 codes ``unpack`` gives for those rows."""
    tiles, pairs, _ = packed.shape
    lanes = packed.view(torch.uint8).view(tiles, pairs, 32, 2)
    rows = lanes[ids // 32, :, ids % 32]  # [len(ids), pairs, 2]: the two indices, apart, lead
    return rows.reshape(ids.numel(), 2 * pairs)[:, :in_features].view(packed.dtype)


if KERNEL_VERIFIED:
    register_kernel(
        "cpu",
        LinearKernel(
            name=f"cpu-{cpu_kernel_isa()}",
            op=torch.ops.qfp8.scaled_linear_cpu,
            eager_op=_EXTENSION.scaled_linear_cpu_eager,
            pack=torch.ops.qfp8.pack_weight_cpu,
            unpack=torch.ops.qfp8.unpack_weight_cpu,
            extra_args=lambda r: (r.out_features, r.in_features, list(r.block_size), r.activation, r.activation_dtype),
            supports=_supports,
            rows=_packed_rows,
        ),
        priority=10,
    )
