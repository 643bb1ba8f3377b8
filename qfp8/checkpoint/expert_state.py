"""A checkpoint's per-expert tensors under the model's fused experts names (see qfp8/checkpoint/naming.py)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from qfp8.checkpoint.naming import CheckpointNames
from qfp8.nn import QuantizationScheme
from qfp8.nn.experts import QExperts, find_fused_experts

__all__ = ["ExpertWeights", "checkpoint_to_model"]


class _ExpertPart(NamedTuple):
    fused: str  # the model's fused experts parameter
    expert: int
    part: int
    experts: int  # of the fused parameter
    parts: int  # of each expert


def _expert_parts(model: nn.Module, names: CheckpointNames) -> dict[str, _ExpertPart]:
    """Checkpoint module name of each expert part (``...experts.3.w1``) -> where it goes in ``model``."""
    found = {}
    fused = [(item.name, item.module._parameters[item.attr].shape[0]) for item in find_fused_experts(model)]
    fused += [(name, m.num_experts) for name, m in model.named_modules() if isinstance(m, QExperts)]  # quantized
    for fused_name, count in fused:
        modules = names.expert_modules(fused_name, count)
        for expert, parts in enumerate(modules or ()):
            for part, name in enumerate(parts):
                found[name] = _ExpertPart(fused_name, expert, part, len(modules), len(parts))
    return found


def _stack_experts(
    fused: str,
    count: int,
    pieces: dict[tuple[int, int], torch.Tensor],
    parts: int,
    suffix: str,
    per_tensor: bool = False,
):
    """One fused tensor ``[E, ...]`` from the per-expert, per-part tensors ``pieces[(expert, part)]``
    (``per_tensor``: weight scales of a per-tensor scheme, one per expert)."""
    _check_all_parts(fused, count, pieces, parts, suffix)
    experts = []
    for e in range(count):
        own = [pieces[(e, p)] for p in range(parts)]
        if suffix == "input_scale":  # the parts read the same input: the larger scale clips neither
            experts.append(torch.stack([t.reshape(-1)[0] for t in own]).amax().reshape(1))
        elif suffix == "weight_scale" and per_tensor:
            experts.append(own[0].reshape(1))
        else:
            experts.append(torch.cat(own) if parts > 1 else own[0])
    return torch.stack(experts)


def _check_all_parts(fused: str, count: int, pieces: dict, parts: int, suffix: str) -> None:
    absent = [(e, p) for e in range(count) for p in range(parts) if (e, p) not in pieces]
    if absent:
        raise ValueError(
            f"the checkpoint stores {len(pieces)} of the {count * parts} expert parts of {fused} ({suffix}); "
            f"missing: expert {absent[0][0]} part {absent[0][1]}"
            + (f" and {len(absent) - 1} more" if len(absent) > 1 else "")
        )


def _parts_scales_differ(pieces: dict[tuple[int, int], torch.Tensor], parts: int) -> bool:
    """True when some expert stores its parts (w1, w3) with different per-tensor weight scales."""
    if parts == 1 or any(t.numel() != 1 for t in pieces.values()):
        return False
    return any(not torch.equal(pieces[(e, p)].reshape(1), pieces[(e, 0)].reshape(1)) for e, p in pieces)


def _scales_per_row(fused: str, scales: dict, weights: dict) -> torch.Tensor:
    """``[E, rows, 1]``: each part's per-tensor scale repeated over the rows of its weight."""
    count = 1 + max(e for e, _ in scales)
    parts = 1 + max(p for _, p in scales)
    if set(weights) != set(scales):
        raise ValueError(f"the checkpoint stores weight scales of {fused}'s expert parts without their weights")
    return torch.stack(
        [
            torch.cat([scales[(e, p)].reshape(1, 1).expand(weights[(e, p)].shape[0], 1) for p in range(parts)])
            for e in range(count)
        ]
    ).to(torch.float32)


class ExpertWeights(NamedTuple):
    """The stored FP8 weights of a fused experts parameter, expert by expert, read when asked for."""

    pieces: dict[tuple[int, int], torch.Tensor]  # (expert, part) -> [rows, in], views of the mapped file
    parts: int

    def expert(self, e: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Expert ``e``'s ``[out, in]`` weight: its parts concatenated (into ``out`` if it fits), or its
        one part's stored view."""
        own = self.stored(e)
        if len(own) == 1:
            return own[0]
        rows = sum(t.shape[0] for t in own)
        if out is None or out.shape != (rows, *own[0].shape[1:]) or out.dtype != own[0].dtype:
            return torch.cat(own)
        return torch.cat(own, out=out)

    def stored(self, e: int) -> list[torch.Tensor]:
        return [self.pieces[(e, p)] for p in range(self.parts)]


def checkpoint_to_model(
    model: nn.Module, schemes: dict[str, QuantizationScheme], state: dict[str, torch.Tensor] | None
) -> tuple[dict[str, QuantizationScheme], dict[str, torch.Tensor] | None, dict[str, ExpertWeights]]:
    """A checkpoint's module schemes and tensors under ``model``'s names (see qfp8/checkpoint/naming.py).

    Per-expert tensors (``experts.<e>.w1.weight``...) become the model's
    fused experts tensors: ``<fused>.weight``/``.weight_scale`` for quantized
    ones, ``<fused>`` itself for float ones (stacked). A quantized fused
    weight is not stacked: the state holds a meta tensor of its shape, and the
    third result its stored weights (:class:`ExpertWeights`), which
    :func:`assign_state` reads one expert at a time, so that no copy of all
    the experts is made. Names the model has as they are (older qfp8
    checkpoints) stay.
    """
    names = CheckpointNames(model)
    if names.identity:
        return schemes, state, {}
    parts_of = _expert_parts(model, names)
    own_names = set(model.state_dict(keep_vars=True))
    out_schemes: dict[str, QuantizationScheme] = {}
    expert_schemes: dict[str, set] = {}
    counted: dict[str, int] = {}
    layout: dict[str, _ExpertPart] = {}  # fused -> one of its parts (experts, parts)
    for module, scheme in schemes.items():
        where = parts_of.get(module)
        if where is None:
            out_schemes[names.to_model(module)] = scheme
            continue
        expert_schemes.setdefault(where.fused, set()).add(scheme)
        counted[where.fused] = counted.get(where.fused, 0) + 1
        layout[where.fused] = where
    for fused, found in expert_schemes.items():
        total = layout[fused].experts * layout[fused].parts
        if len(found) > 1 or counted[fused] != total:
            raise ValueError(
                f"the checkpoint quantizes {counted[fused]} of the {total} expert parts of {fused}"
                + (f" with {len(found)} different schemes" if len(found) > 1 else " (the others are float or missing)")
                + "; qfp8 holds a fused experts weight with one scheme"
            )
        out_schemes[fused] = found.pop()
    if state is None:
        return out_schemes, None, {}
    out_state: dict[str, torch.Tensor] = {}
    deferred: dict[str, ExpertWeights] = {}
    pieces: dict[tuple[str, str], dict[tuple[int, int], torch.Tensor]] = {}
    for key, value in state.items():
        module, _, suffix = key.rpartition(".")
        where = parts_of.get(module)
        if where is None:
            out_state[key if key in own_names else names.to_model(key)] = value
            continue
        pieces.setdefault((where.fused, suffix), {})[(where.expert, where.part)] = value
        layout[where.fused] = where
    for (fused, suffix), found in pieces.items():
        per_tensor = fused in out_schemes and out_schemes[fused].weight_scale == "tensor"
        if suffix == "weight_scale" and per_tensor and _parts_scales_differ(found, layout[fused].parts):
            # Per-tensor scales that differ between an expert's gate and up parts (AutoFP8, llm-compressor):
            # held exactly as per-channel scales, each row taking its part's.
            _check_all_parts(fused, layout[fused].experts, found, layout[fused].parts, suffix)
            out_state[f"{fused}.{suffix}"] = _scales_per_row(fused, found, pieces.get((fused, "weight"), {}))
            out_schemes[fused] = dataclasses.replace(out_schemes[fused], weight_scale="channel", block_size=())
            continue
        quantized = fused in out_schemes
        if quantized and suffix == "weight":
            _check_all_parts(fused, layout[fused].experts, found, layout[fused].parts, suffix)
            first = [found[(0, p)] for p in range(layout[fused].parts)]
            rows = sum(t.shape[0] for t in first)
            shape = (layout[fused].experts, rows, *first[0].shape[1:])
            out_state[f"{fused}.weight"] = torch.empty(shape, dtype=first[0].dtype, device="meta")
            deferred[f"{fused}.weight"] = ExpertWeights(found, layout[fused].parts)
            continue
        stacked = _stack_experts(fused, layout[fused].experts, found, layout[fused].parts, suffix, per_tensor)
        out_state[f"{fused}.{suffix}" if quantized else fused] = stacked
    return out_schemes, out_state, deferred
