"""``QConv1d`` / ``QConv2d``: convolutions whose weight is FP8, run as an FP8 linear layer.

A convolution is a matrix product of its input's patches (im2col) with its
weight flattened to ``[N, K]`` (``N`` out channels, ``K = C/groups * prod(kernel)``),
so these modules are QLinears on the patch matrix: the same weight dtypes,
weight scales (tensor / channel / block), activation schemes (None, dynamic,
static with calibration), accuracy modes and kernels.

Layout. Inside a patch the channel is the fastest index (``K`` order ``(*kernel, C)``). On the CPU kernel, with
no gradient to track, the layer calls ``qfp8::scaled_conv_cpu`` (qfp8/library/conv_cpu.py): the input is copied
once into a zero-padded channels-last buffer, where each kernel row of a patch is one contiguous run, and the
kernel reads the patches from there (in place on avx512bf16, gathered run by run elsewhere). Otherwise (gradients,
calibration, block weight scales, other devices) the patch matrix is gathered from a channels-last view of the
input in one strided copy. The output keeps the input's memory format, as ``nn.Conv``'s does. Block weight scales
cover blocks of the weight flattened in PyTorch's order ``(C, *kernel)``, so a layer with block scales gathers
patches in that order.

State (``state_dict``, what ``qfp8.save_pretrained`` writes): ``weight`` FP8
``[N, C/groups * prod(kernel)]``, the convolution's weight flattened in
PyTorch's order (``conv.weight.reshape(N, -1)``); ``weight_scale``
(``[1]``, ``[N, 1]`` or the block grid of that matrix), ``input_scale``,
``bias``: compressed-tensors' 2-D ``float-quantized`` form.

Grouped convolutions (``groups > 1``) take the reference route (the
dequantized weight, one product per group): the kernels multiply one matrix
per layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from qfp8 import formats, rounding
from qfp8.library.autograd import needs_grad
from qfp8.library.conv_cpu import CONV_OP, conv_output_sizes
from qfp8.library.ops import reference_activation
from qfp8.library.routing import REFERENCE_KERNEL
from qfp8.nn.qlinear import QLinear
from qfp8.nn.scheme import QuantizationScheme

__all__ = [
    "GROUPED_REASON",
    "PADDING_MODES",
    "QCONV_CLASSES",
    "QConv1d",
    "QConv2d",
    "QConvNd",
    "conv1d_class_reason",
    "conv_skeleton",
    "convolution_class_reason",
    "convolution_reason",
    "is_convolution",
    "is_linear_layer",
    "is_transformers_conv1d",
    "linear_features",
    "linear_from_conv1d",
    "quantize_convolution",
    "quantizes_convolutions",
]

_LINEAR_CPU_OP = getattr(torch.ops.qfp8, "scaled_linear_cpu", None)
_LINEAR_CPU_OP = _LINEAR_CPU_OP.default if _LINEAR_CPU_OP is not None else None
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
GROUPED_REASON = (
    "groups={groups}: the FP8 kernels run one matrix per layer; grouped convolutions take the reference route"
)


def _tuple(value, dims: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims
    if isinstance(value, (tuple, list)) and len(value) == dims and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise TypeError(f"{what} must be an int or {dims} ints, got {value!r}")


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, R, C]`` -> contiguous ``[B, C, R]``, one batch at a time: torch's copy of a 2-D transpose
    runs several times faster than that of a batched one."""
    out = x.new_empty(x.shape[0], x.shape[2], x.shape[1])
    for b in range(x.shape[0]):
        out[b].copy_(x[b].t())
    return out


class QConvNd(QLinear):
    """The shared body of :class:`QConv1d` and :class:`QConv2d` (``dims`` spatial dimensions)."""

    dims = 0

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        scheme: QuantizationScheme | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        name = type(self).__name__
        kernel_size = _tuple(kernel_size, self.dims, f"{name}: kernel_size")
        stride = _tuple(stride, self.dims, f"{name}: stride")
        dilation = _tuple(dilation, self.dims, f"{name}: dilation")
        if not isinstance(groups, int) or groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: groups={groups!r} must be a positive int dividing in_channels={in_channels} and "
                f"out_channels={out_channels}"
            )
        if min(kernel_size + stride + dilation) < 1:
            raise ValueError(
                f"{name}: kernel_size {kernel_size}, stride {stride} and dilation {dilation} must be positive"
            )
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{name}: padding={padding!r}; expected 'same', 'valid' or ints")
            if padding == "same" and any(s != 1 for s in stride):
                raise ValueError(f"{name}: padding='same' needs stride 1 (as nn.Conv{self.dims}d), got {stride}")
        else:
            padding = _tuple(padding, self.dims, f"{name}: padding")
            if min(padding) < 0:
                raise ValueError(f"{name}: padding {padding} must not be negative")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{name}: padding_mode={padding_mode!r}; expected one of {list(PADDING_MODES)}")
        scheme = scheme or QuantizationScheme()
        super().__init__(
            in_channels // groups * math.prod(kernel_size), out_channels, bias=bias, scheme=scheme, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.groups, self.padding_mode = groups, padding_mode
        # (C, *kernel) order for block scales (they cover blocks of PyTorch's flattening), else (*kernel, C).
        self.channels_last_patches = scheme.weight_scale != "block"

    # ------------------------------------------------------------ building
    @classmethod
    def from_conv(
        cls, conv: nn.Module, scheme: QuantizationScheme, name: str = "", accuracy: str | None = None
    ) -> QConvNd:
        """Quantizes ``conv`` (an ``nn.Conv1d`` / ``nn.Conv2d`` of this class's dimensions) into a new module."""
        rounding.check_mode(accuracy)
        label = name or repr(conv)
        expected = {1: nn.Conv1d, 2: nn.Conv2d}[cls.dims]
        if not isinstance(conv, expected):
            raise TypeError(f"{cls.__name__}.from_conv takes an nn.Conv{cls.dims}d, got {type(conv).__name__}")
        if accuracy is not None and conv.groups > 1:
            raise ValueError(f"module {label!r}: accuracy={accuracy!r} needs groups=1, got groups={conv.groups}")
        weight = conv.weight.detach()
        bad = formats.nonfinite_count(weight)
        if bad:
            raise ValueError(
                f"module {label!r}: weight {tuple(weight.shape)} holds {bad} NaN/Inf value(s); "
                "FP8 cannot represent them. Fix or exclude this module (exclude=[...])."
            )
        module = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
            conv.groups, conv.bias is not None, conv.padding_mode, scheme, weight.dtype, torch.device("meta"),
        )  # fmt: skip
        matrix = module.patch_order(weight.reshape(weight.shape[0], -1))
        qweight, scale = formats.quantize_weight(
            matrix, scheme.weight_dtype, scheme.weight_scale, scheme.block_size or None
        )
        module.qweight, module.weight_scale = qweight, scale
        if conv.bias is not None:
            module.bias = nn.Parameter(conv.bias.detach().clone(), requires_grad=False)
        if accuracy is not None:
            module.accuracy, module.float_weight = accuracy, matrix.clone()
        module.label = name or None
        module.pack_for_device()
        return module

    # ----------------------------------------------- weight orders (K axis)
    def patch_order(self, matrix: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` in PyTorch's ``(C, *kernel)`` order -> the layer's patch order (contiguous)."""
        if not self.channels_last_patches:
            return matrix.contiguous()
        n = matrix.shape[0]
        return matrix.reshape(n, -1, *self.kernel_size).movedim(1, -1).reshape(n, -1).contiguous()

    def stored_order(self, matrix: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` in the layer's patch order -> PyTorch's ``(C, *kernel)`` order (contiguous)."""
        if not self.channels_last_patches:
            return matrix.contiguous()
        n = matrix.shape[0]
        return matrix.reshape(n, *self.kernel_size, -1).movedim(-1, 1).reshape(n, -1).contiguous()

    def stored_weight(self) -> torch.Tensor:
        """The FP8 weight as saved: ``[N, C/groups * prod(kernel)]`` in PyTorch's flattening order."""
        return self.stored_order(self.canonical_weight())

    def pack_for_device(self) -> None:
        if self.groups == 1:
            return super().pack_for_device()
        if self.qweight.device.type == "meta":
            return None
        self.qweight = self.canonical_weight().contiguous()
        self._use_kernel(REFERENCE_KERNEL)
        self.kernel_notes = [GROUPED_REASON.format(groups=self.groups)]
        return None

    def extra_repr(self) -> str:
        parts = [f"{self.in_channels}, {self.out_channels}", f"kernel_size={self.kernel_size}"]
        parts.append(f"stride={self.stride}")
        for key, default in (("padding", (0,) * self.dims), ("dilation", (1,) * self.dims), ("groups", 1)):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)!r}")
        if self.padding_mode != "zeros":
            parts.append(f"padding_mode={self.padding_mode!r}")
        parts.append(f"bias={self.bias is not None}, scheme={self.scheme.describe()}, kernel={self.packing}")
        return ", ".join(parts)

    # ------------------------------------------------------------ patches
    def _pads(self) -> list[tuple[int, int]]:
        """(before, after) padding of each spatial dimension, as nn.Conv computes it for 'same'."""
        if self.padding == "valid":
            return [(0, 0)] * self.dims
        if self.padding == "same":
            pads = []
            for k, d in zip(self.kernel_size, self.dilation, strict=True):
                total = d * (k - 1)
                pads.append((total // 2, total - total // 2))
            return pads
        return [(p, p) for p in self.padding]

    def _channels_last_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, *S]`` padded and seen as ``[B, *S, C]`` with unit channel stride (one copy at most)."""
        pads = self._pads()
        flat = [p for pair in reversed(pads) for p in pair]  # F.pad lists the last dimension first
        if self.padding_mode != "zeros" and any(flat):
            try:
                x = F.pad(x, flat, mode=self.padding_mode)
            except RuntimeError as error:  # reflect padding wider than the input, for one
                raise ValueError(f"{self._name()}: padding_mode={self.padding_mode!r}: {error}") from None
            flat = []
        channels_last = x.movedim(1, -1)
        if channels_last.stride(-1) != 1 and x.is_contiguous():
            channels_last = _transposed(x.reshape(x.shape[0], x.shape[1], -1)).view(channels_last.shape)
        if any(flat):
            return F.pad(channels_last, [0, 0, *flat]).contiguous()
        return channels_last if channels_last.stride(-1) == 1 else channels_last.contiguous()

    def _output_sizes(self, padded: torch.Tensor) -> list[int]:
        sizes = []
        for size, k, s, d in zip(padded.shape[1:-1], self.kernel_size, self.stride, self.dilation, strict=True):
            sizes.append((size - d * (k - 1) - 1) // s + 1)
        return sizes

    def _patches(self, padded: torch.Tensor, out: list[int], first: int, channels: int) -> torch.Tensor:
        """The ``[M, K]`` patch matrix of channels ``first .. first + channels`` of ``padded`` ``[B, *S, C]``.

        Views (``Tensor.unfold`` per spatial dimension: windows of the dilated kernel's span, every ``dilation``-th
        element kept) and one copy, the final reshape."""
        windows = padded[..., first : first + channels]
        for axis, (k, s, d) in enumerate(zip(self.kernel_size, self.stride, self.dilation, strict=True)):
            windows = windows.unfold(1 + axis, d * (k - 1) + 1, s)[..., ::d]  # [B, *out, C, *kernel] at the end
        if self.channels_last_patches:
            windows = windows.movedim(1 + self.dims, -1)  # [B, *out, *kernel, C]
        return windows.reshape(padded.shape[0] * math.prod(out), channels * math.prod(self.kernel_size))

    # ------------------------------------------------------------ forward
    def _name(self) -> str:
        return f"{self._placed}{type(self).__name__}({self.in_channels}, {self.out_channels}, {self.kernel_size})"

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name()}: the input must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{self._name()}: the input must be a floating-point tensor, got {x.dtype}")
        if x.dim() not in (self.dims + 1, self.dims + 2) or x.shape[-self.dims - 1] != self.in_channels:
            raise ValueError(
                f"{self._name()}: the input has shape {tuple(x.shape)}; expected [batch, {self.in_channels}, "
                f"{', '.join('*' * self.dims)}] (or no batch dimension)"
            )
        if x.device != self.qweight.device and x.device.type != "meta":
            raise ValueError(
                f"{self._name()}: the input is on {x.device}, the layer's weights on {self.qweight.device}"
            )

    def _too_small(self, x: torch.Tensor, padded: list[int]) -> ValueError:
        span = [d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation, strict=True)]
        return ValueError(
            f"{self._name()}: the input {tuple(x.shape)} (padded: {tuple(padded)}) is smaller than the dilated "
            f"kernel ({span})"
        )

    def _reads_in_place(self, x: torch.Tensor) -> bool:
        """Whether the CPU kernel's convolution op takes ``x`` (no patch matrix in PyTorch, see conv_cpu.py)."""
        return (
            CONV_OP is not None
            and self.groups == 1
            and self.channels_last_patches
            and not self.calibrating
            and self._op is self._kernel_op
            and self._kernel_op is _LINEAR_CPU_OP
            and x.device.type == "cpu"
            and not needs_grad(x, self._parameters["bias"])
        )

    def _convolution(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, *S]`` through the CPU kernel's convolution op (padding modes other than zeros padded
        here first)."""
        given, pads = x, [p for pair in self._pads() for p in pair]
        if self.padding_mode != "zeros" and any(pads):
            try:
                x = F.pad(x, [p for pair in reversed(self._pads()) for p in pair], mode=self.padding_mode)
            except RuntimeError as error:  # reflect padding wider than the input, for one
                raise ValueError(f"{self._name()}: padding_mode={self.padding_mode!r}: {error}") from None
            pads = [0] * len(pads)
        if min(conv_output_sizes(x.shape[2:], self.kernel_size, self.stride, pads, self.dilation)) < 1:
            raise self._too_small(given, [size + pads[2 * i] + pads[2 * i + 1] for i, size in enumerate(x.shape[2:])])
        buffers = self._buffers
        args = (x, buffers["qweight"], buffers["weight_scale"], self._parameters["bias"], buffers["input_scale"])
        return CONV_OP(*args, *self._extra_args, self.kernel_size, self.stride, pads, self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.device.type != "meta" and x.dtype in formats.FLOAT_DTYPES and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # as torch.autocast runs nn.Conv
        unbatched = x.dim() == self.dims + 1
        if self._reads_in_place(x):
            y = self._convolution(x.unsqueeze(0) if unbatched else x)
            return y.squeeze(0) if unbatched else y
        padded = self._channels_last_input(x.unsqueeze(0) if unbatched else x)
        out = self._output_sizes(padded)
        if min(out) < 1:
            raise self._too_small(x, list(padded.shape[1:-1]))
        if self.groups > 1:
            y = self._grouped(padded, out, x.dtype)
        else:
            y = self._linear(self._patches(padded, out, 0, self.in_channels))
        y = y.view(padded.shape[0], -1, self.out_channels)
        if x.is_contiguous():
            y = _transposed(y)  # the output keeps the input's memory format, as nn.Conv's does
        else:
            y = y.movedim(-1, 1)
        y = y.view(padded.shape[0], self.out_channels, *out) if y.is_contiguous() else y.unflatten(2, out)
        return y.squeeze(0) if unbatched else y

    def _linear(self, patches: torch.Tensor) -> torch.Tensor:
        """The layer's FP8 linear op on the patch matrix (calibration and gradients as QLinear's)."""
        if self.calibrating:
            return self._calibration_forward(patches)
        return self._op_forward(patches)

    def _grouped(self, padded: torch.Tensor, out: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The reference route of a grouped convolution: one product per group with the dequantized weight."""
        input_scale = self.input_scale
        if self.scheme.activations == "static":
            if self.calibrating:
                input_scale = self._calibrated_scale(padded)
            elif not self.is_calibrated:
                self._uncalibrated()
        weight = formats.dequantize_weight(self.canonical_weight(), self.weight_scale, self.scheme.block_size or None)
        rows, channels = self.out_channels // self.groups, self.in_channels // self.groups
        products = []
        for g in range(self.groups):
            patches = self._patches(padded, out, g * channels, channels)
            values = reference_activation(
                patches, self.scheme.activation_mode, self.scheme.activation_dtype, input_scale
            )
            products.append(values @ weight[g * rows : (g + 1) * rows].t())
        y = torch.cat(products, dim=1)
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(dtype)

    def _calibrated_scale(self, padded: torch.Tensor) -> torch.Tensor:
        """As QLinear's calibration: the running maximum of the inputs seen sets the static scale used now."""
        batch_amax = formats.activation_amax(padded.reshape(-1, padded.shape[-1]), "tensor")
        amax = self._calibration_amax
        if bool(batch_amax > 0):
            amax = batch_amax if amax is None else torch.maximum(batch_amax, amax)
            self._calibration_amax = amax
        return formats.scale_from_amax(batch_amax if amax is None else amax, self.scheme.activation_dtype)

    # --------------------------------------------------------- state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if destination[prefix + "weight"].device.type != "meta":
            destination[prefix + "weight"] = self.stored_order(destination[prefix + "weight"])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        own = {key: value for key, value in state_dict.items() if key.startswith(prefix)}
        weight = own.get(prefix + "weight")
        if weight is not None and tuple(weight.shape) == (self.out_features, self.in_features):
            own[prefix + "weight"] = self.patch_order(weight)
        super()._load_from_state_dict(own, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


class QConv1d(QConvNd):
    """An ``nn.Conv1d`` with an FP8 weight (see the module docstring)."""

    dims = 1


class QConv2d(QConvNd):
    """An ``nn.Conv2d`` with an FP8 weight (see the module docstring)."""

    dims = 2


QCONV_CLASSES = {nn.Conv1d: QConv1d, nn.Conv2d: QConv2d}


def convolution_class_reason(module: nn.Module) -> str | None:
    """Why ``quantize`` keeps this convolution in float (None: it is quantized)."""
    base = next((cls for cls in QCONV_CLASSES if isinstance(module, cls)), None)
    if base is None:
        return f"{type(module).__name__} is not an nn.Conv1d or nn.Conv2d"
    if type(module).forward is not base.forward:
        return f"{type(module).__name__} has its own forward"
    weight = module.weight
    if not weight.is_floating_point() or weight.dtype in formats.FP8_DTYPES.values():
        return f"weight dtype {weight.dtype} is not a float format"
    if weight.device.type == "meta":
        return "weight is on the meta device (offloaded or never loaded)"
    if weight.numel() == 0:
        return "empty weight"
    if module._forward_pre_hooks:
        return "has forward pre-hooks (weight_norm or pruning recompute its weight): remove them first"
    return None


def quantize_convolution(
    conv: nn.Module, scheme: QuantizationScheme, name: str = "", accuracy: str | None = None
) -> QConvNd:
    """The QConv1d / QConv2d of ``conv`` (an ``nn.Conv1d`` / ``nn.Conv2d``)."""
    for base, qclass in QCONV_CLASSES.items():
        if isinstance(conv, base):
            return qclass.from_conv(conv, scheme, name, accuracy)
    raise TypeError(f"quantize_convolution takes an nn.Conv1d or nn.Conv2d, got {type(conv).__name__}")


def is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers, weight ``[in, out]``), which is no convolution."""
    return _transformers_conv1d_class(module) is not None


def _transformers_conv1d_class(module: nn.Module) -> type | None:
    return next(
        (c for c in type(module).__mro__ if c.__name__ == "Conv1D" and c.__module__.startswith("transformers.")), None
    )


def conv1d_class_reason(module: nn.Module) -> str | None:
    """Why ``quantize`` keeps a transformers ``Conv1D`` float whatever its weight: a subclass with its own forward."""
    base = _transformers_conv1d_class(module)
    return f"{type(module).__name__} has its own forward" if type(module).forward is not base.forward else None


def is_linear_layer(module: nn.Module) -> bool:
    """A layer ``quantize`` replaces by a QLinear: an ``nn.Linear``, or transformers' ``Conv1D`` (a linear layer
    whose weight is stored ``[in, out]``)."""
    return isinstance(module, nn.Linear) or is_transformers_conv1d(module)


def linear_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear layer (:func:`is_linear_layer`)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    in_features, out_features = module.weight.shape
    return in_features, out_features


def conv_skeleton(module: nn.Module, scheme: QuantizationScheme, name: str) -> QLinear | None:
    """A meta-device QConv1d / QConv2d shaped as the convolution ``module`` (a QLinear for transformers'
    ``Conv1D``), for a checkpoint's state to be assigned to; None for any other module."""
    if is_transformers_conv1d(module):
        in_features, out_features = module.weight.shape
        skeleton = QLinear(in_features, out_features, module.bias is not None, scheme, module.weight.dtype, "meta")
        skeleton.converted_from = type(module).__name__
    elif is_convolution(module):
        qclass = next(q for base, q in QCONV_CLASSES.items() if isinstance(module, base))
        skeleton = qclass(
            module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
            module.dilation, module.groups, module.bias is not None, module.padding_mode, scheme, module.weight.dtype,
            torch.device("meta"),
        )  # fmt: skip
    else:
        return None
    skeleton.label = name
    if scheme.activations == "static":
        skeleton.input_scale = torch.ones(1, device="meta")  # a slot for the stored scale
    return skeleton


def linear_from_conv1d(module: nn.Module, scheme: QuantizationScheme, name: str = "", accuracy=None) -> QLinear:
    """A QLinear computing transformers' ``Conv1D`` (GPT-2's layers: ``x @ weight + bias``, weight ``[in, out]``).

    The QLinear holds the weight transposed, ``[out, in]``, as every linear layer of qfp8 stores it."""
    if not is_transformers_conv1d(module):
        raise TypeError(f"linear_from_conv1d takes transformers' Conv1D, got {type(module).__name__}")
    weight = module.weight
    qlinear = QLinear.from_weight(weight.t(), module.bias, scheme, name or repr(module), accuracy, label=name or None)
    qlinear.converted_from = type(module).__name__
    return qlinear


def quantizes_convolutions(model: nn.Module) -> bool:
    """Whether ``quantize`` takes the convolutions of ``model``: not those of a transformers model (a vision or
    audio front end), which transformers and vLLM load in float only, so that its checkpoints still load there."""
    return not any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


def convolution_reason(module: nn.Module, accuracy: str | None) -> str:
    """Why ``quantize`` keeps the convolution ``module`` in float ("" when it quantizes it)."""
    if accuracy is not None and module.groups > 1:
        return f"accuracy={accuracy!r} needs groups=1 (this convolution has groups={module.groups})"
    return convolution_class_reason(module) or ""


def is_convolution(module: nn.Module) -> bool:
    """An ``nn.Conv1d`` / ``nn.Conv2d`` that ``quantize`` considers (not already an FP8 one)."""
    return isinstance(module, tuple(QCONV_CLASSES))
