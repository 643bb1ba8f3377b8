"""The CPU kernel's convolution op (qfp8/ext/cpu/conv.cpp), where the extension is built.

``qfp8::scaled_conv_cpu(x, packed_weight, weight_scale, bias, input_scale,
out_features, in_features, block_size, activation, activation_dtype,
kernel_size, stride, padding, dilation)`` is ``qfp8::scaled_linear_cpu`` on
the patch matrix of ``x`` (``[B, C, L]`` or ``[B, C, H, W]``, any strides;
groups = 1), with the patch's ``K`` in ``(*kernel, C)`` order (the weight
packed in that order) and ``padding`` the zeros before and after each spatial
dimension (``[before, after]`` per dimension, the first dimension first). The
output ``[B, out_features, *out]`` is contiguous when ``x`` is, else
channels-last (``[B, *out, out_features]`` seen with the channels second), as
``nn.Conv``'s keeps the input's memory format. It never builds the patch
matrix where the ISA reads the patches in place (avx512bf16, bf16 input,
activations as given) and quantizes the patches straight into FP8 values
(avx512bf16 and amx, per-token, per-tensor and static activation scales);
elsewhere it gathers it in one pass. No gradient: the
layers call it only when none is needed.
"""

from __future__ import annotations

import torch

from qfp8.ext import load_cpu_extension

__all__ = ["CONV_OP", "conv_output_sizes"]


def conv_output_sizes(spatial, kernel_size, stride, padding, dilation) -> list[int]:
    """The output sizes of a convolution of input sizes ``spatial``, ``padding`` as the op takes it."""
    return [
        (size + padding[2 * i] + padding[2 * i + 1] - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1
        for i, size in enumerate(spatial)
    ]


CONV_OP = None
if load_cpu_extension() is not None and hasattr(torch.ops.qfp8, "scaled_conv_cpu"):

    @torch.library.register_fake("qfp8::scaled_conv_cpu")
    def _(
        x, packed_weight, weight_scale, bias, input_scale, out_features, in_features, block_size, activation, dtype,
        kernel_size, stride, padding, dilation,
    ):  # fmt: skip
        out = conv_output_sizes(x.shape[2:], kernel_size, stride, padding, dilation)
        if x.is_contiguous():
            return x.new_empty((x.shape[0], out_features, *out))
        return x.new_empty((x.shape[0], *out, out_features)).movedim(-1, 1)

    CONV_OP = torch.ops.qfp8.scaled_conv_cpu.default
