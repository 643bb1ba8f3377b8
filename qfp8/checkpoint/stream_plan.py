"""What ``qfp8 quantize`` (:func:`qfp8.checkpoint.stream.stream_quantize`) quantizes in a float checkpoint.

The model's class is built on the meta device and planned by qfp8.quantize's
one planner (:func:`qfp8.quantize_plan.plan_quantization`); what is decided
there is only translated here to the checkpoint's names, with what only the
files can tell added: a tensor not stored, not 2-D or not floating point,
experts stored fused, a tied table stored as two different ones.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.naming import CheckpointNames
from qfp8.checkpoint.remote_code import auto_config
from qfp8.checkpoint.skeleton import build_model
from qfp8.nn.conv import is_linear_layer, is_transformers_conv1d
from qfp8.nn.experts import find_fused_experts
from qfp8.nn.scheme import QuantizationScheme
from qfp8.quantize_plan import (
    DEFAULT_EXCLUDE,
    PlanWording,
    QuantizePlan,
    exclude_patterns,
    plan_quantization,
    tied_float_holders,
)
from qfp8.quantize_report import QuantizeReport, ReportEntry, other_kinds_clause

__all__ = ["LayerPlan", "ModelLinears", "linear_names", "plan_layers"]

# The plan's warnings the CLI gives: a pattern matching nothing, a tied head your patterns leave in.
STREAM_NOTES = ("unmatched", "tied_head")


@dataclasses.dataclass
class ModelLinears:
    """The meta-device build of the model config.json describes, and its names in the checkpoint."""

    model: torch.nn.Module  # on the meta device
    names: _StoredNames
    linears: list[str]  # the checkpoint names of its linear layers
    # its fused experts' parts, each mapped to the model name of its fused parameter and the parts of its
    # expert, e.g. ``...experts.0.w1`` -> ``("...experts.gate_up_proj", ["...experts.0.w1", "...experts.0.w3"])``
    expert_parts: dict[str, tuple[str, list[str]]]
    model_name: str  # the class built, e.g. "GPT2LMHeadModel"
    # (head, embedding) model names of an output head whose weight float modules (its input embedding) hold
    tied: tuple[str, str] | None = None
    # each Parameter held under several names (BERT's tied cls.predictions.bias): checkpoint name -> the others
    shared: dict[str, list[str]] | None = None
    # checkpoint module name -> the model's, where they differ (see qconfig.build_quantization_config)
    model_names: dict[str, str] | None = None
    config_class: type | None = None  # transformers' config class of the checkpoint
    # each parameter's shape in the model config.json describes, by checkpoint name
    shapes: dict[str, tuple[int, ...]] | None = None
    # the linear layers whose weight the checkpoint stores [in, out] (transformers' Conv1D: GPT-2's): checkpoint
    # name -> class name
    transposed: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.parts_of: dict[str, list[str]] = {}
        for part, (fused, _) in self.expert_parts.items():
            self.parts_of.setdefault(fused, []).append(part)

    def pattern_names(self, name: str) -> tuple[str, ...]:
        """The names ``--exclude`` patterns see for the model's module ``name``: its own and its checkpoint
        name; a fused experts weight's, its parts' names too."""
        return (name, self.names.module(name), *self.parts_of.get(name, ()))


class _StoredNames:
    """Model names -> the names ``stored`` (a checkpoint's tensor names) holds them under: transformers' checkpoint
    names (:class:`CheckpointNames`), or the model's own where the checkpoint uses those (a Llava saved with
    ``model.language_model.*`` names, which transformers 5 also loads)."""

    def __init__(self, names: CheckpointNames, stored: set[str]):
        self.names, self.stored = names, stored
        # What transformers loads each stored tensor as: the Hub's Llava stores vision_tower.vision_model.*,
        # which no model name maps back to (transformers' save of a config-built model leaves the prefix out).
        self.by_model = {names.to_model(key): key for key in stored}

    def to_checkpoint(self, name: str) -> str:
        if name in self.by_model:
            return self.by_model[name]
        renamed = self.names.to_checkpoint(name)
        return name if renamed not in self.stored and name in self.stored else renamed

    def module(self, name: str) -> str:
        return self.to_checkpoint(name + ".weight").removesuffix(".weight")


def linear_names(config_dir: Path, stored: set[str], trust_remote_code: bool = False) -> ModelLinears:
    """A meta-device build of the model's class, with the checkpoint names of its linear layers and fused
    experts' parts (``stored``: the checkpoint's tensor names)."""
    import transformers

    config = auto_config(config_dir, trust_remote_code)
    with torch.device("meta"):
        model = build_model(transformers, config, bare_fallback=True, trust_remote_code=trust_remote_code)
    names = CheckpointNames(model)
    in_checkpoint = _StoredNames(names, stored)
    model_names = {}
    linears, transposed = [], {}
    for name, m in model.named_modules(remove_duplicate=False):
        if is_linear_layer(m):
            linears.append(in_checkpoint.module(name))
            if linears[-1] != name:
                model_names[linears[-1]] = name
            if is_transformers_conv1d(m):
                transposed[linears[-1]] = type(m).__name__
    parts = {}
    for item in find_fused_experts(model, check_weights=False):
        for expert in names.expert_modules(item.name, item.module._parameters[item.attr].shape[0]) or ():
            parts.update((part, (item.name, expert)) for part in expert)
    holders: dict[int, list[str]] = {}
    shapes = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(in_checkpoint.to_checkpoint(name))
        shapes[holders[id(param)][-1]] = tuple(param.shape)
    shared = {name: [n for n in group if n != name] for group in holders.values() if len(group) > 1 for name in group}
    return ModelLinears(
        model, in_checkpoint, linears, parts, type(model).__name__, _tied_head(model), shared, model_names,
        type(config), shapes, transposed,
    )  # fmt: skip


def _check_against_config(found: ModelLinears, plan, directory: Path, weight_keys: dict[str, str]) -> None:
    """ValueError, before anything is written, for a checkpoint its config.json does not describe: a stored
    tensor of another shape than the model's, or a Linear weight stored under none of its names. Either was
    written with exit 0, and qfp8.from_pretrained then refused the output."""
    described = f"the model config.json describes ({found.model_name}, {directory / 'config.json'})"
    for key, shape in found.shapes.items():
        stored = plan.tensors.get(key)
        if stored is None:
            continue
        have = tuple(stored.file.info(stored.name).shape)
        if have != shape:
            raise ValueError(
                f"{stored.file.path}: {stored.name} has shape {list(have)}, but {described} expects {list(shape)}; "
                "the checkpoint and its config.json do not match"
            )
    for name in found.linears:
        key = weight_keys.get(name, name + ".weight")
        names = [key, name + ".weight", *(found.shared or {}).get(name + ".weight", [])]
        if key != "" and not any(n in plan.tensors for n in names):
            raise ValueError(
                f"{directory}: {name}.weight is not stored in the checkpoint, but {described} has that Linear; "
                "the checkpoint and its config.json do not match"
            )


def _tied_head(model: torch.nn.Module) -> tuple[str, str] | None:
    """(head, embedding) model names when the model's output head shares its weight with modules kept in float
    (its input embedding), whose table the checkpoint stores under either name or both; None when it is tied
    to nothing. Whether it is quantized is the plan's to say."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, torch.nn.Linear):
        return None
    others = tied_float_holders(model, [head]).get(id(head))
    if not others:
        return None
    return next(name for name, m in model.named_modules() if m is head), others[0]


def _nothing_quantized(found: ModelLinears, kinds: list[str], reasons: dict[str, str], user_patterns: bool) -> str:
    """Why no weight of the model is quantized (``reasons``: why each of its Linears and expert parts is kept
    in float; ``kinds``: the classes of its other float matrix weights), for the error that refuses to write
    such a checkpoint."""
    if not reasons:
        why = "it has no nn.Linear"
    else:
        counts: dict[str, int] = {}
        for reason in reasons.values():
            counts[reason] = counts.get(reason, 0) + 1
        kept = "; ".join(f"{count} {reason}" for reason, count in counts.items())
        why = f"every nn.Linear of it is kept in float ({kept})"
        if user_patterns and all(reason.startswith("excluded by --exclude") for reason in reasons.values()):
            why += "; give --exclude patterns that leave some to quantize"
    if kinds:
        why += "; " + other_kinds_clause(kinds)
    return f"nothing to quantize in {found.model_name}: {why}; no checkpoint written"


# Static scales and the accuracy modes are measured layer by layer, which does not run fused experts.
CALIBRATED_EXPERTS_REASON = (
    "layer-by-layer calibration does not run fused MoE experts (quantize and calibrate the model in memory)"
)


@dataclasses.dataclass
class LayerPlan:
    """Which checkpoint modules ``qfp8 quantize`` quantizes, which it keeps in float, and why."""

    weight_keys: dict[str, str]  # where the float weight of each Linear is stored
    quantized: dict[str, QuantizationScheme] = dataclasses.field(default_factory=dict)
    ignored: list[str] = dataclasses.field(default_factory=list)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # why each one ignored is
    layers: dict[str, qconfig.Layer] = dataclasses.field(default_factory=dict)
    # A head tied to its embedding, quantized: the head is written from the table, the embedding as its rows.
    tied_head: str | None = None
    tied_embedding: str | None = None
    skipped: set[str] = dataclasses.field(default_factory=set)  # a stored name the table is not written under
    untied: bool = False  # both names stored with different tables: transformers does not tie them either
    transposed: set[str] = dataclasses.field(default_factory=set)  # quantized layers stored [in, out] (Conv1D)
    report: QuantizeReport = dataclasses.field(default_factory=QuantizeReport)  # as qfp8.quantize reports


def plan_layers(found: ModelLinears, plan, checkpoint, scheme: QuantizationScheme, exclude, accuracy) -> LayerPlan:
    """What :func:`qfp8.checkpoint.stream.stream_quantize` quantizes: qfp8.quantize's plan of the meta-device
    model, in the checkpoint's names, with what the files tell (warning, as quantize does, about ``exclude``
    patterns that match nothing, a tied head and experts kept float); a ValueError when that is nothing.
    Warnings name ``stream_quantize``'s caller."""
    user_patterns = exclude is not DEFAULT_EXCLUDE
    by = "--exclude" if user_patterns else "the default --exclude"
    layers = LayerPlan(weight_keys={name: name + ".weight" for name in found.linears})
    tied_keys = _tied_table(layers, found, plan)
    wording = PlanWording("qfp8 quantize", "--exclude", lambda pattern: f"excluded by {by} {pattern}")
    decided = plan_quantization(
        found.model, scheme, exclude_patterns(exclude), user_patterns, accuracy,
        from_files=True, names=found.pattern_names, wording=wording,
    )  # fmt: skip
    for note in decided.notes:
        if note.kind in STREAM_NOTES:
            warnings.warn(note.text, stacklevel=3)
    _check_against_config(found, plan, checkpoint.directory, layers.weight_keys)
    _plan_linears(layers, found, decided, plan, scheme)
    experts_reason = _plan_experts(layers, found, decided, plan, scheme, accuracy)
    if found.tied is not None and found.tied[0] in decided.ties:
        head, embedding = (found.names.module(name) for name in found.tied)
        if head in layers.quantized:
            layers.tied_head, layers.tied_embedding = head, embedding
            layers.skipped.update(tied_keys[1:])  # stored twice (equal): written once, as the head's rows
    if not layers.quantized:  # a float checkpoint labelled compressed-tensors, with no scheme: refused before any work
        fused = {item.name.rpartition(".")[0] for _, item in decided.experts}
        kinds = sorted({other.kind for other in decided.report.others if other.name not in fused})
        why = _nothing_quantized(found, kinds, layers.reasons, user_patterns)
        raise ValueError(f"{checkpoint.directory}: {why}")
    if experts_reason:
        warnings.warn(f"qfp8 quantize: fused MoE experts are kept in float: {experts_reason}", stacklevel=3)
    layers.report = _report(layers)
    return layers


def _report(layers: LayerPlan) -> QuantizeReport:
    """The plan as qfp8.quantize reports one: an entry per linear layer (expert part) of the checkpoint, its shape
    [out, in], its scheme or why it stays float."""
    report = QuantizeReport()
    for name, (scheme, shape) in layers.layers.items():
        out_features, in_features = shape if shape is not None and len(shape) == 2 else (0, 0)
        entry = ReportEntry(
            name, in_features, out_features, quantized=scheme is not None, reason=layers.reasons.get(name, "")
        )
        entry.scheme = scheme.describe() if scheme is not None else ""
        report.entries.append(entry)
    return report


def _tied_table(layers: LayerPlan, found: ModelLinears, plan) -> list[str]:
    """Where a tied head's table is stored (one table, under either name, or both, equal): the head's weight is
    read from there; returns those keys. Two different tables under the two names are untied in the model
    before it is planned, as transformers does not tie them either."""
    if found.tied is None:
        return []
    head, embedding = (found.names.module(name) for name in found.tied)
    keys = [key for key in (head + ".weight", embedding + ".weight") if key in plan.tensors]
    if len(keys) == 2 and not torch.equal(plan.load(keys[0], mmap=True), plan.load(keys[1], mmap=True)):
        layers.untied = True
        module = found.model.get_submodule(found.tied[0])
        module.weight = torch.nn.Parameter(torch.empty_like(module.weight), requires_grad=False)
        return []
    layers.weight_keys[head] = keys[0] if keys else ""
    return keys


def _plan_linears(layers: LayerPlan, found: ModelLinears, decided: QuantizePlan, plan, scheme) -> None:
    """The plan's decision for each linear layer, under its checkpoint name, unless the file keeps it float."""
    entries = {}
    for entry in decided.report.entries:
        if not entry.experts:
            entries.update((found.names.module(name), entry) for name in [entry.name, *entry.aliases])
    reasons = layers.reasons
    for name in found.linears:
        stored = plan.tensors.get(layers.weight_keys[name])
        shape = None if stored is None else tuple(stored.file.info(stored.name).shape)
        if shape is not None and name in found.transposed:  # a Conv1D's weight, stored [in, out]
            shape = shape[::-1]
        reason = (
            entries[name].reason if not entries[name].quantized
            else "not stored in the checkpoint (tied to another tensor)" if stored is None
            else f"stored as a {len(shape)}-D tensor" if len(shape) != 2
            else ""
        )  # fmt: skip
        if reason:
            layers.ignored.append(name)
            layers.layers[name] = (None, shape)
            reasons[name] = reason
            continue
        if not stored.file.info(stored.name).dtype.is_floating_point:
            raise ValueError(f"{stored.file.path}: {stored.name} is {stored.file.info(stored.name).dtype}, not float")
        if name in found.transposed:  # written as a QLinear's weight: [out, in]
            layers.transposed.add(name)
        layers.quantized[name] = scheme
        layers.layers[name] = (scheme, shape)


def _plan_experts(layers: LayerPlan, found: ModelLinears, decided: QuantizePlan, plan, scheme, accuracy) -> str:
    """The plan's decision for each fused experts weight, applied to its parts as the checkpoint stores them;
    returns why some are kept in float ("" when none is, or only by ``--exclude``)."""
    entries = {entry.name: entry for entry, _ in decided.experts}
    calibrated = scheme.activations == "static" or accuracy is not None
    experts_reason = ""
    for name, (fused, _) in found.expert_parts.items():
        stored = plan.tensors.get(name + ".weight")
        shape = None if stored is None else tuple(stored.file.info(stored.name).shape)
        excluded = fused in decided.excluded
        reason = (
            f"the checkpoint stores them fused, as {fused} (transformers 5's model names); qfp8 quantize reads "
            "experts stored one by one (transformers' own save). Quantize the model in memory instead "
            "(qfp8.quantize + qfp8.save_pretrained)" if stored is None and fused in plan.tensors
            else "missing or not 2-D" if shape is None or len(shape) != 2
            else "" if excluded
            else CALIBRATED_EXPERTS_REASON if calibrated
            else entries[fused].reason
        )  # fmt: skip
        if reason or excluded:
            experts_reason = experts_reason or reason
            layers.ignored.append(name)
            layers.layers[name] = (None, shape)
            layers.reasons[name] = (
                f"fused MoE experts part kept in float: {reason}" if reason else "excluded by --exclude"
            )
        else:
            layers.quantized[name] = scheme
            layers.layers[name] = (scheme, shape)
    return experts_reason
