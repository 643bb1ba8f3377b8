"""Mixture-of-experts linear: ``torch.ops.qfp8.experts_linear``.

``experts_linear(x, expert_ids, weights, weight_scales, input_scales,
kernel, granularity, block_size, activation, activation_dtype,
out_features, in_features)``: ``x`` ``[T, K]`` holds token rows sorted by
expert, ``expert_ids`` ``[T]`` the expert of each row (ascending); row ``t``
of the ``[T, N]`` result is ``x[t] @ dequant(weights[expert_ids[t]])^T``,
each expert's rows computed by ``kernel`` (the name of a registered linear
kernel, whose layout ``weights`` are packed in) in one call. Rows whose
expert is ``len(weights)`` (a pair another rank computes, transformers'
expert-parallel marker) give zeros; any other id outside the experts is a
``ValueError``. ``input_scales``: one ``[1]`` scale per expert for static
activations, else empty.

The routing (how many rows each expert has) is data, so a traced graph
cannot hold the per-expert calls: the op is opaque to ``torch.compile``
(its fake returns ``[T, N]``), which lets a quantized MoE layer compile
with ``fullgraph=True`` and no recompilation when the routing changes.
``experts_linear_grad_input`` is its input gradient (each expert's rows of
the output gradient times its dequantized weight), which :class:`ExpertsLinear`
applies when a gradient is needed: the MoE layer calls it so, and with the
CPU extension a direct call of the op that needs a gradient (a graph
``torch.export`` traced) reaches it through the extension's Autograd kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qfp8.library.routing import KernelRequest, kernel_by_name

__all__ = [
    "ExpertsLinear",
    "apply_differentiable",
    "expert_rows",
    "experts_linear_grad_input_impl",
    "experts_linear_impl",
    "register_backward",
]

torch.library.define(
    "qfp8::experts_linear",
    "(Tensor x, Tensor expert_ids, Tensor[] weights, Tensor[] weight_scales, Tensor[] input_scales, str kernel, "
    "str granularity, int[] block_size, str activation, ScalarType activation_dtype, int out_features, "
    "int in_features) -> Tensor",
)


@torch.library.register_fake("qfp8::experts_linear")
def _(x, expert_ids, weights, weight_scales, input_scales, kernel, granularity, block_size, activation,
      activation_dtype, out_features, in_features):  # fmt: skip
    return x.new_empty((x.shape[0], out_features))


def expert_rows(expert_ids: torch.Tensor, experts: int) -> Iterator[tuple[int, slice]]:
    """``(expert, rows)`` for each of the ``experts`` that has rows in ``expert_ids`` (sorted ascending); ids
    equal to ``experts`` (pairs another rank computes) come last and are left out."""
    counts = torch.bincount(expert_ids, minlength=experts + 1).tolist()
    start = 0
    for expert, count in enumerate(counts[:experts]):
        if count:
            yield expert, slice(start, start + count)
            start += count


def experts_linear_impl(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: list[torch.Tensor],
    weight_scales: list[torch.Tensor],
    input_scales: list[torch.Tensor],
    kernel: str,
    granularity: str,
    block_size: list[int],
    activation: str,
    activation_dtype: torch.dtype,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    # AOTInductor's proxy executor passes an empty list argument as None (see empty_lists_from_none in
    # qfp8/ext/cpu/linear.cpp); under inference_mode this kernel is the first to see it.
    input_scales, block_size = input_scales or [], block_size or []
    experts = len(weights)
    if x.dim() != 2 or x.shape[1] != in_features or expert_ids.shape != (x.shape[0],):
        raise ValueError(
            f"experts_linear: x must be [T, {in_features}] and expert_ids [T], got {list(x.shape)} and "
            f"{list(expert_ids.shape)}"
        )
    if len(weight_scales) != experts or len(input_scales) not in (0, experts):
        raise ValueError(
            f"experts_linear: {experts} weights need {experts} weight scales (and 0 or {experts} input scales), "
            f"got {len(weight_scales)} and {len(input_scales)}"
        )
    out = x.new_zeros((x.shape[0], out_features))
    if x.shape[0] == 0 or experts == 0:
        return out
    lowest, highest = int(expert_ids.min()), int(expert_ids.max())
    if lowest < 0 or highest > experts:
        bad = lowest if lowest < 0 else highest
        raise ValueError(f"experts_linear: expert id {bad}; the layer has experts 0 to {experts - 1}")
    linear = kernel_by_name(kernel)
    request = KernelRequest(
        device=x.device,
        weight_dtype=weights[0].dtype,
        granularity=granularity,
        block_size=tuple(block_size),
        activation=activation,
        activation_dtype=activation_dtype,
        out_features=out_features,
        in_features=in_features,
        x_dtype=x.dtype,
    )
    extra = linear.extra_args(request)
    for expert, rows in expert_rows(expert_ids, experts):
        scale = input_scales[expert] if input_scales else None
        out[rows] = linear.op(x[rows], weights[expert], weight_scales[expert], None, scale, *extra)
    return out


torch.library.impl("qfp8::experts_linear", "CompositeExplicitAutograd")(experts_linear_impl)


torch.library.define(
    "qfp8::experts_linear_grad_input",
    "(Tensor grad, Tensor expert_ids, Tensor[] weights, Tensor[] weight_scales, str kernel, int[] block_size, "
    "int out_features, int in_features) -> Tensor",
)


@torch.library.register_fake("qfp8::experts_linear_grad_input")
def _(grad, expert_ids, weights, weight_scales, kernel, block_size, out_features, in_features):
    return grad.new_empty((grad.shape[0], in_features), dtype=torch.float32)


def experts_linear_grad_input_impl(
    grad: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: list[torch.Tensor],
    weight_scales: list[torch.Tensor],
    kernel: str,
    block_size: list[int],
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """``experts_linear``'s input gradient, float32: each expert's rows of ``grad`` times its dequantized
    weight (the activation quantization of W8A8 counts as the identity, as for a single linear)."""
    from qfp8.library.autograd import grad_input_linear

    out = torch.zeros((grad.shape[0], in_features), dtype=torch.float32, device=grad.device)
    unpack = kernel_by_name(kernel).unpack
    for expert, rows in expert_rows(expert_ids, len(weights)):
        weight = unpack(weights[expert], out_features, in_features)
        out[rows] = grad_input_linear(grad[rows].float(), weight, weight_scales[expert], list(block_size))
    return out


torch.library.impl("qfp8::experts_linear_grad_input", "CompositeExplicitAutograd")(experts_linear_grad_input_impl)


def _grad_input_setup(ctx, inputs, output):
    _, ctx.expert_ids, ctx.weights, ctx.weight_scales, ctx.kernel, ctx.block_size, ctx.n, ctx.k = inputs


def _grad_input_backward(ctx, grad_grad_x):
    """Second order (a gradient penalty): each expert's rows of ``grad_grad_x`` times its dequantized weight,
    transposed; none for the ids, the frozen weights and the sizes."""
    from qfp8 import formats

    grad_grad = torch.zeros((grad_grad_x.shape[0], ctx.n), dtype=torch.float32, device=grad_grad_x.device)
    unpack = kernel_by_name(ctx.kernel).unpack
    for expert, rows in expert_rows(ctx.expert_ids, len(ctx.weights)):
        weight = unpack(ctx.weights[expert], ctx.n, ctx.k)
        dequantized = formats.dequantize_weight(weight, ctx.weight_scales[expert], list(ctx.block_size) or None)
        grad_grad[rows] = grad_grad_x[rows].float() @ dequantized.t()
    # torch.library matches the inputs' tree: one None per tensor of a Tensor[] argument; for an int[] one, one
    # None (its values are not differentiable), or [] when it is empty (no leaf to stand for).
    nones = [None] * len(ctx.weights)
    block = [] if not ctx.block_size else None
    return grad_grad.to(grad_grad_x.dtype), None, nones, list(nones), None, block, None, None


torch.library.register_autograd(
    "qfp8::experts_linear_grad_input", _grad_input_backward, setup_context=_grad_input_setup
)


class ExpertsLinear(torch.autograd.Function):
    """``experts_linear`` with the input gradient (weights and scales are frozen buffers: none for them)."""

    @staticmethod
    def forward(*args):
        return torch.ops.qfp8.experts_linear(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Also the op's own autograd setup where the CPU extension is missing (:func:`register_backward`)."""
        x, expert_ids, weights, weight_scales, _, kernel, _, block_size, _, _, out_features, in_features = inputs
        ctx.save_for_backward(expert_ids, *weights, *weight_scales)
        ctx.experts, ctx.kernel, ctx.block_size = len(weights), kernel, block_size
        # The op's own backward (register_backward) matches the inputs' tree: one None per tensor of a Tensor[]
        # argument, [] for an empty list, one None for anything else.
        ctx.list_lengths = [
            len(value)
            if isinstance(value, list | tuple) and (not value or isinstance(value[0], torch.Tensor))
            else None
            for value in inputs
        ]
        ctx.sizes, ctx.x_dtype = (out_features, in_features), x.dtype

    @staticmethod
    def backward(ctx, grad):
        expert_ids, *saved = ctx.saved_tensors
        weights, weight_scales = saved[: ctx.experts], saved[ctx.experts :]
        grad_x = torch.ops.qfp8.experts_linear_grad_input(
            grad, expert_ids, weights, weight_scales, ctx.kernel, ctx.block_size, *ctx.sizes
        )
        return (grad_x.to(ctx.x_dtype), *([None] * 11))


def apply_differentiable(*args) -> torch.Tensor:
    """A call of the op that needs a gradient, sent here by the CPU extension's Autograd kernel."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "qfp8::experts_linear called directly (an exported graph) under a torch.func transform: not supported; "
            "run the model itself (its MoE layers apply the formula) or use torch.autograd"
        )
    return ExpertsLinear.apply(*args)


def register_backward() -> None:
    """Gives the op a Python autograd kernel: where the CPU extension, whose C++ Autograd kernel would send the
    calls that need a gradient to :class:`ExpertsLinear`, is missing (see qfp8/library/cpu.py)."""

    def backward(ctx, grad):
        (grad_x, *_) = ExpertsLinear.backward(ctx, grad)  # then one None per input, a list of them per list
        return (grad_x, *(None if n is None else [None] * n for n in ctx.list_lengths[1:]))

    torch.library.register_autograd("qfp8::experts_linear", backward, setup_context=ExpertsLinear.setup_context)
