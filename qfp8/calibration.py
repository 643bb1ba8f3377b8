"""``calibrate`` and ``freeze``: static activation scales (and accuracy-mode weights) from calibration data,
committed for every layer or for none."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from qfp8 import formats
from qfp8.nn import QLinear
from qfp8.nn.experts import QExperts
from qfp8.quantize_report import _first_names

__all__ = ["calibrate", "check_calibrated", "freeze"]


def _qlinears(model: nn.Module) -> dict[str, QLinear]:
    """Every QLinear of the model by name, each expert of a fused experts module (``<name>[e]``) included."""
    seen, found = set(), {}
    for name, module in model.named_modules():
        if isinstance(module, QLinear) and id(module) not in seen:
            seen.add(id(module))
            found[name] = module
        elif isinstance(module, QExperts) and id(module) not in seen:
            seen.add(id(module))
            found.update(module.named_experts(name))
    return found


def _calibrated_modules(model: nn.Module):
    """Every module taking part in calibration: QLinears and FP8 KV caches."""
    for module in model.modules():
        if hasattr(module, "start_calibration") and hasattr(module, "end_calibration"):
            yield module


def _uses_calibration(module: nn.Module) -> bool:
    """Whether calibrating changes the module: an FP8 KV cache, static activation scales, or an accuracy mode whose
    float weights still wait for data (fused experts: any of their experts)."""
    if hasattr(module, "qfp8_kv_calibrating"):
        return True
    parts = module.experts if isinstance(getattr(module, "experts", None), list) else [module]
    return any(
        getattr(getattr(part, "scheme", None), "activations", None) == "static"
        or getattr(part, "accuracy_pending", False)
        for part in parts
    )


@contextlib.contextmanager
def calibrate(model: nn.Module):
    """Records static activation (and KV-cache) scales over the batches run inside.

    Each static layer keeps the maximum of its input's amax over all batches
    of this block; a later ``calibrate`` measures them afresh (it replaces,
    not merges). An accuracy mode chooses the FP8 weights once, at the end of
    the first block that reaches the layer (the float weights are dropped
    then): a later block re-measures static scales only, with a warning.
    An exception (Ctrl-C included) leaves the block without using what it
    recorded: the model is as it was before it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate takes an nn.Module, got {type(model).__name__}")
    modules = list(dict.fromkeys(_calibrated_modules(model)))
    if not modules:
        raise ValueError("calibrate: the model has no QLinear; call qfp8.quantize(model, ...) first")
    if not any(_uses_calibration(m) for m in modules):
        warnings.warn(
            f"calibrate: nothing in {type(model).__name__} uses calibration data: its {len(modules)} quantized "
            "layer(s) scale their activations per batch (dynamic) or keep them in float (weights only), no accuracy "
            "mode waits for data and there is no FP8 KV cache; the batches run as usual and change nothing "
            "(quantize with activations='static', an accuracy mode or kv_cache='float8_e4m3fn' to calibrate)",
            stacklevel=3,
        )
    fitted = [name for name, m in _qlinears(model).items() if m.accuracy and not m.accuracy_pending]
    if fitted:
        shown = _first_names(fitted, 3)
        warnings.warn(
            f"calibrate: {len(fitted)} layer(s) ({shown}) already had their FP8 weights chosen by their accuracy "
            "mode in an earlier calibrate, and their float weights are gone: this pass re-measures static scales "
            "only, the weights stay as chosen then (quantize the float model again to choose them on new data)",
            stacklevel=3,
        )
    if any(_is_calibrating(m) for m in modules):
        raise RuntimeError(
            "calibrate: the model is already inside a calibrate block; nested blocks would each measure part "
            "of the batches (run every calibration batch in one block)"
        )
    for module in modules:
        module.start_calibration()
    try:
        with torch.no_grad():
            yield model
    except GeneratorExit:
        # The block sat in a generator that its caller closed early (break,
        # islice): a normal end for the batches that ran, not a failure.
        _commit(model, modules)
        raise
    except BaseException:
        for module in modules:
            getattr(module, "abort_calibration", module.end_calibration)()
        raise
    _commit(model, modules)


def _is_calibrating(module: nn.Module) -> bool:
    if isinstance(module, QExperts):
        return any(e.calibrating for e in module.experts)
    return bool(getattr(module, "calibrating", False) or getattr(module, "qfp8_kv_calibrating", False))


def _state_of(module: nn.Module) -> list[tuple[nn.Module, dict, dict, dict]]:
    """What ending calibration may replace in ``module`` (and in each expert of a QExperts): its attributes,
    buffers and parameters, by reference (ending calibration assigns new tensors, never writes in place)."""
    owners = [module, *(module.experts if isinstance(module, QExperts) else ())]
    return [(m, dict(m.__dict__), dict(m._buffers), dict(m._parameters)) for m in owners]


def _commit(model: nn.Module, modules: list[nn.Module]) -> None:
    """Ends calibration for every module, all or nothing: an error (a layer's accuracy mode failing, Ctrl-C)
    puts back what the modules ended so far had before, and leaves every module out of calibration."""
    saved = [_state_of(module) for module in modules]
    try:
        for module in modules:
            module.end_calibration()
    except BaseException:
        for states in saved:
            for owner, attributes, buffers, parameters in states:
                owner.__dict__.update(attributes)
                owner._buffers.clear()
                owner._buffers.update(buffers)
                owner._parameters.clear()
                owner._parameters.update(parameters)
        for module in modules:
            getattr(module, "abort_calibration", module.end_calibration)()
        raise
    noted = [(name, m) for name, m in _qlinears(model).items() if getattr(m, "accuracy_note", None)]
    if noted:
        shown = "; ".join(f"{name}: {m.accuracy_note}" for name, m in noted[:3])
        warnings.warn(
            f"calibrate: {len(noted)} accuracy-mode layer(s) chose their weights otherwise than asked: {shown}"
            + (f"; and {len(noted) - 3} more" if len(noted) > 3 else ""),
            stacklevel=4,
        )
        for _, m in noted:
            m.accuracy_note = None


def check_calibrated(model: nn.Module, caller: str) -> None:
    """RuntimeError naming the layers that still wait for calibration (static scales, an accuracy mode)."""
    pending = [name for name, module in _qlinears(model).items() if not module.is_calibrated or module.accuracy_pending]
    if pending:
        shown = _first_names(pending, 5)
        raise RuntimeError(
            f"{caller}: {len(pending)} layer(s) with static activation scales or an accuracy mode were never "
            f"calibrated ({shown}); run `with qfp8.calibrate(model): model(batch)` over calibration data first "
            "(a layer that saw only zeros or non-finite inputs counts as not calibrated; a module whose code reads "
            "the layer's .weight itself, F.linear(x, proj.weight), never runs the layer: exclude such a layer)"
        )


def freeze(model: nn.Module) -> nn.Module:
    """Checks every layer is ready and packs the weights for their device's kernel."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze takes an nn.Module, got {type(model).__name__}")
    qlinears = _qlinears(model)
    if not qlinears:
        if getattr(model, "qfp8_kv_cache_dtype", None) is not None:
            return model  # an FP8 KV cache alone (weights=None): nothing to pack, its scales need no check
        raise ValueError("freeze: the model has no QLinear; call qfp8.quantize(model, ...) first")
    check_calibrated(model, "freeze")
    for name, module in qlinears.items():
        label = module.label or name
        if formats.first_nonfinite(module.qweight) is not None:  # packed or not: the same codes
            at = formats.first_nonfinite(module.canonical_weight())
            raise ValueError(
                f"freeze: module {label!r}: FP8 weight [{module.out_features}, {module.in_features}] holds a "
                f"NaN/Inf code at {list(at)}; the layer would output NaN"
            )
        for key, divides in (("weight_scale", None), ("input_scale", module.scheme.activation_dtype)):
            value = module._buffers.get(key)  # edited in place after quantize, say: as load_state_dict checks
            problem = None if value is None or value.device.type == "meta" else formats.scale_problem(value, divides)
            if problem is not None:
                raise ValueError(f"freeze: module {label!r}: {key} {list(value.shape)} holds {problem}")
    for module in qlinears.values():
        module.pack_for_device()
    return model
