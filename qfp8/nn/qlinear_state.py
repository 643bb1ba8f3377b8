"""QLinear's state I/O: its ``state_dict`` entries (compressed-tensors names), loading them back with every
value checked, and pickling (FP8 buffers travel as uint8 views; bound ops are bound again on the way back).

``state_spec``, ``take_expected`` and ``keep_buffer_dtypes`` are shared with the other FP8 modules (experts,
embeddings, KV caches).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
from torch import nn

from qfp8 import formats
from qfp8.library import kernel_by_name
from qfp8.library.routing import REFERENCE_KERNEL

__all__ = ["QLinearStateMixin", "keep_buffer_dtypes", "state_spec", "take_expected"]


# Set by state_spec(): QLinear's state_dict entry for ``weight`` is then a
# meta tensor of the right shape and dtype instead of the unpacked weight.
_STATE_SPEC_ONLY = contextvars.ContextVar("qfp8_state_spec_only", default=False)


@contextlib.contextmanager
def state_spec():
    """``model.state_dict()`` inside this block describes QLinear weights without unpacking them.

    Their ``weight`` entries are meta tensors (shape and dtype only), so
    checking a state dict's names and sizes against a large model costs no
    copy of its weights.
    """
    token = _STATE_SPEC_ONLY.set(True)
    try:
        yield
    finally:
        _STATE_SPEC_ONLY.reset(token)


@contextlib.contextmanager
def keep_buffer_dtypes(module: nn.Module, names: tuple[str, ...]):
    """Around ``nn.Module._apply``: the buffers ``names`` keep their dtype (FP8 data, float32 scales) when the
    model's dtype changes (``model.to(torch.bfloat16)`` casts every floating buffer); only their device follows."""
    kept = {name: module._buffers.get(name) for name in names}
    yield
    for name, before in kept.items():
        after = module._buffers.get(name)
        if before is not None and after is not None and after.dtype != before.dtype:
            setattr(module, name, before.to(after.device))


def take_expected(state_dict, prefix: str, expected: dict, missing_keys: list, error_msgs: list) -> dict:
    """The entries of ``state_dict`` under ``prefix`` that ``expected`` (key -> (shape, dtype or None for any
    float)) describes and that match it; a missing key goes to ``missing_keys``, a mismatch to ``error_msgs``."""
    loaded = {}
    for key, (shape, dtype) in expected.items():
        if prefix + key not in state_dict:
            missing_keys.append(prefix + key)
            continue
        value = state_dict[prefix + key]
        if tuple(value.shape) != tuple(shape) or (dtype is not None and value.dtype != dtype):
            error_msgs.append(
                f"{prefix}{key}: expected {dtype or 'float'} {list(shape)}, got {value.dtype} {list(value.shape)}"
            )
            continue
        loaded[key] = value
    return loaded


class QLinearStateMixin:
    """``QLinear``'s ``state_dict`` save and load and its pickling (see the module docstring)."""

    # Bound ops (dispatcher entries) do not pickle; they are bound again
    # from the kernel's name on the way back.
    _UNPICKLED = ("_fast", "_fast_op", "_op", "_kernel_op", "_eager_op", "_unpack")

    def __getstate__(self):
        state = {key: value for key, value in super().__getstate__().items() if key not in self._UNPICKLED}
        # torch's pickling of a float8 tensor cannot be unpickled (the storage
        # is rebuilt through a dtype lookup float8 lacks), so FP8 buffers
        # travel as uint8 views of the same bytes and are viewed back on load.
        buffers = dict(state["_buffers"])
        fp8 = {}
        for name, t in buffers.items():
            if t is not None and t.dtype in formats.FP8_DTYPES.values():
                buffers[name], fp8[name] = t.view(torch.uint8), t.dtype
        state["_buffers"], state["_fp8_buffers"] = buffers, fp8
        return state

    def __setstate__(self, state):
        # Unpickling and copy.deepcopy: the module's dicts are watched again,
        # by this module, and its op bound again.
        for name, dtype in state.pop("_fp8_buffers", {}).items():
            state["_buffers"][name] = state["_buffers"][name].view(dtype)
        super().__setstate__(state)
        self._watch()
        if "transformers" in sys.modules:  # a model unpickled in a new process may name qfp8's attention
            from qfp8.nn.attention import register

            register()
        self._use_kernel(kernel_by_name(self.packing))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if _STATE_SPEC_ONLY.get():
            weight = torch.empty(self.out_features, self.in_features, dtype=self.scheme.weight_dtype, device="meta")
        else:
            weight = self.canonical_weight()
        destination[prefix + "weight"] = weight
        destination[prefix + "weight_scale"] = self.weight_scale
        if self.input_scale is not None:
            destination[prefix + "input_scale"] = self.input_scale
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        device = self.weight_scale.device if self.weight_scale.device.type != "meta" else None
        expected = {
            "weight": ((self.out_features, self.in_features), self.scheme.weight_dtype),
            "weight_scale": (tuple(self.weight_scale.shape), torch.float32),
        }
        if self.bias is not None:
            expected["bias"] = ((self.out_features,), None)
        static = self.scheme.activations == "static"
        if static and self.input_scale is not None:  # a calibrated layer's scale is part of its state
            expected["input_scale"] = ((1,), None)
        if strict:
            # A W8A16 or dynamic layer has no input_scale: one in the state dict
            # (a static checkpoint) is reported, as are names the layer never has.
            allowed = {*expected, "input_scale"} if static else set(expected)
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :] not in allowed:
                    unexpected_keys.append(key)
        loaded = take_expected(state_dict, prefix, expected, missing_keys, error_msgs)
        if static and "input_scale" not in expected and prefix + "input_scale" in state_dict:
            value = state_dict[prefix + "input_scale"]  # fills an uncalibrated layer's empty slot
            if value.numel() != 1:
                error_msgs.append(f"{prefix}input_scale: expected 1 value, got shape {list(value.shape)}")
            else:
                loaded["input_scale"] = value
        if "input_scale" in loaded:
            loaded["input_scale"] = loaded["input_scale"].reshape(1).to(torch.float32)
        # Values the kernels cannot use: NaN/Inf FP8 codes, scales that are not finite and > 0.
        for key, divides in (("weight_scale", None), ("input_scale", self.scheme.activation_dtype)):
            problem = formats.scale_problem(loaded[key], divides) if key in loaded else None
            if problem is not None:
                error_msgs.append(f"{prefix}{key}: holds {problem}")
        if "weight" in loaded:
            at = formats.first_nonfinite(loaded["weight"])
            if at is not None:
                code = int(loaded["weight"][at].view(torch.uint8))
                error_msgs.append(
                    f"{prefix}weight: {self.scheme.weight_dtype} [{self.out_features}, {self.in_features}] holds a "
                    f"NaN/Inf code (0x{code:02X}) at {list(at)}"
                )
        if error_msgs or missing_keys and strict:
            return
        target = device or loaded.get("weight", self.qweight).device
        if "weight" in loaded:
            self.qweight = loaded["weight"].to(target)
            self._use_kernel(REFERENCE_KERNEL)
        if "weight_scale" in loaded:
            self.weight_scale = loaded["weight_scale"].to(target)
        if "input_scale" in loaded:
            self.input_scale = loaded["input_scale"].to(target)
            self._bind_op()
        if "bias" in loaded:
            value = loaded["bias"].to(device=target, dtype=self.orig_dtype)
            if local_metadata.get("assign_to_params_buffers", False) or self.bias.device.type == "meta":
                self.bias = nn.Parameter(value, requires_grad=self.bias.requires_grad)
            else:
                with torch.no_grad():  # the same Parameter, as nn.Linear keeps it (optimizers hold it)
                    self.bias.copy_(value)
        self.pack_for_device()
