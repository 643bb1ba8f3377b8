"""The reference FP8 linear op: canonical weights, pure PyTorch, any device.

``torch.ops.qfp8.scaled_linear`` is the oracle every kernel is tested
against and the route used where no kernel is built for the device.

Arguments shared by every linear op of the ``qfp8`` namespace, in this order:

- ``x``: ``[..., K]`` float32, bfloat16 or float16; the output has its dtype.
- ``weight``: the FP8 weight in the kernel's layout (here canonical ``[N, K]``).
- ``weight_scale``: float32 ``[1]`` (tensor), ``[N, 1]`` (channel) or
  ``[ceil(N/bn), ceil(K/bk)]`` (block, with ``block_size = [bn, bk]``).
- ``bias``: ``[N]`` or None; ``input_scale``: float32 ``[1]`` for static
  activations, else None.
- ``activation``: ``"none"`` (W8A16), ``"token"``, ``"tensor"``, ``"group"``,
  ``"token-mse"`` (dynamic scales; see ``formats``) or ``"static"``
  (``input_scale``); ``activation_dtype``
  is the FP8 dtype activations are quantized to.

Ops take plain tensors and know nothing of modules: validation of shapes and
dtypes happens once, when a module is frozen, not on every call.
"""

from __future__ import annotations

import torch

from qfp8 import formats

__all__ = [
    "ACTIVATION_MODES",
    "reference_activation",
    "scaled_linear",
]

ACTIVATION_MODES = ("none", "token", "tensor", "group", "static", "token-mse")


def reference_activation(
    x2d: torch.Tensor, activation: str, activation_dtype: torch.dtype, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """The float32 values a kernel multiplies: ``x`` itself, or ``x`` quantized and dequantized."""
    if activation == "none":
        return x2d.to(torch.float32)
    if activation == "static":
        if input_scale is None:
            raise ValueError("activation='static' needs input_scale; calibrate the model first")
        q, scale = formats.quantize_activation(x2d, activation_dtype, "tensor", scale=input_scale)
    elif activation in formats.ACTIVATION_GRANULARITIES:
        q, scale = formats.quantize_activation(x2d, activation_dtype, activation)
    else:
        raise ValueError(f"unknown activation mode {activation!r}; expected one of {ACTIVATION_MODES}")
    return formats.dequantize_activation(q, scale)


@torch.library.custom_op("qfp8::scaled_linear", mutates_args=())
def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    block_size: list[int],
    activation: str,
    activation_dtype: torch.dtype,
) -> torch.Tensor:
    if not x.is_floating_point() or x.dim() == 0:
        # A RuntimeError, as the kernels give: QLinear turns it into the TypeError / ValueError naming the layer.
        raise RuntimeError(
            f"qfp8::scaled_linear: x must be a floating-point tensor of at least one dimension, got {x.dtype} "
            f"{list(x.shape)}"
        )
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    w = formats.dequantize_weight(weight, weight_scale, block_size or None)
    y = reference_activation(x2d, activation, activation_dtype, input_scale) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@scaled_linear.register_fake
def _(x, weight, weight_scale, bias, input_scale, block_size, activation, activation_dtype):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
