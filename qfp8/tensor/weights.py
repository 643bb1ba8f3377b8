"""``Float8WeightTensor``: an FP8 ``[N, K]`` weight with its float32 scale.

The FP8 data is held in the layout of the kernel that runs it (``packing``
names that kernel; ``"reference"`` is the canonical ``[N, K]``). ``shape``
and ``dtype`` are those of the float weight it stands for, so code that asks
``weight.dtype`` or ``weight.shape`` sees what it expects.

Handled: ``F.linear``, ``torch.matmul`` / ``@``, ``addmm`` (routed to the
layout's kernel; a float64 input takes the reference op), ``F.embedding``
(the dequantized rows, read from the layout), ``detach``,
``clone``, ``to`` / ``type`` (a device move keeps FP8; a float ``dtype`` is an
explicit dequantize), ``float`` / ``double`` / ``half`` / ``bfloat16``
(dequantize, whatever dtype the weight reports), ``t`` / ``transpose``,
``dequantize()``. Everything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfp8 import formats
from qfp8.library import autograd
from qfp8.library.routing import REFERENCE_KERNEL, KernelRequest, dequantized_rows, kernel_by_name
from qfp8.tensor.base import CONVERSIONS, Float8Tensor, convert

__all__ = [
    "Float8WeightTensor",
    "check_row_ids",
    "weight_granularity",
]

aten = torch.ops.aten


def weight_granularity(scale: torch.Tensor, block_size) -> str:
    if block_size:
        return "block"
    return "tensor" if scale.numel() == 1 else "channel"


class Float8WeightTensor(Float8Tensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("packing", "block_size", "orig_dtype", "out_features", "in_features", "transposed")

    @staticmethod
    def __new__(cls, qdata, scale, packing, block_size, orig_dtype, out_features, in_features, transposed=False):
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata, scale, packing, block_size, orig_dtype, out_features, in_features, transposed=False):
        self.qdata = qdata
        self.scale = scale
        self.packing = packing
        self.block_size = tuple(block_size)
        self.orig_dtype = orig_dtype
        self.out_features = out_features
        self.in_features = in_features
        self.transposed = transposed

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, dtype=torch.float8_e4m3fn, granularity="channel", block_size=None
    ) -> Float8WeightTensor:
        """Quantizes a float ``[N, K]`` weight (canonical layout)."""
        block = tuple(block_size or formats.DEFAULT_BLOCK_SIZE) if granularity == "block" else ()
        qdata, scale = formats.quantize_weight(weight, dtype, granularity, block or None)
        n, k = weight.shape
        return cls(qdata, scale, "reference", block, weight.dtype, n, k)

    # ---- views of the same data
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.qdata.dtype

    @property
    def granularity(self) -> str:
        return weight_granularity(self.scale, self.block_size)

    def canonical_qdata(self) -> torch.Tensor:
        """The FP8 ``[N, K]`` weight, whatever layout it is held in."""
        return kernel_by_name(self.packing).unpack(self.qdata, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = formats.dequantize_weight(self.canonical_qdata(), self.scale, self.block_size, dtype or self.orig_dtype)
        return w.t() if self.transposed else w

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``self.dequantize(dtype)[ids]`` (an embedding lookup, ``[*ids.shape, K]``) without unpacking the
        other rows."""
        if self.transposed:
            raise NotImplementedError("rows of a transposed FP8 weight: take them from the [out, in] weight")
        return dequantized_rows(
            self.packing,
            self.qdata,
            self.scale,
            self.block_size,
            ids.long(),
            self.out_features,
            self.in_features,
            dtype or self.orig_dtype,
        )

    def kernel_request(self, activation: str = "none", activation_dtype: torch.dtype | None = None) -> KernelRequest:
        return KernelRequest(
            device=self.qdata.device,
            weight_dtype=self.fp8_dtype,
            granularity=self.granularity,
            block_size=self.block_size,
            activation=activation,
            activation_dtype=activation_dtype or formats.activation_dtype_for(self.fp8_dtype),
            out_features=self.out_features,
            in_features=self.in_features,
            x_dtype=self.orig_dtype,
        )

    def _with(self, **changes) -> Float8WeightTensor:
        fields = {name: getattr(self, name) for name in self.tensor_data_names + self.tensor_attribute_names}
        fields.update(changes)
        return Float8WeightTensor(**fields)

    def __repr__(self):
        scale = self.granularity + (f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else "")
        return (
            f"Float8WeightTensor(shape={tuple(self.shape)}, {str(self.fp8_dtype).replace('torch.', '')}, "
            f"scale={scale}, packing={self.packing}, dequantizes to {str(self.orig_dtype).replace('torch.', '')}, "
            f"device={self.qdata.device}{', transposed' if self.transposed else ''})"
        )


def _linear(x: torch.Tensor, weight: Float8WeightTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` through the kernel of the weight's layout."""
    from qfp8.tensor.activations import Float8ActivationTensor

    if isinstance(x, Float8ActivationTensor):
        # The dequantized activation holds the same FP8 values times its scale,
        # so the products are those of an FP8 x FP8 matmul.
        out_dtype = x.orig_dtype
        x = x.dequantize(torch.float32)
    else:
        out_dtype = x.dtype
    if x.dtype not in formats.FLOAT_DTYPES and x.dtype != torch.float64:
        raise TypeError(
            f"linear: the input is {x.dtype}; the FP8 weight [{weight.out_features}, {weight.in_features}] takes "
            f"float32, bfloat16, float16 or float64 inputs"
        )
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"linear: input has {x.shape[-1] if x.dim() else 'no'} features (shape {list(x.shape)}), the FP8 "
            f"weight expects {weight.in_features} "
            f"(weight shape [{weight.out_features}, {weight.in_features}])"
        )
    if bias is not None:
        bias = bias.contiguous()  # F.linear takes any [N] bias; the kernels read a contiguous one
    kernel, qdata = kernel_by_name(weight.packing), weight.qdata
    if x.dtype == torch.float64 and kernel is not REFERENCE_KERNEL:
        # Kernels take float32 / bfloat16 / float16; the reference op computes any float dtype.
        kernel, qdata = REFERENCE_KERNEL, weight.canonical_qdata()
    request = weight.kernel_request()
    args = (x, qdata, weight.scale, bias, None, *kernel.extra_args(request))
    y = autograd.linear(kernel.op, kernel.unpack, *args)
    return y.to(out_dtype)


@Float8WeightTensor.implements(F.linear, aten.linear.default)
def _(func, types, args, kwargs):
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(weight, Float8WeightTensor) or weight.transposed:
        raise NotImplementedError(f"{func}: the FP8 weight must be the [out, in] weight argument")
    return _linear(x, weight, bias)


@Float8WeightTensor.implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, aten.mm.default)
def _(func, types, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(b, Float8WeightTensor) and b.transposed and not isinstance(a, Float8WeightTensor):
        return _linear(a, b._with(transposed=False), None)
    if isinstance(b, Float8WeightTensor) and not isinstance(a, Float8WeightTensor):
        # x @ W with W as [N, K] is not a linear layer's product (that is x @ W.t()); computing it would mean a
        # silent dequantize, which the contract rules out.
        raise NotImplementedError(
            f"{func}: x @ W with the FP8 weight W [{b.out_features}, {b.in_features}] untransposed is not a "
            "linear layer's product: use x @ W.t() or F.linear(x, W) for that, or W.dequantize() for the matrix"
        )
    raise NotImplementedError(f"{func}: only x @ weight with the FP8 weight on the right is implemented")


@Float8WeightTensor.implements(torch.addmm, aten.addmm.default)
def _(func, types, args, kwargs):
    bias, x, w = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not (isinstance(w, Float8WeightTensor) and w.transposed) or beta != 1 or alpha != 1:
        raise NotImplementedError(f"{func}: only addmm(bias, x, weight.t()) with beta = alpha = 1 is implemented")
    w = w._with(transposed=False)
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"addmm: the input must be a tensor, got {type(bias).__name__}")
    if bias.dim() in (1, 2) and bias.shape[-1] == w.out_features and bias.numel() == w.out_features:
        return _linear(x, w, bias.reshape(-1))  # [N] or [1, N]: the kernels add it as their bias
    out = _linear(x, w, None)
    try:
        shape = torch.broadcast_shapes(bias.shape, out.shape)
    except RuntimeError:
        shape = None
    if shape != out.shape:
        raise ValueError(
            f"addmm: the input of shape {list(bias.shape)} does not broadcast to the product's {list(out.shape)} "
            f"(x {list(x.shape)} times the FP8 weight [{w.out_features}, {w.in_features}] transposed)"
        )
    return (out + bias).to(out.dtype)  # [M, N] or [M, 1]: added to the product, as torch.addmm does


@Float8WeightTensor.implements(F.embedding, aten.embedding.default)
def _(func, types, args, kwargs):
    ids, weight = args[0], args[1]
    if func is F.embedding:  # (input, weight, padding_idx, max_norm, ...)
        if (args[3] if len(args) > 3 else kwargs.get("max_norm")) is not None:
            raise NotImplementedError(
                f"{func}: max_norm renormalizes the weight's rows in place, which an FP8 weight cannot do"
            )
    if not isinstance(weight, Float8WeightTensor) or isinstance(ids, Float8WeightTensor):
        raise NotImplementedError(f"{func}: the FP8 weight must be the table argument")
    check_row_ids(
        ids, weight.out_features, f"embedding of the FP8 weight [{weight.out_features}, {weight.in_features}]"
    )
    return weight.rows(ids)


def check_row_ids(ids: torch.Tensor, rows: int, where: str) -> None:
    """Refuses embedding indices that are not integers (``TypeError``) or not in ``[0, rows)`` (``ValueError``,
    in eager mode: a compiled graph does not stop to look); ``where`` names the table."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{where}: the indices are {ids.dtype}; they must be int64 or int32")
    if not torch.compiler.is_compiling() and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            raise ValueError(f"{where}: index {low if low < 0 else high} is out of range for {rows} rows")


@Float8WeightTensor.implements(torch.Tensor.t, torch.t, aten.t.default)
def _(func, types, args, kwargs):
    return args[0]._with(transposed=not args[0].transposed)


@Float8WeightTensor.implements(torch.Tensor.transpose, torch.transpose, aten.transpose.int)
def _(func, types, args, kwargs):
    w = args[0]
    given = [*args[1:3], *(kwargs[k] for k in ("dim0", "dim1") if k in kwargs)]
    for d in given:
        if not -2 <= d < 2:
            raise IndexError(f"Dimension out of range (expected to be in range of [-2, 1], but got {d})")
    dims = sorted(d % 2 for d in given)
    if dims != [0, 1]:
        return w
    return w._with(transposed=not w.transposed)


@Float8WeightTensor.implements(
    torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.permute, torch.permute, aten.permute.default
)
def _(func, types, args, kwargs):
    # w.T, w.mT and w.permute(1, 0) are w.t() for a 2-D weight.
    w = args[0]
    dims = args[1:] if len(args) > 1 else kwargs.get("dims", (1, 0))
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = [d % 2 for d in dims]
    if dims not in ([0, 1], [1, 0]):
        raise ValueError(f"permute of a 2-D FP8 weight takes dims (0, 1) or (1, 0), got {tuple(args[1:])}")
    return w if dims == [0, 1] else w._with(transposed=not w.transposed)


@Float8WeightTensor.implements(torch.Tensor.detach, aten.detach.default, aten.alias.default)
def _(func, types, args, kwargs):
    w = args[0]
    return w._with(qdata=w.qdata.detach(), scale=w.scale.detach())


@Float8WeightTensor.implements(torch.Tensor.clone, aten.clone.default)
def _(func, types, args, kwargs):
    w = args[0]
    return w._with(qdata=w.qdata.clone(), scale=w.scale.clone())


@Float8WeightTensor.implements(*CONVERSIONS)
def _(func, types, args, kwargs):
    w = args[0]

    def moved(device):  # a kernel layout belongs to its device: move the canonical form
        return w._with(qdata=w.canonical_qdata().to(device), scale=w.scale.to(device), packing="reference")

    return convert(w, func, args, kwargs, moved)
