"""QLinear's calibration: static activation scales from the running maximum of the inputs seen, and the
accuracy modes' re-rounding of the weight (see :mod:`qfp8.rounding`) from the inputs' ``H = sum x^T x``."""

from __future__ import annotations

import torch

from qfp8 import formats, rounding
from qfp8.library.routing import REFERENCE_KERNEL

__all__ = ["QLinearCalibrationMixin"]


class QLinearCalibrationMixin:
    """``QLinear``'s calibration forward, its start / end / abort, and accuracy-mode rounding."""

    def _calibration_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The running maximum of every batch seen so far sets the scale used
        # now, so the layers downstream see this layer's quantization error.
        # What a batch measures is kept only once the layer has taken it (a
        # refused input leaves the calibration as it was).
        if self.scheme.activations != "static":
            out = self._op(x, self.qweight, self.weight_scale, self.bias, self.input_scale, *self._extra_args)
            self._accumulate_hessian(x)
            return out
        x2d = x.reshape(-1, self.in_features)
        batch_amax = formats.activation_amax(x2d, "tensor")
        # A batch with no finite nonzero value (empty, all zeros, all NaN/Inf)
        # measures nothing: amax = 0 would calibrate the layer to eps, where
        # every real input saturates.
        measured = bool(batch_amax > 0)
        amax = self._calibration_amax
        if measured:
            amax = batch_amax if amax is None else torch.maximum(batch_amax, amax)
        scale = formats.scale_from_amax(batch_amax if amax is None else amax, self.scheme.activation_dtype)
        out = self._kernel_op(x, self.qweight, self.weight_scale, self.bias, scale, *self._extra_args)
        if measured:
            self._calibration_amax = amax
        self._accumulate_hessian(x)
        return out

    def _accumulate_hessian(self, x: torch.Tensor) -> None:
        if self.hessian is None:
            return
        x2d = x.detach().reshape(-1, self.in_features).to(torch.float32)
        x2d = torch.nan_to_num(x2d, nan=0.0, posinf=0.0, neginf=0.0)
        self._calibration_rows += x2d.shape[0]
        if self.hessian.dim() == 1:  # "scale" reads diag(H) only: [K], not [K, K]
            self.hessian.add_(x2d.square().sum(0))
        else:
            self.hessian.addmm_(x2d.t(), x2d)

    def start_calibration(self) -> None:
        self.calibrating = True
        self._fast_op = None
        self._calibration_amax = None
        self._calibration_rows = 0
        if self.float_weight is not None:
            shape = (self.in_features,) if self.accuracy == "scale" else (self.in_features, self.in_features)
            self.hessian = torch.zeros(shape, dtype=torch.float32, device=self.float_weight.device)

    def abort_calibration(self) -> None:
        """Leaves calibration without using what it recorded (an exception in the block): the layer's scales,
        weights and any float weight still waiting for an accuracy mode stay as they were before it."""
        self.calibrating = False
        self._calibration_amax = None
        self.hessian = None
        self._bind_op()

    def end_calibration(self) -> None:
        self.calibrating = False
        if self._calibration_amax is not None:
            self.input_scale = formats.scale_from_amax(self._calibration_amax, self.scheme.activation_dtype)
        self._calibration_amax = None
        self._bind_op()
        if self.hessian is not None:
            self._requantize_for_accuracy()

    @property
    def accuracy_pending(self) -> bool:
        """True while an accuracy-mode layer still waits for calibration data."""
        return self.float_weight is not None

    def _requantize_for_accuracy(self) -> None:
        """Chooses the FP8 weights for the calibration inputs (see :mod:`qfp8.rounding`).

        No batch reached the layer: it keeps waiting. Every input was zero (or
        NaN/Inf, counted as zero): any choice is as good, the nearest rounding
        stays. ``"gptq"`` with fewer calibration rows than inputs (a singular
        ``H``, which it would overfit) runs ``"scale"`` instead; the layer's
        ``accuracy_note`` says so (``calibrate`` warns once for all such layers).
        """
        hessian, self.hessian = self.hessian, None
        rows, self._calibration_rows = getattr(self, "_calibration_rows", 0), 0
        self.accuracy_note = None
        if not rows:
            return  # no calibration batch reached this layer: keep waiting
        if not bool((hessian if hessian.dim() == 1 else hessian.diagonal()).any()):
            self.float_weight = None  # all inputs zero: the round-to-nearest weights stay
            self.accuracy_note = "every calibration input was zero: round-to-nearest weights kept"
            return
        mode = self.accuracy
        if mode == "gptq" and rows < self.in_features:
            mode = "scale"
            self.accuracy_note = (
                f"accuracy='gptq' saw {rows} calibration rows for {self.in_features} inputs (it needs more rows "
                "than inputs): ran accuracy='scale'"
            )
        qweight, scale = rounding.quantize_weight(
            self.float_weight,
            hessian,
            mode,
            self.scheme.weight_dtype,
            self.scheme.weight_scale,
            self.scheme.block_size or formats.DEFAULT_BLOCK_SIZE,
        )
        self.qweight = qweight.to(self.weight_scale.device)
        self.weight_scale = scale.to(self.weight_scale.device)
        self.float_weight = None
        self._use_kernel(REFERENCE_KERNEL)
        self.pack_for_device()
