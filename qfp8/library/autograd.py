"""Backward for the linear ops: gradients reach ``x`` and the bias, never the FP8 weights.

A quantized layer's weights and scales are frozen buffers, so only the input
(for adapters trained on top of a quantized model, or gradients with respect
to inputs) and a bias the user made trainable get gradients:

- ``grad_x = grad_y @ dequant(W)``, returned in ``x``'s dtype. In eager
  mode it is the linear kernel of the weight's device run on the FP8 ``W^T``,
  packed once at the first backward (:mod:`qfp8.library.transposed`); a
  traced backward calls ``qfp8::grad_input_linear`` (dequantize, then a
  float32 product), as do double backward and torch.func.
  With FP8 activations (W8A8) the activation quantization counts as the
  identity (the straight-through estimator quantization-aware training uses),
  so the gradient is the one of the same layer with float activations.
- ``grad_bias = grad_y`` summed over every dimension but the last.

:func:`linear` applies it: a call that needs a gradient goes through
:class:`_Linear`, an ``autograd.Function``; any other call is the op itself.
The formula is not registered as a Python kernel on the ops' Autograd
dispatch key: one runs on every dispatcher call, gradient or not, which
would cost tens of microseconds per call (about half a small layer's whole
cost in compiled decode; docs/design.md). ``QLinear``, ``Float8WeightTensor`` and the CPU
kernel's eager entry call :func:`linear`. Direct calls (a graph
``torch.export`` traced holds the ops themselves) get the formula too: the
reference op, a ``torch.library.custom_op`` that has a Python autograd
kernel anyway, through :func:`register_backward`; the CPU kernel's op
(and ``experts_linear``) through the extension's C++ Autograd kernel, which checks whether a gradient is needed and only then calls
:func:`apply_linear` (next to nothing otherwise). The CUDA kernels' ops
refuse a direct call that needs a gradient.
"""

from __future__ import annotations

import torch

from qfp8 import formats
from qfp8.library import transposed

__all__ = [
    "apply_linear",
    "grad_input_linear",
    "linear",
    "needs_grad",
    "register_backward",
]


def _grad_input(grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size) -> torch.Tensor:
    """``grad @ dequant(weight)`` in aten ops: the op below, and what torch.func runs in its place."""
    return grad @ formats.dequantize_weight(weight, weight_scale, block_size or None)


@torch.library.custom_op("qfp8::grad_input_linear", mutates_args=())
def grad_input_linear(
    grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: list[int]
) -> torch.Tensor:
    """``grad [M, N] float32 @ dequant(weight [N, K] FP8) -> [M, K]`` float32.

    An op of its own, so that compiled backward graphs call it as one opaque
    node: the dequantization's 256-entry lookup table is a constant tensor
    that tracing could not take inside a graph.
    """
    return _grad_input(grad, weight, weight_scale, block_size)


@grad_input_linear.register_fake
def _(grad, weight, weight_scale, block_size):
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _grad_input_linear_setup(ctx, inputs, output):
    _, ctx.weight, ctx.weight_scale, ctx.block_size = inputs


def _grad_input_linear_backward(ctx, grad_grad_x):
    """Second order (a gradient penalty, ``torch.func``): ``grad @ W`` is linear in ``grad``, its gradient is
    ``grad_grad_x @ W^T``; none for the frozen FP8 weight."""
    weight = formats.dequantize_weight(ctx.weight, ctx.weight_scale, ctx.block_size or None)
    return grad_grad_x @ weight.t(), None, None, None


grad_input_linear.register_autograd(_grad_input_linear_backward, setup_context=_grad_input_linear_setup)


def _layout(args) -> tuple:
    """(N, K, block_size) of a linear op's arguments, told apart by their count (see ``qfp8.library.ops``).

    8: ``scaled_linear`` (canonical [N, K] weight, block_size 6th); 9: ``scaled_mm_linear`` (out_features,
    in_features, activation, dtype); 10: ``scaled_linear_cpu`` / ``scaled_linear_cuda`` (out_features,
    in_features, block_size, activation, dtype).
    """
    if len(args) == 8:
        return args[1].shape[0], args[1].shape[1], list(args[5])
    if len(args) == 9:
        return args[5], args[6], []
    if len(args) == 10:
        return args[5], args[6], list(args[7])
    raise TypeError(f"qfp8.library.autograd.linear: {len(args)} op arguments; the linear ops take 8, 9 or 10")


def _setup(ctx, unpack, args) -> None:
    x, weight, weight_scale, bias = args[:4]
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.unpack = unpack
    ctx.n, ctx.k, ctx.block_size = _layout(args)
    # Frozen buffers, not saved tensors: they may be inference tensors
    # (made under torch.inference_mode), which save_for_backward refuses.
    ctx.weight, ctx.weight_scale = weight, weight_scale


def _grads(ctx, grad, count: int, x_index: int) -> tuple:
    """Gradients of the ``count`` inputs, ``x`` at ``x_index`` and the bias 3 after it; None for the others."""
    grads = [None] * count
    grad2d = grad.reshape(-1, ctx.n)
    if ctx.needs_input_grad[x_index]:
        if torch._C._are_functorch_transforms_active():
            # torch.func (grad, jacrev, ...): a custom op's autograd does not run under its transforms; the same
            # product in aten ops does, to any order.
            weight = ctx.weight if ctx.unpack is None else ctx.unpack(ctx.weight, ctx.n, ctx.k)
            grad_x = _grad_input(grad2d.to(torch.float32), weight, ctx.weight_scale, ctx.block_size)
        elif torch.compiler.is_compiling() or torch.is_grad_enabled():
            # A traced backward (one opaque op in the graph) or a double backward (the op's own formula).
            weight = ctx.weight if ctx.unpack is None else ctx.unpack(ctx.weight, ctx.n, ctx.k)
            grad_x = torch.ops.qfp8.grad_input_linear(
                grad2d.to(torch.float32), weight, ctx.weight_scale, ctx.block_size
            )
        else:
            grad_x = transposed.grad_input(
                grad2d, ctx.weight, ctx.weight_scale, ctx.unpack, ctx.n, ctx.k, ctx.block_size
            )
        grads[x_index] = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[x_index + 3]:
        grads[x_index + 3] = grad2d.to(torch.float32).sum(0).to(ctx.bias_dtype)
    return tuple(grads)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(op, unpack, *args):
        return op(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.count = len(inputs)
        _setup(ctx, inputs[1], inputs[2:])

    @staticmethod
    def backward(ctx, grad):
        return _grads(ctx, grad, ctx.count, 2)  # inputs: op, unpack, x, weight, weight_scale, bias, ...


def needs_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def linear(op, unpack, *args):
    """``op(*args)`` for a linear op of the ``qfp8`` namespace, differentiable in ``x`` and the bias.

    ``unpack(weight, out_features, in_features)`` gives the canonical ``[N, K]``
    FP8 weight back from the op's layout (the kernel's ``LinearKernel.unpack``;
    None when the weight argument is canonical already).
    """
    if needs_grad(args[0], args[3]):
        return apply_linear(op, unpack, *args)
    return op(*args)


def apply_linear(op, unpack, *args):
    """:func:`linear` for a call known to need a gradient (the CPU kernel op's Autograd kernel sends those here).

    Under torch.func transforms (``torch.func.grad`` of an exported graph,
    which calls the op directly) an autograd.Function cannot run from inside
    the op's Autograd kernel; there the op's value gets the same gradient from
    aten ops instead (straight-through for W8A8, as the formula).
    """
    n, k, block_size = _layout(args)  # a TypeError for arguments of no linear op, before any work
    if not torch._C._are_functorch_transforms_active():
        return _Linear.apply(op, unpack, *args)
    x, weight, weight_scale, bias = args[:4]
    canonical = weight if unpack is None else unpack(weight, n, k)
    w = formats.dequantize_weight(canonical, weight_scale, block_size or None)
    with torch.no_grad():
        value = op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    product = x.to(torch.float32) @ w.t()
    out = value + (product - product.detach()).to(value.dtype)
    return out if bias is None else out + (bias - bias.detach()).to(value.dtype)


def register_backward(op: str, unpack=None) -> None:
    """Direct calls of ``op`` get the formula as a Python autograd kernel: the reference op (a custom op, which
    has a Python autograd kernel anyway), and the CPU kernel's op where the extension is missing."""

    def setup_context(ctx, inputs, output):
        ctx.count = len(inputs)
        _setup(ctx, unpack, inputs)

    torch.library.register_autograd(op, lambda ctx, grad: _grads(ctx, grad, ctx.count, 0), setup_context=setup_context)
