"""What a quantized linear layer does: weight format and activation handling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfp8 import formats

__all__ = [
    "ACTIVATION_SCHEMES",
    "QuantizationScheme",
]

ACTIVATION_SCHEMES = (None, "dynamic", "static")


@dataclass(frozen=True)
class QuantizationScheme:
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    weight_scale: str = "channel"  # "tensor" | "channel" | "block"
    block_size: tuple[int, ...] = ()  # (bn, bk) for block scales, else ()
    activations: str | None = None  # None (W8A16) | "dynamic" | "static"
    activation_scale: str = "token"  # "token" | "tensor" | "group" | "token-mse"; "static" implies "tensor"

    @classmethod
    def from_args(
        cls,
        weights="float8_e4m3fn",
        weight_scale="channel",
        activations=None,
        activation_scale="token",
        block_size=formats.DEFAULT_BLOCK_SIZE,
    ) -> QuantizationScheme:
        """Validates the user-facing strings of ``qfp8.quantize``."""
        weight_dtype = formats.fp8_dtype(weights)
        if weight_scale not in formats.WEIGHT_GRANULARITIES:
            raise ValueError(
                f"unknown weight_scale {weight_scale!r}; expected one of {list(formats.WEIGHT_GRANULARITIES)}"
            )
        if activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"unknown activations {activations!r}; expected one of {list(ACTIVATION_SCHEMES)}")
        if activation_scale not in formats.ACTIVATION_GRANULARITIES:
            raise ValueError(
                f"unknown activation_scale {activation_scale!r}; "
                f"expected one of {list(formats.ACTIVATION_GRANULARITIES)}"
            )
        # Checked whatever weight_scale is (a sweep may pass one block_size to every granularity; () or None,
        # what a scheme without blocks holds, pass), used by "block" only
        if weight_scale == "block" or block_size not in ((), None):
            block_size = formats._check_block_size(block_size)
        block = block_size if weight_scale == "block" else ()
        # activation_scale defaults to "token": another value with activations that do not use it is a mistake
        if activations is None and activation_scale != "token":
            raise ValueError(
                f"activation_scale={activation_scale!r} applies to activations='dynamic'; activations=None "
                "quantizes the weights only (W8A16)"
            )
        if activations == "static" and activation_scale not in ("token", "tensor"):
            raise ValueError(
                f"activation_scale={activation_scale!r} applies to activations='dynamic'; static activations take "
                "one calibrated per-tensor scale"
            )
        if activations == "static":
            activation_scale = "tensor"
        if activations is None:
            activation_scale = "token"  # unused; normalised so equal schemes compare equal
        return cls(weight_dtype, weight_scale, block, activations, activation_scale)

    @property
    def activation_mode(self) -> str:
        """The ``activation`` argument of the linear ops."""
        if self.activations is None:
            return "none"
        if self.activations == "static":
            return "static"
        return self.activation_scale

    @property
    def activation_dtype(self) -> torch.dtype:
        return formats.activation_dtype_for(self.weight_dtype)

    def describe(self) -> str:
        """Short readable name, e.g. ``w-e4m3fn-channel a-token``."""
        w = str(self.weight_dtype).replace("torch.float8_", "")
        scale = self.weight_scale + (f"{self.block_size[0]}x{self.block_size[1]}" if self.block_size else "")
        a = {None: "a-float", "dynamic": f"a-dynamic-{self.activation_scale}", "static": "a-static-tensor"}[
            self.activations
        ]
        return f"w-{w}-{scale} {a}"
