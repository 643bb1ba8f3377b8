"""``quantize`` / ``calibrate`` / ``freeze`` and the report of what was done."""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from qfp8 import formats, rounding
from qfp8.nn import QLinear, QuantizationScheme

KV_CACHE_DTYPES = (None, "float8_e4m3fn", "float8_e5m2")


@dataclass
class ReportEntry:
    name: str
    in_features: int
    out_features: int
    quantized: bool
    scheme: str = ""
    kernel: str = ""
    reason: str = ""
    aliases: list[str] = field(default_factory=list)


@dataclass
class QuantizeReport:
    """Every ``nn.Linear`` of the model: its scheme and kernel, or why it was skipped."""

    entries: list[ReportEntry] = field(default_factory=list)

    @property
    def quantized(self) -> list[ReportEntry]:
        return [e for e in self.entries if e.quantized]

    @property
    def skipped(self) -> list[ReportEntry]:
        return [e for e in self.entries if not e.quantized]

    def __str__(self) -> str:
        header = ("module", "shape [out, in]", "status", "scheme / reason", "kernel")
        rows = [
            (
                e.name + (f" (= {', '.join(e.aliases)})" if e.aliases else ""),
                f"[{e.out_features}, {e.in_features}]",
                "quantized" if e.quantized else "skipped",
                e.scheme if e.quantized else e.reason,
                e.kernel,
            )
            for e in self.entries
        ]
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"{len(self.quantized)} quantized, {len(self.skipped)} skipped")
        return "\n".join(lines)

    __repr__ = __str__


class QuantizeResult(NamedTuple):
    model: nn.Module
    report: QuantizeReport


def _excluded_by(name: str, patterns) -> str | None:
    for pattern in patterns:
        # A pattern matches the full dotted name, or its tail ("lm_head"
        # matches "lm_head" and "model.lm_head").
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return pattern
    return None


def _skip_reason(module: nn.Linear) -> str | None:
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward"
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "used by nn.MultiheadAttention through its weight, not its forward"
    if not module.weight.is_floating_point() or module.weight.dtype in formats.FP8_DTYPES.values():
        return f"weight dtype {module.weight.dtype} is not a float format"
    if module.weight.device.type == "meta":
        return "weight is on the meta device (load it first, or use qfp8.from_pretrained)"
    if module.weight.numel() == 0:
        return "empty weight"
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize(
    model: nn.Module,
    weights: str | None = "float8_e4m3fn",
    weight_scale: str = "channel",
    activations: str | None = None,
    activation_scale: str = "token",
    kv_cache: str | None = None,
    exclude=("lm_head",),
    block_size=formats.DEFAULT_BLOCK_SIZE,
    accuracy: str | None = None,
) -> QuantizeResult:
    """Replaces every matching ``nn.Linear`` of ``model`` by a ``QLinear`` (in place).

    Weights are quantized now and packed for their device's kernel; static
    activation scales still need :func:`calibrate`, then :func:`freeze`.
    ``weights=None`` leaves every linear as it is (``kv_cache`` only).

    ``accuracy``: None (round to nearest, ``scale = amax / fmax``), ``"scale"``
    or ``"gptq"``: each weight is chosen again at the end of :func:`calibrate`
    to minimise its layer's output error on the calibration inputs (see
    ``qfp8/rounding.py``); the format is unchanged (FP8 weights with the same
    kind of scales). Needs a calibration pass before :func:`freeze`, and keeps
    the float weights in memory until then.

    ``activation_scale="token-mse"`` (dynamic activations): each token's scale
    is the one of 16 candidates ``amax / fmax * 2^(j/16)`` with the least
    squared rounding error, found at run time by qfp8's kernels (see
    :func:`qfp8.formats.token_mse_scale`). Saved checkpoints stay dynamic
    per-token ones: vLLM computes ``amax / fmax`` for them, qfp8 searches.
    Returns ``(model, report)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize takes an nn.Module, got {type(model).__name__}")
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; expected one of {list(KV_CACHE_DTYPES)}")
    if weights is None:
        if kv_cache is None:
            raise ValueError("quantize: weights=None and kv_cache=None leave nothing to quantize")
        from qfp8.nn.kv_cache import enable_fp8_kv_cache

        enable_fp8_kv_cache(model, formats.fp8_dtype(kv_cache))
        return QuantizeResult(model, QuantizeReport())
    scheme = QuantizationScheme.from_args(weights, weight_scale, activations, activation_scale, block_size)
    rounding.check_mode(accuracy)
    if isinstance(exclude, str):
        exclude = (exclude,)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, QLinear):
            raise ValueError(
                f"model is already quantized (module {name or type(model).__name__!r} is a QLinear); "
                "quantize a float model once"
            )

    report = QuantizeReport()
    planned: dict[int, ReportEntry] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear):
            continue
        if id(module) in planned:  # a shared submodule: one QLinear for all its names
            planned[id(module)].aliases.append(name)
            continue
        entry = ReportEntry(name, module.in_features, module.out_features, quantized=False)
        pattern = _excluded_by(name, exclude)
        entry.reason = f"excluded by pattern {pattern!r}" if pattern else (_skip_reason(module) or "")
        entry.quantized = not entry.reason
        planned[id(module)] = entry
        report.entries.append(entry)

    # Validate every weight before changing anything: a refused weight
    # leaves the model as it was.
    modules = dict(model.named_modules(remove_duplicate=False))
    for entry in report.quantized:
        weight = modules[entry.name].weight
        if not torch.isfinite(weight).all():
            raise ValueError(
                f"module {entry.name!r}: weight {list(weight.shape)} holds NaN/Inf values, which FP8 cannot "
                f"represent; fix the weight or pass exclude=[{entry.name!r}]"
            )

    for entry in report.quantized:
        qlinear = QLinear.from_linear(modules[entry.name], scheme, entry.name, accuracy=accuracy)
        entry.scheme = scheme.describe() + (f" accuracy-{accuracy}" if accuracy else "")
        entry.kernel = qlinear.packing
        for name in [entry.name, *entry.aliases]:
            _set_submodule(model, name, qlinear)
    if kv_cache is not None:
        from qfp8.nn.kv_cache import enable_fp8_kv_cache

        enable_fp8_kv_cache(model, formats.fp8_dtype(kv_cache))
    model.qfp8_scheme = scheme
    return QuantizeResult(model, report)


def _qlinears(model: nn.Module) -> dict[str, QLinear]:
    seen, found = set(), {}
    for name, module in model.named_modules():
        if isinstance(module, QLinear) and id(module) not in seen:
            seen.add(id(module))
            found[name] = module
    return found


def _calibrated_modules(model: nn.Module):
    """Every module taking part in calibration: QLinears and FP8 KV caches."""
    for module in model.modules():
        if hasattr(module, "start_calibration") and hasattr(module, "end_calibration"):
            yield module


@contextlib.contextmanager
def calibrate(model: nn.Module):
    """Records static activation (and KV-cache) scales over the batches run inside.

    Each static layer keeps the maximum of its input's amax over all batches.
    """
    modules = list(dict.fromkeys(_calibrated_modules(model)))
    if not modules:
        raise ValueError("calibrate: the model has no QLinear; call qfp8.quantize(model, ...) first")
    for module in modules:
        module.start_calibration()
    try:
        with torch.no_grad():
            yield model
    finally:
        for module in modules:
            module.end_calibration()


def freeze(model: nn.Module) -> nn.Module:
    """Checks every layer is ready and packs the weights for their device's kernel."""
    qlinears = _qlinears(model)
    if not qlinears:
        raise ValueError("freeze: the model has no QLinear; call qfp8.quantize(model, ...) first")
    uncalibrated = [name for name, module in qlinears.items() if not module.is_calibrated or module.accuracy_pending]
    if uncalibrated:
        shown = ", ".join(uncalibrated[:5]) + (f" and {len(uncalibrated) - 5} more" if len(uncalibrated) > 5 else "")
        raise RuntimeError(
            f"freeze: {len(uncalibrated)} layer(s) with static activation scales or an accuracy mode were never "
            f"calibrated ({shown}); "
            "run `with qfp8.calibrate(model): model(batch)` over calibration data first"
        )
    for module in qlinears.values():
        module.pack_for_device()
    return model
