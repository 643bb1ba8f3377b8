"""CUDA routes of the FP8 linear: ``torch._scaled_mm`` and qfp8's weight-only kernel.

Importing this module defines the ops below (schemas, fake implementations
for ``torch.compile``, and implementations that need no GPU) and registers
three kernels for device ``"cuda"`` in :mod:`qfp8.library.routing`. Nothing
here touches CUDA at import: whether a kernel takes a layer is decided at
``freeze``/pack time by its ``supports`` predicate (GPU capability, shape,
scheme, whether the CUDA extension is built, ``QFP8_CUDA_KERNELS``).

Routes, best first (docs/design.md):

- ``cuda-scaled-mm``: W8A8 (``activation`` token/tensor/static) on sm89+,
  FP8 x FP8 on tensor cores via ``torch._scaled_mm`` with float32
  tensorwise scales (tensor weight scale and tensor/static activations) or
  rowwise scales (per-channel weights or per-token activations, sm90+). K and N
  multiples of 16. The weight is stored ``[N, K]`` as is.
- ``cuda-scaled-mm-padded16``: the same for K or N not a multiple of 16: the
  weight is zero padded to multiples of 16 once at pack time, activations are
  padded per call (their quantized copy is made anyway) and the output is cut
  back to N. Its name in the quantize report says that padding happened.
- ``cuda-fp8-marlin``: qfp8's weight-only kernel (``qfp8/ext/cuda``) on sm80+,
  fp16/bf16 activations, tensor/channel/block scales (block ``bk`` a multiple of
  32), weights packed by :func:`pack_weight_cuda`. W8A8 layers that
  ``_scaled_mm`` cannot take (sm80-86, group activations, block scales, fnuz)
  run it on quantize-dequantized activations. M >= ``LARGE_M`` rows: the
  weight is dequantized once by a CUDA kernel and cuBLAS does the matmul
  (compute-bound there). float32 activations take the reference op.
- anything else: the reference op (routing's fallback).

The qfp8 CUDA routes are OFF by default: they have not yet run on a GPU in
this project (``bench/gpu_check.py`` has not passed and no results are under
``bench/results/``). ``QFP8_CUDA_KERNELS=1`` turns them on. The reason each is
passed over appears in ``QLinear.kernel_notes``.

W8A16 layers on sm89+ with large M keep W8A16 numerics (dequantize + cuBLAS)
rather than quantizing activations for ``_scaled_mm``: that would add FP8
activation error the user did not ask for.
"""

from __future__ import annotations

import importlib
import math
import os

import torch
import torch.nn.functional as F

from qfp8 import formats
from qfp8.library import (
    autograd,
    ops,  # noqa: F401  (defines torch.ops.qfp8.scaled_linear)
)
from qfp8.library.ops import ACTIVATION_MODES, reference_activation
from qfp8.library.routing import KernelRequest, LinearKernel, register_kernel

__all__ = [
    "CUDA_KERNELS_ENV",
    "HALF_DTYPES",
    "LARGE_M",
    "MARLIN_KERNEL",
    "MARLIN_MIN_CAPABILITY",
    "ROWWISE_MIN_CAPABILITY",
    "SCALED_MM_ALIGN",
    "SCALED_MM_KERNEL",
    "SCALED_MM_MIN_CAPABILITY",
    "SCALED_MM_PADDED_KERNEL",
    "SCALED_MM_WEIGHT_DTYPES",
    "TILE_BYTES",
    "TILE_K",
    "TILE_N",
    "cuda_extension_loaded",
    "cuda_kernels_enabled",
    "device_capability",
    "load_cuda_extension",
    "pack_weight_cuda",
    "pack_weight_scaled_mm",
    "packed_shape",
    "quantize_for_scaled_mm",
    "scaled_mm_scales",
    "unpack_weight_cuda",
    "unpack_weight_scaled_mm",
]

CUDA_KERNELS_ENV = "QFP8_CUDA_KERNELS"
TILE_N = 32  # packed tile: 32 output channels x 32 input channels (qfp8/ext/cuda/fp8_layout.cuh)
TILE_K = 32
TILE_BYTES = TILE_N * TILE_K
SCALED_MM_ALIGN = 16  # _scaled_mm needs K and N multiples of 16
LARGE_M = 512  # from this many rows, W8A16 = dequantize once + cuBLAS
MARLIN_MIN_CAPABILITY = (8, 0)
SCALED_MM_MIN_CAPABILITY = (8, 9)
# Rowwise scales in _scaled_mm are certain on sm90 (CUTLASS); recent torch
# also has them on sm89, not yet checked here (bench/gpu_check.py reports).
ROWWISE_MIN_CAPABILITY = (9, 0)
SCALED_MM_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def cuda_kernels_enabled() -> bool:
    """Whether ``QFP8_CUDA_KERNELS=1`` turns the qfp8 CUDA routes on (read at routing time)."""
    return os.environ.get(CUDA_KERNELS_ENV, "").strip() == "1"


# ------------------------------------------------------------- packing


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """Shape of the packed weight: ``[ceil(N/32), ceil(K/32), 1024]``."""
    return (math.ceil(out_features / TILE_N), math.ceil(in_features / TILE_K), TILE_BYTES)


@torch.library.custom_op("qfp8::pack_weight_cuda", mutates_args=())
def pack_weight_cuda(weight: torch.Tensor) -> torch.Tensor:
    """Canonical FP8 ``[N, K]`` to the weight-only kernel's layout (any device).

    ``packed[nt, kt, 32 * (4 g + t) + 16 s + 4 j + e] = weight[32 nt + 8 j + g, 32 kt + 8 t + 4 s + e]``,
    zero padded (``fp8_layout.cuh`` explains why); ``qfp8::cuda_pack_weight_host``
    is the same map computed byte by byte in C++.
    """
    n, k = weight.shape
    nt, kt, _ = packed_shape(n, k)
    padded = torch.zeros(nt * TILE_N, kt * TILE_K, dtype=torch.uint8, device=weight.device)
    padded[:n, :k] = weight.view(torch.uint8)
    # n = 32 nt + 8 j + g, k = 32 kt + 8 t + 4 s + e  ->  [nt, kt, g, t, s, j, e]
    tiles = padded.view(nt, 4, 8, kt, 4, 2, 4).permute(0, 3, 2, 4, 5, 1, 6)
    return tiles.reshape(nt, kt, TILE_BYTES).view(weight.dtype)


@pack_weight_cuda.register_fake
def _(weight):
    return weight.new_empty(packed_shape(weight.shape[0], weight.shape[1]))


@torch.library.custom_op("qfp8::unpack_weight_cuda", mutates_args=())
def unpack_weight_cuda(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_weight_cuda`, bit-exact."""
    nt, kt, _ = packed_shape(out_features, in_features)
    tiles = packed.view(torch.uint8).reshape(nt, kt, 8, 4, 2, 4, 4)  # [nt, kt, g, t, s, j, e]
    full = tiles.permute(0, 5, 2, 1, 3, 4, 6).reshape(nt * TILE_N, kt * TILE_K)
    return full[:out_features, :in_features].contiguous().view(packed.dtype)


@unpack_weight_cuda.register_fake
def _(packed, out_features, in_features):
    return packed.new_empty((out_features, in_features))


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@torch.library.custom_op("qfp8::pack_weight_scaled_mm", mutates_args=())
def pack_weight_scaled_mm(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` zero padded to multiples of 16 (``_scaled_mm`` reads its transpose)."""
    n, k = weight.shape
    padded = torch.zeros(
        _round_up(n, SCALED_MM_ALIGN), _round_up(k, SCALED_MM_ALIGN), dtype=torch.uint8, device=weight.device
    )
    padded[:n, :k] = weight.view(torch.uint8)
    return padded.view(weight.dtype)


@pack_weight_scaled_mm.register_fake
def _(weight):
    n, k = weight.shape
    return weight.new_empty((_round_up(n, SCALED_MM_ALIGN), _round_up(k, SCALED_MM_ALIGN)))


@torch.library.custom_op("qfp8::unpack_weight_scaled_mm", mutates_args=())
def unpack_weight_scaled_mm(weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    return weight[:out_features, :in_features].clone(memory_format=torch.contiguous_format)


@unpack_weight_scaled_mm.register_fake
def _(weight, out_features, in_features):
    return weight.new_empty((out_features, in_features))


# ------------------------------------------------- kernel entry points
# Implemented for CUDA by qfp8/ext/cuda/binding.cpp. The CPU implementations
# below are emulations with the same contract (the "emulated kernel"), so the
# Python around them is tested on machines without a GPU.

torch.library.define(
    "qfp8::_fp8_linear_cuda",
    "(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, int out_features, int in_features, "
    "int[] block_size) -> Tensor",
)
torch.library.define(
    "qfp8::_fp8_dequantize_packed_cuda",
    "(Tensor packed_weight, Tensor weight_scale, int out_features, int in_features, int[] block_size, "
    "ScalarType dtype) -> Tensor",
)
torch.library.define(
    "qfp8::_fp8_codes_to_half_bits_cuda", "(Tensor codes, ScalarType fp8_dtype, ScalarType half_dtype) -> Tensor"
)


@torch.library.register_fake("qfp8::_fp8_linear_cuda")
def _(x, packed_weight, weight_scale, bias, out_features, in_features, block_size):
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("qfp8::_fp8_dequantize_packed_cuda")
def _(packed_weight, weight_scale, out_features, in_features, block_size, dtype):
    return packed_weight.new_empty((out_features, in_features), dtype=dtype)


@torch.library.register_fake("qfp8::_fp8_codes_to_half_bits_cuda")
def _(codes, fp8_dtype, half_dtype):
    return codes.new_empty(codes.shape, dtype=torch.int16)


@torch.library.impl("qfp8::_fp8_linear_cuda", "CPU")
def _fp8_linear_emulated(x, packed_weight, weight_scale, bias, out_features, in_features, block_size):
    weight = unpack_weight_cuda(packed_weight, out_features, in_features)
    w = formats.dequantize_weight(weight, weight_scale, block_size or None)
    y = x[:, :in_features].to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@torch.library.impl("qfp8::_fp8_dequantize_packed_cuda", "CPU")
def _fp8_dequantize_packed_emulated(packed_weight, weight_scale, out_features, in_features, block_size, dtype):
    weight = unpack_weight_cuda(packed_weight, out_features, in_features)
    return formats.dequantize_weight(weight, weight_scale, block_size or None, dtype=dtype)


def cuda_extension_loaded() -> bool:
    """Whether the CUDA implementation of the weight-only kernel is registered."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("qfp8::_fp8_linear_cuda", "CUDA")


_EXTENSION_TRIED: list[bool] = []


def load_cuda_extension() -> bool:
    """Imports ``qfp8._C_cuda`` (built by setup.py when torch has CUDA) once; True if the kernel is there."""
    if not _EXTENSION_TRIED:
        _EXTENSION_TRIED.append(True)
        if torch.version.cuda is not None and not cuda_extension_loaded():
            try:
                importlib.import_module("qfp8._C_cuda")
            except (ImportError, OSError):
                pass  # supports() reports it: "the qfp8 CUDA extension is not built"
    return cuda_extension_loaded()


# ------------------------------------------------ the weight-only route


def _kernel_input(x2d: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the kernel reads it: contiguous, 16-byte aligned, columns a multiple of 8 (zero padded)."""
    if in_features % 8:
        return F.pad(x2d, (0, 8 - in_features % 8))
    if not x2d.is_contiguous() or x2d.data_ptr() % 16:
        return x2d.clone(memory_format=torch.contiguous_format)
    return x2d


def _refuse_gradient(op: str, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    # The ops have no Autograd kernel (a Python one costs every call tens of
    # us): a direct call that needs a gradient would silently get none.
    if autograd.needs_grad(x, bias):
        raise NotImplementedError(
            f"qfp8::{op} called directly is not differentiable; call qfp8.library.autograd.linear("
            f"torch.ops.qfp8.{op}.default, ...) (QLinear and Float8WeightTensor do) for gradients with respect to "
            "x and the bias"
        )


def _scaled_linear_cuda(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out_features: int,
    in_features: int,
    block_size: list[int],
    activation: str,
    activation_dtype: torch.dtype,
) -> torch.Tensor:
    _refuse_gradient("scaled_linear_cuda", x, bias)
    if x.dtype not in HALF_DTYPES:  # the kernel computes in fp16/bf16 only
        weight = unpack_weight_cuda(packed_weight, out_features, in_features)
        return torch.ops.qfp8.scaled_linear(
            x, weight, weight_scale, bias, input_scale, block_size, activation, activation_dtype
        )
    x2d = x.reshape(-1, in_features)
    if activation != "none":  # W8A8 without FP8 tensor cores: quantize-dequantize the activations
        x2d = reference_activation(x2d, activation, activation_dtype, input_scale).to(x.dtype)
    if x2d.shape[0] >= LARGE_M:
        weight = torch.ops.qfp8._fp8_dequantize_packed_cuda(
            packed_weight, weight_scale, out_features, in_features, block_size, x.dtype
        )
        y = F.linear(x2d, weight, None if bias is None else bias.to(x.dtype))
    else:
        y = torch.ops.qfp8._fp8_linear_cuda(
            _kernel_input(x2d, in_features), packed_weight, weight_scale, bias, out_features, in_features, block_size
        )
    return y.reshape(*x.shape[:-1], out_features)


torch.library.define(
    "qfp8::scaled_linear_cuda",
    "(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, Tensor? input_scale, int out_features, "
    "int in_features, int[] block_size, str activation, ScalarType activation_dtype) -> Tensor",
)
torch.library.impl("qfp8::scaled_linear_cuda", ("CPU", "CUDA"))(_scaled_linear_cuda)


@torch.library.register_fake("qfp8::scaled_linear_cuda")
def _(x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, block_size, activation, dtype):
    return x.new_empty((*x.shape[:-1], out_features))


# --------------------------------------------------- the _scaled_mm route


def quantize_for_scaled_mm(
    x2d: torch.Tensor, activation: str, activation_dtype: torch.dtype, input_scale: torch.Tensor | None, padded_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations ``[M, padded_k]`` (zero padded) and their float32 scale (``[1]`` or ``[M, 1]``).

    The values are those of the reference (:func:`formats.quantize_activation`),
    so ``_scaled_mm`` multiplies exactly the numbers the reference does.
    """
    if activation == "static":
        if input_scale is None:
            raise ValueError("activation='static' needs input_scale; calibrate the model first")
        q, scale = formats.quantize_activation(x2d, activation_dtype, "tensor", scale=input_scale)
    elif activation in ("token", "tensor", "token-mse"):
        q, scale = formats.quantize_activation(x2d, activation_dtype, activation)
    else:
        raise ValueError(f"_scaled_mm takes activation 'token', 'token-mse', 'tensor' or 'static', got {activation!r}")
    k = x2d.shape[1]
    if padded_k != k:
        wide = torch.zeros(x2d.shape[0], padded_k, dtype=torch.uint8, device=x2d.device)
        wide[:, :k] = q.view(torch.uint8)
        q = wide.view(activation_dtype)
    return q, scale.to(torch.float32)


def scaled_mm_scales(
    activation_scale: torch.Tensor, weight_scale: torch.Tensor, m: int, padded_n: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(scale_a, scale_b, rowwise)`` as ``_scaled_mm`` takes them.

    Tensorwise when both scales are single numbers; otherwise rowwise:
    ``scale_a [M, 1]`` and ``scale_b [1, padded_n]`` (padded channels get 1).
    """
    if activation_scale.numel() == 1 and weight_scale.numel() == 1:
        return activation_scale.reshape(()), weight_scale.reshape(()), False
    scale_a = activation_scale.reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = weight_scale.reshape(1, -1).to(torch.float32)
    if scale_b.shape[1] == 1:
        scale_b = scale_b.expand(1, padded_n)
    elif scale_b.shape[1] != padded_n:
        scale_b = F.pad(scale_b, (0, padded_n - scale_b.shape[1]), value=1.0)
    return scale_a, scale_b.contiguous(), True


def _scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out_features: int,
    in_features: int,
    activation: str,
    activation_dtype: torch.dtype,
) -> torch.Tensor:
    _refuse_gradient("scaled_mm_linear", x, bias)
    x2d = x.reshape(-1, in_features)
    padded_n, padded_k = weight.shape
    q, activation_scale = quantize_for_scaled_mm(x2d, activation, activation_dtype, input_scale, padded_k)
    scale_a, scale_b, rowwise = scaled_mm_scales(activation_scale, weight_scale, x2d.shape[0], padded_n)
    # Rowwise output is bf16 (the dtype every torch version supports for it).
    out_dtype = torch.bfloat16 if rowwise else x.dtype
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if padded_n != out_features:
        y = y[:, :out_features]
    if bias is not None:
        y = y.to(torch.float32) + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


torch.library.define(
    "qfp8::scaled_mm_linear",
    "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? input_scale, int out_features, "
    "int in_features, str activation, ScalarType activation_dtype) -> Tensor",
)
torch.library.impl("qfp8::scaled_mm_linear", ("CPU", "CUDA"))(_scaled_mm_linear)


@torch.library.register_fake("qfp8::scaled_mm_linear")
def _(x, weight, weight_scale, bias, input_scale, out_features, in_features, activation, activation_dtype):
    return x.new_empty((*x.shape[:-1], out_features))


# --------------------------------------------------------------- routing


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None when there is none (tests replace this)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _common_reason(request: KernelRequest, minimum: tuple[int, int]) -> str | None:
    if request.device.type != "cuda":
        return f"device {request.device} is not a CUDA device"
    if not cuda_kernels_enabled():
        return f"off by default until bench/gpu_check.py has passed on a GPU; set {CUDA_KERNELS_ENV}=1 to use it"
    capability = device_capability(request.device)
    if capability is None:
        return "no CUDA device is available"
    if tuple(capability) < minimum:
        return f"needs compute capability {minimum[0]}.{minimum[1]}+, this GPU is {capability[0]}.{capability[1]}"
    if request.weight_dtype not in formats.FP8_DTYPES.values():
        return f"weight dtype {request.weight_dtype} is not FP8"
    return None


def _scaled_mm_reason(request: KernelRequest, padded: bool) -> str | None:
    reason = _common_reason(request, SCALED_MM_MIN_CAPABILITY)
    if reason is not None:
        return reason
    if request.x_dtype is not None and request.x_dtype not in formats.FLOAT_DTYPES:
        return f"activations in {request.x_dtype}: _scaled_mm writes float32, bfloat16 or float16"
    if request.activation not in ("token", "token-mse", "tensor", "static"):
        return f"activation {request.activation!r}: _scaled_mm takes per-token or per-tensor FP8 activations"
    if request.granularity not in ("tensor", "channel"):
        return f"{request.granularity} weight scales are neither tensorwise nor rowwise"
    if request.weight_dtype not in SCALED_MM_WEIGHT_DTYPES or request.activation_dtype != torch.float8_e4m3fn:
        return (
            f"_scaled_mm on NVIDIA takes float8_e4m3fn activations with e4m3fn/e5m2 weights, got "
            f"{request.activation_dtype} x {request.weight_dtype}"
        )
    rowwise = request.activation in ("token", "token-mse") or request.granularity == "channel"
    capability = device_capability(request.device)
    if rowwise and tuple(capability) < ROWWISE_MIN_CAPABILITY:
        return (
            f"rowwise scales (activation={request.activation!r}, weight scale={request.granularity!r}) need "
            f"compute capability {ROWWISE_MIN_CAPABILITY[0]}.{ROWWISE_MIN_CAPABILITY[1]}+ here"
        )
    n, k = request.out_features, request.in_features
    aligned = n % SCALED_MM_ALIGN == 0 and k % SCALED_MM_ALIGN == 0
    if not padded and not aligned:
        return (
            f"out_features={n}, in_features={k} are not both multiples of {SCALED_MM_ALIGN}; "
            f"cuda-scaled-mm-padded16 pads them to {_round_up(n, SCALED_MM_ALIGN)}, {_round_up(k, SCALED_MM_ALIGN)}"
        )
    return None


def _marlin_reason(request: KernelRequest) -> str | None:
    reason = _common_reason(request, MARLIN_MIN_CAPABILITY)
    if reason is not None:
        return reason
    if not load_cuda_extension():
        return "the qfp8 CUDA extension is not built (torch without CUDA, or its build failed)"
    if request.activation not in ACTIVATION_MODES:
        return f"activation mode {request.activation!r} is not supported"
    if request.granularity == "block":
        if len(request.block_size) != 2 or request.block_size[1] % TILE_K:
            return f"block scales need block_size [bn, bk] with bk a multiple of {TILE_K}, got {request.block_size}"
    return None


def _scaled_mm_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the canonical weight from ``pack_weight_scaled_mm``'s padded ``[N, K]``."""
    return packed.index_select(0, ids)[:, :in_features]


def _marlin_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the canonical weight from ``pack_weight_cuda``'s tiles (the map in its docstring):
    row ``n = 32 nt + 8 j + g`` of every k tile, whose ``k = 32 kt + 8 t + 4 s + e`` lie in t, s, e order."""
    nt, kt, _ = packed_shape(out_features, in_features)
    tiles = packed.view(torch.uint8).reshape(nt, kt, 8, 4, 2, 4, 4)  # [nt, kt, g, t, s, j, e]
    within = ids % TILE_N
    rows = tiles[ids // TILE_N, :, within % 8, :, :, within // 8, :]  # [len(ids), kt, t, s, e]
    return rows.reshape(ids.numel(), kt * TILE_K)[:, :in_features].view(packed.dtype)


def _scaled_mm_args(request: KernelRequest) -> tuple:
    return (request.out_features, request.in_features, request.activation, request.activation_dtype)


SCALED_MM_KERNEL = LinearKernel(
    name="cuda-scaled-mm",
    op=torch.ops.qfp8.scaled_mm_linear,
    pack=torch.ops.qfp8.pack_weight_scaled_mm,
    unpack=torch.ops.qfp8.unpack_weight_scaled_mm,
    extra_args=_scaled_mm_args,
    supports=lambda request: _scaled_mm_reason(request, padded=False),
    rows=_scaled_mm_rows,
)
SCALED_MM_PADDED_KERNEL = LinearKernel(
    name="cuda-scaled-mm-padded16",
    op=torch.ops.qfp8.scaled_mm_linear,
    pack=torch.ops.qfp8.pack_weight_scaled_mm,
    unpack=torch.ops.qfp8.unpack_weight_scaled_mm,
    extra_args=_scaled_mm_args,
    supports=lambda request: _scaled_mm_reason(request, padded=True),
    rows=_scaled_mm_rows,
)
MARLIN_KERNEL = LinearKernel(
    name="cuda-fp8-marlin",
    op=torch.ops.qfp8.scaled_linear_cuda,
    pack=torch.ops.qfp8.pack_weight_cuda,
    unpack=torch.ops.qfp8.unpack_weight_cuda,
    extra_args=lambda r: (r.out_features, r.in_features, list(r.block_size), r.activation, r.activation_dtype),
    supports=_marlin_reason,
    rows=_marlin_rows,
)

register_kernel("cuda", SCALED_MM_KERNEL, priority=30)
register_kernel("cuda", SCALED_MM_PADDED_KERNEL, priority=25)
register_kernel("cuda", MARLIN_KERNEL, priority=20)
