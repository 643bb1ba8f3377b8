"""Backward formulas for the linear ops: gradients reach ``x`` and the bias, never the FP8 weights.

A quantized layer's weights and scales are frozen buffers, so only the input
(for adapters trained on top of a quantized model, or gradients with respect
to inputs) and a bias the user made trainable get gradients:

- ``grad_x = grad_y @ dequant(W)``, in float32, returned in ``x``'s dtype.
  With FP8 activations (W8A8) the activation quantization counts as the
  identity (the straight-through estimator quantization-aware training uses),
  so the gradient is the one of the same layer with float activations.
- ``grad_bias = grad_y`` summed over every dimension but the last.

Every linear op of the ``qfp8`` namespace gets the formula, whatever its
weight layout: each registration names how to get the canonical ``[N, K]``
FP8 weight back from the op's own arguments. Without it, autograd passed
over the ops: the layer's share of ``x.grad`` was silently dropped.
"""

from __future__ import annotations

import torch

from qfp8 import formats


@torch.library.custom_op("qfp8::grad_input_linear", mutates_args=())
def grad_input_linear(
    grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: list[int]
) -> torch.Tensor:
    """``grad [M, N] float32 @ dequant(weight [N, K] FP8) -> [M, K]`` float32.

    An op of its own, so that compiled backward graphs call it as one opaque
    node: the dequantization's 256-entry lookup table is a constant tensor
    that tracing could not take inside a graph.
    """
    return grad @ formats.dequantize_weight(weight, weight_scale, block_size or None)


@grad_input_linear.register_fake
def _(grad, weight, weight_scale, block_size):
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _register(op_name: str, layout) -> None:
    """``layout(inputs) -> (unpack, n, k, block_size)``: the op's ``unpack(weight, n, k)`` op (None when the
    weight argument is already canonical ``[N, K]``), the layer's sizes and its block size ([] if not block)."""

    def setup_context(ctx, inputs, output):
        x, weight, weight_scale, bias = inputs[:4]
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.inputs_count = len(inputs)
        ctx.unpack, ctx.n, ctx.k, ctx.block_size = layout(inputs)
        ctx.save_for_backward(weight, weight_scale)

    def backward(ctx, grad):
        weight, weight_scale = ctx.saved_tensors
        grad2d = grad.reshape(-1, ctx.n).to(torch.float32)
        grads = [None] * ctx.inputs_count
        if ctx.needs_input_grad[0]:
            canonical = weight if ctx.unpack is None else ctx.unpack(weight, ctx.n, ctx.k)
            grad_x = torch.ops.qfp8.grad_input_linear(grad2d, canonical, weight_scale, list(ctx.block_size))
            grads[0] = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grads[3] = grad2d.sum(0).to(ctx.bias_dtype)
        return tuple(grads)

    torch.library.register_autograd(op_name, backward, setup_context=setup_context)


def register_linear_backwards() -> None:
    """Registers the backward of every linear op defined in this process (reference, CPU, CUDA routes)."""
    # (x, weight, weight_scale, bias, input_scale, block_size, activation, activation_dtype)
    _register("qfp8::scaled_linear", lambda i: (None, i[1].shape[0], i[1].shape[1], i[5]))
    # (x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, block_size, activation, dtype)
    packed_ops = {"scaled_linear_cpu": "unpack_weight_cpu", "scaled_linear_cuda": "unpack_weight_cuda"}
    for op, unpack in packed_ops.items():
        if hasattr(torch.ops.qfp8, op):
            unpack_op = getattr(torch.ops.qfp8, unpack)
            _register(f"qfp8::{op}", lambda i, unpack_op=unpack_op: (unpack_op, i[5], i[6], i[7]))
    # (x, padded weight, weight_scale, bias, input_scale, out_features, in_features, activation, dtype)
    if hasattr(torch.ops.qfp8, "scaled_mm_linear"):
        _register("qfp8::scaled_mm_linear", lambda i: (torch.ops.qfp8.unpack_weight_scaled_mm, i[5], i[6], []))
