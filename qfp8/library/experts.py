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
"""

from __future__ import annotations

import torch

from qfp8.library.routing import KernelRequest, kernel_by_name

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
    counts = torch.bincount(expert_ids, minlength=experts + 1).tolist()
    start = 0
    for expert, count in enumerate(counts[:experts]):
        if count:
            rows = slice(start, start + count)
            scale = input_scales[expert] if input_scales else None
            out[rows] = linear.op(x[rows], weights[expert], weight_scales[expert], None, scale, *extra)
            start += count
    return out


torch.library.impl("qfp8::experts_linear", "CompositeExplicitAutograd")(experts_linear_impl)
