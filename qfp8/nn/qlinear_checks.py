"""QLinear's error diagnosis: which input, scale or bias made a kernel refuse a call, said as a ValueError /
TypeError naming the layer; and the check of a float weight before it is quantized."""

from __future__ import annotations

import torch

from qfp8 import formats

__all__ = ["QLinearChecksMixin", "check_float_weight"]


def check_float_weight(weight: torch.Tensor, name: str) -> None:
    """Raises the ValueError naming module ``name`` if the float ``weight`` holds values FP8 cannot represent."""
    bad = formats.nonfinite_count(weight)  # in row bands: a whole-weight temporary is 0.5-1x its bytes
    if bad:
        raise ValueError(
            f"module {name!r}: weight {tuple(weight.shape)} holds {bad} NaN/Inf value(s); "
            "FP8 cannot represent them. Fix or exclude this module (exclude=[...])."
        )
    if weight.numel() and not torch.isfinite((amax := formats.abs_max(weight)).float()):
        raise ValueError(
            f"module {name!r}: weight {tuple(weight.shape)} holds values beyond float32's range (|w| up to "
            f"{float(amax):.3g}), which its float32 scales cannot cover. Fix or exclude this "
            "module (exclude=[...])."
        )


class QLinearChecksMixin:
    """``QLinear``'s messages for bad inputs and bad state (the checks run only once a call has failed, or on
    assignment)."""

    @property
    def _placed(self) -> str:
        """``"module '<label>': "`` to put before the layer's description in a message ("" without a label)."""
        return f"module {self.label!r}: " if self.label else ""

    def _raise_input_error(self, x, error: RuntimeError):
        """Raises the ValueError / TypeError naming this layer if ``x`` caused the op's ``error``, else ``error``."""
        problem = self._input_error(x)
        if problem is None:
            raise error
        raise problem from error

    def _state_problem(self, name: str, value, values: bool = False) -> Exception | None:
        """The ValueError / TypeError for ``value`` as the layer's ``name`` (weight_scale, input_scale or bias), or
        None. With ``values`` (on assignment, not on every call) a scale's values are checked too (finite, > 0);
        without (a kernel refused the call), its layout (contiguous, as the kernels take it)."""
        layer = f"{self._placed}QLinear({self.in_features} -> {self.out_features})"
        if value is None:
            return ValueError(f"{layer}: weight_scale cannot be None") if name == "weight_scale" else None
        if not isinstance(value, torch.Tensor):
            return TypeError(f"{layer}: {name} must be a tensor, got {type(value).__name__}")
        if name == "bias":
            expected, dtypes = (self.out_features,), formats.FLOAT_DTYPES + (torch.float64,)
        elif name == "weight_scale":
            shape = (self.out_features, self.in_features)
            expected = formats.weight_scale_shape(shape, self.scheme.weight_scale, self.scheme.block_size)
            dtypes = (torch.float32,)
        else:
            expected, dtypes = (1,), (torch.float32,)
        if value.dtype not in dtypes:
            return TypeError(f"{layer}: {name} is {value.dtype}; expected {' or '.join(map(str, dtypes))}")
        if tuple(value.shape) != expected and not (name == "input_scale" and value.numel() == 1):
            return ValueError(f"{layer}: {name} has shape {tuple(value.shape)}; expected {expected}")
        if not values and not value.is_contiguous():  # the reference route takes any stride
            return ValueError(
                f"{layer}: the {name} (stride {value.stride()}) is not contiguous; assign a contiguous one"
            )
        device = self.qweight.device
        if value.device != device and "meta" not in (value.device.type, device.type):
            return ValueError(f"{layer}: {name} is on {value.device}, the layer's weights on {device}")
        if values and name != "bias":
            problem = formats.scale_problem(value, self.scheme.activation_dtype if name == "input_scale" else None)
            if problem is not None:
                return ValueError(f"{layer}: {name} holds {problem}")
        return None

    def _input_error(self, x) -> Exception | None:
        """The ValueError / TypeError for an input the layer cannot take, or for a weight scale, input scale or
        bias put in place by a route that bypasses assignment (the module's dicts, ``torch.func.functional_call``);
        None if neither is the cause."""
        layer = f"{self._placed}QLinear({self.extra_repr()})"
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{layer}: the input must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            return TypeError(f"{layer}: the input must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return ValueError(
                f"{layer}: the input has shape {tuple(x.shape)}, its last dimension must be {self.in_features}"
            )
        if x.device != self.qweight.device and x.device.type != "meta":
            return ValueError(f"{layer}: the input is on {x.device}, the layer's weights on {self.qweight.device}")
        if x.dtype not in formats.FLOAT_DTYPES and self.packing != "reference":
            return TypeError(
                f"{layer}: the input is {x.dtype}; the {self.packing} kernel takes float32, bfloat16 or float16 "
                f"(for {x.dtype} convert the model too: model.to({x.dtype}) puts its layers on the reference route)"
            )
        state = (("weight_scale", self._buffers["weight_scale"]), ("bias", self._parameters["bias"]))
        if self.scheme.activations == "static":
            state += (("input_scale", self._buffers["input_scale"]),)
        for name, value in state:
            problem = self._state_problem(name, value)
            if problem is not None:
                return problem
        return None
