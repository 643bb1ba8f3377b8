"""What ``quantize`` reports: one entry per Linear (or fused experts weight) quantized or kept float, and the
float matrix weights outside ``nn.Linear``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from qfp8.nn.conv import is_linear_layer

__all__ = [
    "OTHER_WEIGHTS_WARNING",
    "OtherWeights",
    "QuantizeReport",
    "QuantizeResult",
    "ReportEntry",
    "other_kinds_clause",
    "other_weight_kinds",
]


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
    experts: int = 0  # a fused MoE experts weight: that many [out, in] matrices


@dataclass
class OtherWeights:
    """A module that is not an ``nn.Linear`` (nor an embedding) but holds float matrix weights: left in float."""

    name: str
    kind: str  # the module's class name
    numel: int  # elements of its >= 2-D float parameters


@dataclass
class QuantizeReport:
    """Every ``nn.Linear`` of the model: its scheme and kernel, or why it was skipped.

    ``others``: modules with float matrix weights that are not ``nn.Linear``
    (fused MoE experts kept float, convolutions of a transformers model), which stay in float;
    ``other_fraction`` is their share of all matrix weights (Linear and those).
    """

    entries: list[ReportEntry] = field(default_factory=list)
    others: list[OtherWeights] = field(default_factory=list)
    other_fraction: float = 0.0
    attention: str = ""  # how quantize changed the model's attention implementation, if it did
    kv_cache: str = ""  # the FP8 KV cache, if quantize turned it on
    tied_embeddings: list[str] = field(default_factory=list)  # embeddings reading a quantized head's rows

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
                (f"{e.experts} x " if e.experts else "") + f"[{e.out_features}, {e.in_features}]",
                "quantized" if e.quantized else "skipped",
                e.scheme + (f" ({e.reason})" if e.reason else "") if e.quantized else e.reason,
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
        if self.others:
            lines.append(self.others_summary())
        lines += [f"tied embedding: {line}" for line in self.tied_embeddings]
        if self.kv_cache:
            lines.append(f"KV cache: {self.kv_cache}")
        if self.attention:
            lines.append(f"attention: {self.attention}")
        return "\n".join(lines)

    def others_summary(self) -> str:
        """One line: which non-Linear modules keep float matrix weights, and their share."""
        kinds: dict[str, list[OtherWeights]] = {}
        for other in self.others:
            kinds.setdefault(other.kind, []).append(other)
        largest_first = sorted(kinds.items(), key=lambda item: -sum(o.numel for o in item[1]))
        parts = [
            f"{kind} x{len(found)} ({', '.join(o.name for o in found[:2])}{', ...' if len(found) > 2 else ''})"
            for kind, found in largest_first
        ]
        return (
            f"not nn.Linear, left in float: {'; '.join(parts)}: {self.other_fraction:.0%} of the matrix weights "
            "(qfp8 quantizes nn.Linear, transformers' Conv1D and fused MoE experts)"
        )

    __repr__ = __str__


class QuantizeResult(NamedTuple):
    model: nn.Module
    report: QuantizeReport


# Matrix weights outside nn.Linear above this share of the model's get a warning, not only a report line.
OTHER_WEIGHTS_WARNING = 0.05


def _find_other_weights(model: nn.Module, report: QuantizeReport, quantized_experts=frozenset()) -> None:
    """Fills ``report.others`` and ``report.other_fraction`` (see :class:`QuantizeReport`).

    ``quantized_experts``: ids of fused experts parameters being quantized, counted with the Linears.
    """
    linear = other = 0
    seen: set[int] = set()
    linears = {name for name, module in model.named_modules() if is_linear_layer(module)}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        owner = name.rsplit(".parametrizations.", 1)[0] if ".parametrizations." in f".{name}" else None
        if isinstance(module, torch.nn.utils.parametrize.ParametrizationList) and owner in linears:
            for param in module.parameters(recurse=False):  # a parametrized Linear's own weight
                if param.dim() >= 2 and param.is_floating_point() and id(param) not in seen:
                    seen.add(id(param))
                    linear += param.numel()
            continue
        numel = 0
        for param in module.parameters(recurse=False):
            if param.dim() >= 2 and param.is_floating_point() and id(param) not in seen:
                seen.add(id(param))
                if id(param) in quantized_experts:
                    linear += param.numel()
                else:
                    numel += param.numel()
        if is_linear_layer(module):
            linear += numel
        elif numel:
            report.others.append(OtherWeights(name or type(model).__name__, type(module).__name__, numel))
            other += numel
    report.other_fraction = other / (linear + other) if other else 0.0


def other_weight_kinds(model: nn.Module, fused_experts=frozenset()) -> list[str]:
    """The classes of the modules that hold float matrix weights outside the linear layers (a vision tower's
    convolutions), as :func:`_find_other_weights` finds them; ``fused_experts``: ids of fused experts parameters,
    not counted."""
    report = QuantizeReport()
    _find_other_weights(model, report, fused_experts)
    return sorted({other.kind for other in report.others})


def other_kinds_clause(kinds: list[str]) -> str:
    """The part of a "nothing was quantized" message naming the weight-holding classes qfp8 does not take."""
    return (
        f"{', '.join(kinds)} layers have weights but qfp8 quantizes nn.Linear, transformers' Conv1D (and fused MoE "
        "experts) only"
    )


def _first_names(names: list[str], limit: int) -> str:
    """``names`` for a message: the first ``limit``, then how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
