"""``QLinear``: an ``nn.Linear`` whose weight is FP8.

State (what ``state_dict`` holds, compressed-tensors names): ``weight`` (FP8
``[N, K]``, canonical), ``weight_scale`` (float32), ``input_scale`` (float32
``[1]``, static activations only), ``bias``. In memory the FP8 weight is kept
in the layout of the kernel chosen for the module's device (``qweight``,
never saved); ``weight`` returns it wrapped as a ``Float8WeightTensor``.

Fast path: ``forward`` calls the chosen kernel op with plain tensors; all
routing and validation are done when the kernel is chosen. A call with no
hooks, outside ``torch.compile`` and calibration, skips ``nn.Module.__call__``
and the ``OpOverload`` wrapper too and enters the op's dispatcher directly
when "armed": no hook on the module, no instance-level ``forward``, not
compiled by ``module.compile()``, not calibrating, decided when the state
changes instead of on every call. Attribute assignment and any write to the
module's hook dicts (which are watched) disarm it; the next call takes the
regular path, whose ``forward`` arms it again. Tensors are read from the
parameter and buffer dicts on every call, so no route of replacing one can
leave the fast path holding a stale tensor.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module

from qfp8 import formats, rounding
from qfp8.library import kernel_by_name, select_kernel
from qfp8.library.autograd import linear, needs_grad
from qfp8.library.routing import REFERENCE_KERNEL, KernelRequest
from qfp8.nn.qlinear_calibration import QLinearCalibrationMixin
from qfp8.nn.qlinear_checks import QLinearChecksMixin, check_float_weight
from qfp8.nn.qlinear_state import _STATE_SPEC_ONLY as _STATE_SPEC_ONLY
from qfp8.nn.qlinear_state import QLinearStateMixin, keep_buffer_dtypes, state_spec, take_expected
from qfp8.nn.scheme import QuantizationScheme
from qfp8.tensor import Float8ActivationTensor, Float8WeightTensor

__all__ = [
    "QLinear",
    "keep_buffer_dtypes",
    "state_spec",
    "take_expected",
]

# nn.Module's global hook registries (mutated in place, never rebound): the
# fast path in QLinear.__call__ must step aside when any hook is registered.
# Bound to module globals one by one: `a or b or c or d` costs a third of
# `any((a, b, c, d))` on a call that matters at the microsecond.
_global_forward_hooks = _module._global_forward_hooks
_global_forward_pre_hooks = _module._global_forward_pre_hooks
_global_backward_hooks = _module._global_backward_hooks
_global_backward_pre_hooks = _module._global_backward_pre_hooks
# Plain `return False` outside Dynamo, which folds it to True while tracing
# (torch.compiler.is_compiling costs a second Python call, is_scripting).
_is_compiling = torch.compiler.is_dynamo_compiling


class _WatchedDict(collections.OrderedDict):
    """A QLinear's hook dict: any write (a hook added or removed) disarms the fast path.

    An ``OrderedDict`` because nn.Module's hook registration moves entries
    (``prepend=True``); reads cost what a plain dict's do.
    """

    # A weak reference: a strong one would make module state a reference
    # cycle, freed only by the garbage collector (layer-by-layer calibration
    # relies on a layer's memory coming back at `del`).
    __slots__ = ("owner",)

    def _disarm(self) -> None:
        # Unset while pickle or deepcopy refill the items of a new copy.
        ref = getattr(self, "owner", None)
        owner = ref() if ref is not None else None
        if owner is not None:
            owner.__dict__["_fast"] = None

    def __reduce__(self):
        # Copies and pickles carry the items, not the owner: the copied
        # module's __setstate__ makes itself the owner.
        return (_WatchedDict, (), None, None, iter(self.items()))

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._disarm()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._disarm()

    def __ior__(self, other):
        result = super().__ior__(other)
        self._disarm()
        return result

    def pop(self, *args):
        result = super().pop(*args)
        self._disarm()
        return result

    def popitem(self, last=True):
        result = super().popitem(last)
        self._disarm()
        return result

    def setdefault(self, key, default=None):
        result = super().setdefault(key, default)
        self._disarm()
        return result

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._disarm()

    def clear(self):
        super().clear()
        self._disarm()

    def move_to_end(self, key, last=True):
        super().move_to_end(key, last)
        self._disarm()


# The hook dicts the armed call would skip (the with-kwargs and always-called
# sets only ever hold keys of _forward_hooks / _forward_pre_hooks). Not the
# parameter and buffer dicts: a dict subclass there makes torch.compile's
# guards on them cost microseconds per layer and call (a few percent of a
# compiled stack of small layers at M = 1).
_WATCHED = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _is_own_forward(module: nn.Module, forward) -> bool:
    """True when ``forward`` is ``type(module).forward`` bound to ``module`` (no wrapper)."""
    return getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward


class QLinear(QLinearStateMixin, QLinearCalibrationMixin, QLinearChecksMixin, nn.Module):
    """An ``nn.Linear`` with an FP8 weight (see the module docstring).

    Here: building, the kernel choice and packing, the fast path and the call.
    State-dict I/O and pickling live in :mod:`qfp8.nn.qlinear_state`, calibration and accuracy-mode rounding
    in :mod:`qfp8.nn.qlinear_calibration`, the error messages in :mod:`qfp8.nn.qlinear_checks`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        scheme: QuantizationScheme | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self._watch()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme or QuantizationScheme()
        self.orig_dtype = dtype
        scale_shape = formats.weight_scale_shape(
            (out_features, in_features), self.scheme.weight_scale, self.scheme.block_size
        )
        self.register_buffer(
            "qweight",
            torch.zeros(out_features, in_features, dtype=self.scheme.weight_dtype, device=device),
            persistent=False,
        )
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.packing = REFERENCE_KERNEL.name
        self.kernel_notes: list[str] = []
        self.calibrating = False
        self._calibration_amax: torch.Tensor | None = None
        # Accuracy mode (qfp8/rounding.py): the float weight is kept until
        # calibration has gathered H = sum x^T x, then re-quantized with it.
        self.accuracy: str | None = None
        # Plain attributes, not buffers (accelerate's offload moves every buffer
        # and fails on an empty slot); _apply moves them with the module.
        self.float_weight: torch.Tensor | None = None
        # Where the layer sits, for error messages, when no module path names it (a fused MoE expert:
        # "model.layers.0.mlp.experts.gate_up_proj[3]").
        self.label: str | None = None
        # The class of the layer it stands for when that was no nn.Linear (transformers' Conv1D, weight stored
        # [in, out] there): its checkpoint holds the [out, in] weight, which only qfp8 reads as that layer.
        self.converted_from: str | None = None
        self.hessian: torch.Tensor | None = None
        self._use_kernel(REFERENCE_KERNEL)

    # ------------------------------------------------------------ building
    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: QuantizationScheme, name: str = "", accuracy: str | None = None
    ) -> QLinear:
        """Quantizes ``linear``'s weight (refusing NaN/Inf) into a new QLinear.

        ``accuracy`` ("scale" or "gptq", see qfp8/rounding.py): the weight is
        rounded to nearest now and chosen again, to minimise the output error,
        at the end of :func:`qfp8.calibrate`.
        """
        return cls.from_weight(linear.weight, linear.bias, scheme, name or repr(linear), accuracy, label=name or None)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: QuantizationScheme,
        name: str,
        accuracy: str | None = None,
        label: str | None = None,
    ) -> QLinear:
        """A QLinear of the float ``weight`` ``[N, K]`` (and ``bias``), as :meth:`from_linear`.

        ``name`` names the weight in the errors raised here, ``label`` the module in the layer's own errors.
        """
        rounding.check_mode(accuracy)
        weight = weight.detach()
        check_float_weight(weight, name)
        out_features, in_features = weight.shape
        module = cls(
            in_features,
            out_features,
            bias=bias is not None,
            scheme=scheme,
            dtype=weight.dtype,
            device=torch.device("meta"),
        )
        qweight, scale = formats.quantize_weight(
            weight, scheme.weight_dtype, scheme.weight_scale, scheme.block_size or None
        )
        module.qweight = qweight
        module.weight_scale = scale
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        if accuracy is not None:
            module.accuracy = accuracy
            module.float_weight = weight.clone()
        module.label = label
        module.pack_for_device()
        return module

    def requantize(self, weight: torch.Tensor, name: str | None = None) -> None:
        """Replaces the FP8 weight by the float ``weight`` ``[N, K]`` quantized with the layer's own scheme.

        What a LoRA merge does (``weight`` is the dequantized weight plus the
        adapter's product). The bias, the activation scales and the kernel
        choice stay; ``name`` names the module in errors (default: its label).
        """
        name = name or self.label or f"QLinear({self.in_features} -> {self.out_features})"
        shape = (self.out_features, self.in_features)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or tuple(weight.shape) != shape:
            got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"module {name!r}: a new weight must be a float tensor of shape {shape}, got {got}")
        if self.accuracy_pending:
            raise ValueError(
                f"module {name!r}: its weight waits for calibration (accuracy={self.accuracy!r}); run "
                "qfp8.calibrate on it before changing its weight"
            )
        if self.qweight.device.type == "meta":
            raise ValueError(f"module {name!r}: its weight is on the meta device (never loaded); load it first")
        weight = weight.detach().to(self.weight_scale.device)
        check_float_weight(weight, name)
        qweight, scale = formats.quantize_weight(
            weight, self.scheme.weight_dtype, self.scheme.weight_scale, self.scheme.block_size or None
        )
        self.qweight = qweight
        self._use_kernel(REFERENCE_KERNEL)
        self.weight_scale = scale
        self.pack_for_device()

    # -------------------------------------------------------------- views
    @property
    def weight(self) -> Float8WeightTensor:
        return Float8WeightTensor(
            self.qweight,
            self.weight_scale,
            self.packing,
            self.scheme.block_size,
            self.orig_dtype,
            self.out_features,
            self.in_features,
        )

    def canonical_weight(self) -> torch.Tensor:
        """The FP8 ``[N, K]`` weight, unpacked from the kernel layout."""
        return kernel_by_name(self.packing).unpack(self.qweight, self.out_features, self.in_features)

    @property
    def is_calibrated(self) -> bool:
        return self.scheme.activations != "static" or self.input_scale is not None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scheme={self.scheme.describe()}, kernel={self.packing}"
        )

    # ------------------------------------------------------------ routing
    def kernel_request(self) -> KernelRequest:
        return KernelRequest(
            device=self.qweight.device,
            weight_dtype=self.scheme.weight_dtype,
            granularity=self.scheme.weight_scale,
            block_size=self.scheme.block_size,
            activation=self.scheme.activation_mode,
            activation_dtype=self.scheme.activation_dtype,
            out_features=self.out_features,
            in_features=self.in_features,
            x_dtype=self.orig_dtype,
        )

    def _use_kernel(self, kernel) -> None:
        self.packing = kernel.name
        # An OpOverloadPacket resolves its overload on every call; the
        # overload itself goes straight to the dispatcher.
        op = kernel.op
        self._kernel_op = op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
        self._eager_op = kernel.eager_op
        self._unpack = kernel.unpack
        self._extra_args = kernel.extra_args(self.kernel_request())
        self._bind_op()

    def _bind_op(self) -> None:
        # An uncalibrated static layer gets an op that says what to do,
        # so the fast path itself needs no check.
        self._op = self._kernel_op if self.is_calibrated else self._uncalibrated
        # The kernel's eager entry (no argument boxing; it hands the call to
        # the op whenever the dispatcher has work to do), else the dispatcher
        # entry behind the OpOverload (its Python __call__ is one more frame);
        # None sends every call through nn.Module.__call__.
        if self.is_calibrated and not self.calibrating:
            self._fast_op = self._eager_op or getattr(self._kernel_op, "_op", self._kernel_op)
        else:
            self._fast_op = None
        self._arm()

    def _watch(self) -> None:
        """Makes the dicts the fast path depends on this module's watched dicts (also after a copy)."""
        state = self.__dict__
        state["_fast"] = None
        owner = weakref.ref(self)
        for name in _WATCHED:
            watched = state[name] if type(state[name]) is _WatchedDict else _WatchedDict(state[name])
            watched.owner = owner
            state[name] = watched

    def __prepare_scriptable__(self):
        # torch.jit.script calls this before compiling a module's forward, which TorchScript cannot parse here.
        raise TypeError(
            f"{self._placed}QLinear({self.in_features} -> {self.out_features}): torch.jit.script cannot compile "
            "qfp8's layers; torch.jit.trace, torch.export and torch.compile can"
        )

    def _arm(self) -> None:
        """Sets the fast path's op when nothing needs the regular path (None otherwise)."""
        state = self.__dict__
        fast = None
        if (
            state.get("_fast_op") is not None
            and all(type(state.get(name)) is _WatchedDict and state[name].owner() is self for name in _WATCHED)
            and not any(state[name] for name in _WATCHED)
            # An instance-level `forward` (accelerate's device and offload
            # hooks wrap it so) or `module.compile()` needs nn.Module.__call__;
            # the class's own forward bound to the module (what accelerate's
            # remove_hook_from_module leaves) does not.
            and ("forward" not in state or _is_own_forward(self, state["forward"]))
            and state.get("_compiled_call_impl") is None
            # A subclass's own forward (a LoRA branch added to the layer) or
            # QLinear.forward patched on the class runs through nn.Module.__call__.
            and type(self).forward is _QLINEAR_FORWARD
        ):
            fast = state["_fast_op"]
        state["_fast"] = fast

    def __setattr__(self, name, value):
        if isinstance(value, torch.Tensor) and value.is_inference():
            # A weight, scale or bias made under torch.inference_mode (quantize,
            # calibrate or load_state_dict run there) would make every later
            # forward with autograd on fail ("inference tensors cannot be saved
            # for backward"): the layer keeps a normal copy.
            with torch.inference_mode(False):
                value = (
                    nn.Parameter(value.clone(), value.requires_grad)
                    if isinstance(value, nn.Parameter)
                    else value.clone()
                )
        if name in ("weight_scale", "input_scale", "bias") and "_kernel_op" in self.__dict__:
            problem = self._state_problem(name, value, values=True)
            if problem is not None:
                raise problem
        super().__setattr__(name, value)
        self.__dict__["_fast"] = None
        if name == "input_scale" and "_kernel_op" in self.__dict__:
            self._bind_op()  # a static layer calibrated or un-calibrated by hand

    def __delattr__(self, name):
        super().__delattr__(name)
        self.__dict__["_fast"] = None

    def _uncalibrated(self, *args):
        if self.is_calibrated:  # a scale put in place since the op was bound (_buffers, register_buffer)
            self._bind_op()
            return self._op(*args)
        raise RuntimeError(
            f"{self._placed}QLinear({self.in_features} -> {self.out_features}) has static activation scales but "
            "was never calibrated: run `with qfp8.calibrate(model): model(batch)` over calibration data first "
            "(or load a checkpoint that holds input_scale)"
        )

    def pack_for_device(self) -> None:
        """Chooses the kernel for the weight's device and packs the weight for it."""
        if self.qweight.device.type == "meta":
            return
        canonical = self.canonical_weight()
        kernel, passed_over = select_kernel(self.kernel_request())
        self.qweight = kernel.pack(canonical.contiguous())
        self.kernel_notes = passed_over
        self._use_kernel(kernel)

    def _apply(self, fn, recurse=True):
        # Keep FP8 data FP8 and scales float32 when the model's dtype changes
        # (model.to(torch.bfloat16) casts every floating buffer), and repack
        # when the device changes: a kernel layout belongs to its device.
        canonical = self.canonical_weight()
        self.qweight = canonical
        self._use_kernel(REFERENCE_KERNEL)
        with keep_buffer_dtypes(self, ("qweight", "weight_scale", "input_scale")):
            super()._apply(fn, recurse)
        # The layer's compute dtype follows the model's (model.double(),
        # .half(), .to(dtype)), with or without a bias to show it; the kernel
        # is chosen again for it (a float64 layer takes the reference route).
        probe = torch.empty(0, dtype=self.orig_dtype, device=self.weight_scale.device)
        self.orig_dtype = fn(probe).dtype if self.bias is None else self.bias.dtype
        if self.float_weight is not None:  # follows the module as a weight would
            self.float_weight = fn(self.float_weight)
        if self.hessian is not None:  # float32 sums: only the device follows
            self.hessian = self.hessian.to(self.weight_scale.device)
        self.pack_for_device()
        return self

    # ------------------------------------------------------------ forward
    def __call__(self, *args, **kwargs):
        # nn.Module.__call__ costs two Python frames and a dozen checks per
        # call (a fifth of a small M = 1 layer's time). Armed (no hooks
        # on the module, no forward override, not calibrating; see _arm), with
        # no global hook and outside torch.compile (which traces the regular
        # path), the call is the op's dispatcher entry on the module's tensors.
        if _is_compiling():
            return super().__call__(*args, **kwargs)
        state = self.__dict__
        fast = state["_fast"]
        if (
            fast is not None
            and len(args) == 1
            and not kwargs
            and type(self).forward is _QLINEAR_FORWARD  # not patched on the class since the layer was armed
            and not _any_autocast()  # forward casts the input as torch.autocast does for nn.Linear
            # A call that needs a gradient takes forward (autograd.linear); the
            # CPU eager entry would hand it there too, other kernels' would not.
            and not (
                torch.is_grad_enabled()
                and (
                    getattr(args[0], "requires_grad", False)
                    or ((bias := state["_parameters"]["bias"]) is not None and bias.requires_grad)
                )
            )
            and not (
                _global_forward_hooks
                or _global_forward_pre_hooks
                or _global_backward_hooks
                or _global_backward_pre_hooks
            )
        ):
            buffers = state["_buffers"]
            try:
                return fast(
                    args[0],
                    buffers["qweight"],
                    buffers["weight_scale"],
                    state["_parameters"]["bias"],
                    buffers["input_scale"],
                    *state["_extra_args"],
                )
            except RuntimeError as error:
                if isinstance(args[0], Float8ActivationTensor):
                    return super().__call__(*args, **kwargs)  # forward takes the subclass route
                self._raise_input_error(args[0], error)
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, Float8ActivationTensor):
            # Already FP8 (an nn.Linear took it through F.linear's handler): the subclass route multiplies it.
            return nn.functional.linear(x, self.weight, self.bias)
        if (
            isinstance(x, torch.Tensor)
            and x.dtype in formats.FLOAT_DTYPES
            and x.device.type != "meta"  # torch has no autocast state for meta (it raises)
            and torch.is_autocast_enabled(x.device.type)
        ):
            # As torch.autocast runs nn.Linear: the input goes in (and comes out) in the autocast dtype.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.calibrating:
            try:
                return self._calibration_forward(x)
            except (RuntimeError, AttributeError) as error:  # an input the layer cannot take: the same error as
                self._raise_input_error(x, error)  # outside calibration (a list has no reshape: AttributeError)
        if not _is_compiling() and self.__dict__["_fast"] is None and not torch.jit.is_tracing():
            # Something disarmed the fast path (see _arm); arm it again if the
            # regular path is no longer needed. Not while torch.jit traces:
            # its check traces twice and compares (the fast path records no
            # module scope, so the second graph would differ).
            self._arm()
        return self._op_forward(x)

    def _op_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's linear op on ``x`` (a gradient-needing call through the kernel's autograd wrapper); an
        input the op cannot take raises the layer's error (:meth:`_raise_input_error`)."""
        # Buffers read from their dicts directly: nn.Module.__getattr__ costs
        # about a microsecond per lookup, a sizeable part of a small M=1 layer.
        buffers = self._buffers
        op, bias = self._op, self._parameters["bias"]
        args = (x, buffers["qweight"], buffers["weight_scale"], bias, buffers["input_scale"], *self._extra_args)
        try:
            if op is self._kernel_op and needs_grad(x, bias):
                return linear(op, self._unpack, *args)
            return op(*args)
        except (RuntimeError, AttributeError) as error:  # AttributeError: an input with no .requires_grad (a list)
            self._raise_input_error(x, error)


_QLINEAR_FORWARD = QLinear.forward  # as defined here: see _arm
_any_autocast = torch._C._is_any_autocast_enabled
