"""``LoraQLinear``: peft's LoRA layer on a ``QLinear`` base, whose merge re-quantizes the FP8 weight.

Training needs nothing of its own: peft's ``lora.Linear`` adds
``lora_B(lora_A(dropout(x))) * scaling`` to the base layer's output, and the
base layer's backward gives ``x`` its gradient through the FP8 kernel
(:mod:`qfp8.library.transposed`). Merging differs: the merged weight
``W + scaling * B @ A`` is computed in float32 from the dequantized FP8
weight and quantized again with the layer's own scheme (FP8 dtype, scale
granularity, block size), so the merged model stays FP8 and its error
against the unmerged one is one FP8 rounding. ``unmerge`` subtracts the
same product and quantizes again (a second rounding: merge then unmerge
is close to, not bitwise, the weight before).

This module imports peft; :mod:`qfp8.integrations.peft` imports it only
once peft is loaded.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from qfp8.nn.qlinear import QLinear

__all__ = [
    "LoraQLinear",
    "qlinear_base",
]


def qlinear_base(target) -> QLinear | None:
    """The QLinear that ``target`` (a module, or a peft layer around one) holds as its base, or None."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    return base if isinstance(base, QLinear) else None


class LoraQLinear(Linear):
    """peft's ``lora.Linear`` around a :class:`~qfp8.nn.QLinear`; merging re-quantizes its FP8 weight."""

    def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
        name = kwargs.get("target_name")
        if config.use_dora:
            base = qlinear_base(base_layer)
            raise ValueError(
                f"module {name or repr(base)!r}: DoRA (use_dora=True) needs the float weight's column norms at "
                "every step; on an FP8 (qfp8) layer use plain LoRA"
            )
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.target_name = name

    def _get_in_out_features(self, module):
        base = qlinear_base(module)
        return (base.in_features, base.out_features) if base is not None else super()._get_in_out_features(module)

    def _module_name(self) -> str:
        base = self.get_base_layer()
        return getattr(self, "target_name", None) or base.label or f"QLinear({base.in_features} -> {base.out_features})"

    def _check_mergeable(self, adapters: list[str]) -> None:
        """Raises the ValueError naming the module when an adapter cannot be folded into the FP8 weight."""
        name = self._module_name()
        base = self.get_base_layer()
        if not isinstance(base, QLinear):
            raise ValueError(f"module {name!r}: its base layer is a {type(base).__name__}, not a QLinear")
        for adapter in adapters:
            if adapter in self.lora_variant:
                raise ValueError(
                    f"module {name!r}: adapter {adapter!r} is a LoRA variant "
                    f"({type(self.lora_variant[adapter]).__name__}); only plain LoRA can be merged into an FP8 "
                    "weight. Keep the adapter unmerged, or merge it on the float model and quantize after"
                )
            if self.lora_bias.get(adapter, False) and base.bias is None:
                raise ValueError(
                    f"module {name!r}: adapter {adapter!r} has a LoRA bias (lora_bias=True) but the base layer "
                    "has no bias to merge it into"
                )
        if base.accuracy_pending:
            raise ValueError(
                f"module {name!r}: its FP8 weight waits for calibration (accuracy={base.accuracy!r}); run "
                "qfp8.calibrate before merging"
            )

    def _fold(self, adapters: list[str], sign: float, safe: bool) -> None:
        """Adds (sign 1) or subtracts (sign -1) the adapters' products to the weight and bias, then re-quantizes."""
        base = self.get_base_layer()
        name = self._module_name()
        weight = base.weight.dequantize(torch.float32)
        bias = None if base.bias is None else base.bias.detach().to(torch.float32)
        with torch.no_grad():
            for adapter in adapters:
                weight += sign * self.get_delta_weight(adapter).to(device=weight.device, dtype=torch.float32)
                if self.lora_bias.get(adapter, False):
                    bias += sign * self.lora_B[adapter].bias.to(torch.float32) * self.scaling[adapter]
        if safe and not (torch.isfinite(weight).all() and (bias is None or torch.isfinite(bias).all())):
            raise ValueError(f"module {name!r}: NaN/Inf in the merged weight; the adapter(s) {adapters} seem broken")
        base.requantize(weight, name)  # refuses NaN/Inf whether safe or not: FP8 cannot hold them
        if bias is not None:
            with torch.no_grad():
                base.bias.copy_(bias)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Folds the adapters into the FP8 weight (quantized again with the layer's scheme)."""
        adapters = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapters:
            return
        self._check_mergeable(adapters)
        self._fold(adapters, 1.0, safe_merge)
        self.merged_adapters.extend(adapters)

    def unmerge(self) -> None:
        """Takes the merged adapters out of the FP8 weight again (one more FP8 rounding)."""
        if not self.merged:
            return
        adapters = [a for a in reversed(self.merged_adapters) if a in self.lora_A]
        self._check_mergeable(adapters)
        self._fold(adapters, -1.0, safe=False)
        self.merged_adapters.clear()

    def __repr__(self) -> str:
        return super().__repr__().replace("lora.Linear", "lora.LoraQLinear", 1)
