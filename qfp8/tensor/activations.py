"""``Float8ActivationTensor``: FP8 activations ``[..., K]`` with float32 scales.

Scales broadcast against the data: ``[1]`` (per tensor), ``[..., 1]`` (per
token) or ``[..., ceil(K/128)]`` (1x128 groups along K).

Handled: ``F.linear`` / ``matmul`` / ``@`` with an FP8 weight (products of
FP8 values) or a float weight, ``bmm`` (either side plain), ``view`` /
``reshape`` (the last dimension stays for per-token and group scales),
``detach``, ``clone``, ``to`` / ``type`` (a device move keeps FP8; a float
``dtype`` is an explicit dequantize), ``float`` / ``double`` / ``half`` /
``bfloat16`` (dequantize, whatever dtype the tensor reports),
``dequantize()``. Everything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qfp8 import formats
from qfp8.tensor.base import CONVERSIONS, Float8Tensor, convert

__all__ = [
    "Float8ActivationTensor",
]

aten = torch.ops.aten


class Float8ActivationTensor(Float8Tensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("granularity", "orig_dtype")

    @staticmethod
    def __new__(cls, qdata, scale, granularity, orig_dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata, scale, granularity, orig_dtype):
        self.qdata = qdata
        self.scale = scale
        self.granularity = granularity
        self.orig_dtype = orig_dtype

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype = torch.float8_e4m3fn,
        granularity: str = "token",
        scale: torch.Tensor | None = None,
    ) -> Float8ActivationTensor:
        """Quantizes ``x`` ``[..., K]``; ``scale`` is a static per-tensor scale."""
        if not x.is_floating_point() or x.dtype in formats.FP8_DTYPES.values():
            raise TypeError(f"Float8ActivationTensor.quantize takes a float tensor, got {x.dtype}")
        if scale is not None:
            granularity = "tensor"
        k = x.shape[-1] if x.dim() else 1
        q, s = formats.quantize_activation(x.reshape(-1, k), dtype, granularity, scale)
        if granularity != "tensor":
            s = s.reshape(*x.shape[:-1], s.shape[-1])
        return cls(q.reshape(x.shape), s, granularity, x.dtype)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.qdata.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        k = self.qdata.shape[-1] if self.qdata.dim() else 1
        scale = self.scale
        if self.granularity == "tensor":
            scale = scale.reshape(1)
        else:
            scale = scale.reshape(-1, scale.shape[-1])
        out = formats.dequantize_activation(self.qdata.reshape(-1, k), scale, dtype or self.orig_dtype)
        return out.reshape(self.qdata.shape)

    def _with(self, **changes) -> Float8ActivationTensor:
        fields = {name: getattr(self, name) for name in self.tensor_data_names + self.tensor_attribute_names}
        fields.update(changes)
        return Float8ActivationTensor(**fields)

    def __repr__(self):
        return (
            f"Float8ActivationTensor(shape={tuple(self.shape)}, {str(self.fp8_dtype).replace('torch.', '')}, "
            f"scale={self.granularity}, dequantizes to {str(self.orig_dtype).replace('torch.', '')}, "
            f"device={self.qdata.device})"
        )


def _plain(t, dtype: torch.dtype = torch.float32):
    """An operand of a matmul in ``dtype``: an activation dequantized, a plain tensor cast.

    An FP8 weight stays as it is: its own handler decides what a product with it means.
    """
    if isinstance(t, Float8ActivationTensor):
        return t.dequantize(dtype)
    if isinstance(t, Float8Tensor):
        return t
    return t.to(dtype)


@Float8ActivationTensor.implements(F.linear, aten.linear.default)
def _(func, types, args, kwargs):
    from qfp8.tensor.weights import Float8WeightTensor, _linear

    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if isinstance(weight, Float8WeightTensor):
        return _linear(x, weight, bias)
    return F.linear(x.dequantize(torch.float32), weight.float(), None if bias is None else bias.float()).to(
        x.orig_dtype
    )


@Float8ActivationTensor.implements(
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, aten.bmm.default
)
def _(func, types, args, kwargs):
    from qfp8.tensor.weights import Float8WeightTensor, _linear

    a, b = args[0], args[1]
    if isinstance(b, Float8WeightTensor) and b.transposed:
        return _linear(a, b._with(transposed=False), None)
    # Both operands in float32 (float64 if either is), the result in the left operand's dtype: for operands
    # of one dtype, the dtype torch gives.
    compute_dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    op = torch.bmm if func in (torch.bmm, aten.bmm.default) else torch.matmul
    right = b.dequantize(compute_dtype) if isinstance(b, Float8WeightTensor) else _plain(b, compute_dtype)
    return op(_plain(a, compute_dtype), right).to(a.dtype)


@Float8ActivationTensor.implements(torch.addmm, aten.addmm.default)
def _(func, types, args, kwargs):
    """``addmm(bias, x, w)`` = ``bias + x @ w``: a linear layer when ``w`` is an FP8 weight's ``.t()``, else the
    matmul route above (the FP8 activation dequantized to float32 for that op)."""
    from qfp8.tensor.weights import Float8WeightTensor, _linear

    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1 or not isinstance(a, Float8ActivationTensor):
        raise NotImplementedError(f"{func}: only addmm(bias, x_fp8, w) with beta = alpha = 1 is implemented")
    if isinstance(b, Float8WeightTensor) and b.transposed:
        return _linear(a, b._with(transposed=False), bias)
    product = torch.matmul(a, b)
    return product + _plain(bias, product.dtype)


def _new_shape(x: Float8ActivationTensor, shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = x.qdata.numel() // max(known, 1)
    return tuple(shape)


@Float8ActivationTensor.implements(
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, aten.view.default, aten.reshape.default
)
def _(func, types, args, kwargs):
    x = args[0]
    shape = _new_shape(x, args[1:] if len(args) > 1 else (kwargs["shape"],))
    if x.granularity == "tensor":
        return x._with(qdata=x.qdata.reshape(shape))
    if not shape or shape[-1] != x.qdata.shape[-1]:
        raise ValueError(
            f"Float8ActivationTensor with {x.granularity} scales: reshape {tuple(x.shape)} -> {shape} must keep "
            f"the last (feature) dimension {x.qdata.shape[-1]}"
        )
    scale = x.scale.reshape(*shape[:-1], x.scale.shape[-1])
    return x._with(qdata=x.qdata.reshape(shape), scale=scale)


@Float8ActivationTensor.implements(torch.Tensor.detach, aten.detach.default, aten.alias.default)
def _(func, types, args, kwargs):
    x = args[0]
    return x._with(qdata=x.qdata.detach(), scale=x.scale.detach())


@Float8ActivationTensor.implements(torch.Tensor.clone, aten.clone.default)
def _(func, types, args, kwargs):
    x = args[0]
    return x._with(qdata=x.qdata.clone(), scale=x.scale.clone())


@Float8ActivationTensor.implements(*CONVERSIONS)
def _(func, types, args, kwargs):
    x = args[0]
    return convert(x, func, args, kwargs, lambda device: x._with(qdata=x.qdata.to(device), scale=x.scale.to(device)))
