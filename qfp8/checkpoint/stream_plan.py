"""What ``qfp8 quantize`` (:func:`qfp8.checkpoint.stream.stream_quantize`) quantizes in a float checkpoint.

The model's ``nn.Linear`` modules and fused experts come from a meta-device
build of its class; which of them are quantized, which kept in float and why
(``--exclude``, MoE gates, a tied head) follows ``qfp8.quantize``'s rules.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.naming import CheckpointNames
from qfp8.checkpoint.remote_code import auto_config
from qfp8.checkpoint.skeleton import build_model
from qfp8.nn.experts import find_fused_experts, scheme_reason
from qfp8.nn.scheme import QuantizationScheme
from qfp8.quantize import (
    DEFAULT_EXCLUDE,
    DEFAULT_KEEPS_TIED,
    exclude_patterns,
    excluded_by,
    float_linear_reason,
    linear_class_reason,
    other_kinds_clause,
    other_weight_kinds,
    tied_float_holders,
    tied_head_note,
    unmatched_exclude_notes,
    untie_problem,
)

__all__ = ["LayerPlan", "ModelLinears", "linear_names", "plan_layers"]


class ModelLinears(NamedTuple):
    """What :func:`linear_names` finds in the model config.json describes."""

    linears: list[str]  # the checkpoint names of its nn.Linear modules
    # its fused experts' parts, each mapped to the model name of its fused parameter and the parts of its
    # expert, e.g. ``...experts.0.w1`` -> ``("...experts.gate_up_proj", ["...experts.0.w1", "...experts.0.w3"])``
    expert_parts: dict[str, tuple[str, list[str]]]
    model_name: str  # the class built, e.g. "GPT2LMHeadModel"
    other_kinds: list[str]  # classes of other modules holding float matrix weights (GPT-2's Conv1D), kept in float
    # (head, embedding, why not) checkpoint names of an output head tied to float modules (see _tied_head)
    tied: tuple[str, str, str | None] | None = None
    # each Parameter held under several names (BERT's tied cls.predictions.bias): checkpoint name -> the others
    shared: dict[str, list[str]] | None = None
    # checkpoint module name -> the model's, where they differ (see qconfig.build_quantization_config)
    model_names: dict[str, str] | None = None
    config_class: type | None = None  # transformers' config class of the checkpoint
    # Linears quantize keeps float by their kind (SigLIP's nn.MultiheadAttention projection): name -> why
    kind_reasons: dict[str, str] | None = None
    # each parameter's shape in the model config.json describes, by checkpoint name
    shapes: dict[str, tuple[int, ...]] | None = None


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
    """The model's ``nn.Linear`` modules and fused experts, from a meta-device build of its class (``stored``:
    the checkpoint's tensor names)."""
    import transformers

    config = auto_config(config_dir, trust_remote_code)
    with torch.device("meta"):
        model = build_model(transformers, config, bare_fallback=True, trust_remote_code=trust_remote_code)
    names = CheckpointNames(model)
    in_checkpoint = _StoredNames(names, stored)
    model_names, kind_reasons = {}, {}
    linears = []
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, torch.nn.Linear):
            linears.append(in_checkpoint.module(name))
            if linears[-1] != name:
                model_names[linears[-1]] = name
            if reason := linear_class_reason(m):
                kind_reasons[linears[-1]] = reason
    parts = {}
    fused = find_fused_experts(model)
    for item in fused:
        for expert in names.expert_modules(item.name, item.module._parameters[item.attr].shape[0]) or ():
            parts.update((part, (item.name, expert)) for part in expert)
    others = other_weight_kinds(model, {id(item.module._parameters[item.attr]) for item in fused})
    holders: dict[int, list[str]] = {}
    shapes = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(in_checkpoint.to_checkpoint(name))
        shapes[holders[id(param)][-1]] = tuple(param.shape)
    shared = {name: [n for n in group if n != name] for group in holders.values() if len(group) > 1 for name in group}
    tied = _tied_head(model, in_checkpoint)
    return ModelLinears(
        linears, parts, type(model).__name__, others, tied, shared, model_names, type(config), kind_reasons, shapes
    )


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


def _tied_head(model: torch.nn.Module, names: _StoredNames) -> tuple[str, str, str | None] | None:
    """(head, embedding, why not) when the model's output head shares its weight with modules kept in float
    (its input embedding): their checkpoint names, and why ``qfp8.quantize`` would keep the head float rather
    than tie the embedding to it as a QEmbedding (None: it would; T5's table, held by three embeddings, and
    Gemma's scaled embedding keep it float). None when the head is tied to nothing."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, torch.nn.Linear):
        return None
    others = tied_float_holders(model, [head]).get(id(head))
    if not others:
        return None
    found = {id(m): name for name, m in model.named_modules()}
    head_name, embedding_name = (names.module(n) for n in (found[id(head)], others[0]))
    return head_name, embedding_name, untie_problem(dict(model.named_modules(remove_duplicate=False)), others, ())


def _nothing_quantized(model: ModelLinears, reasons: dict[str, str], user_patterns: bool) -> str:
    """Why no weight of ``model`` is quantized (``reasons``: why each of its Linears and expert parts is kept
    in float), for the error that refuses to write such a checkpoint."""
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
    if model.other_kinds:  # GPT-2's Conv1D, for one
        why += "; " + other_kinds_clause(model.other_kinds)
    return f"nothing to quantize in {model.model_name}: {why}; no checkpoint written"


def _experts_kept_float(scheme: QuantizationScheme, accuracy: str | None, rows: int, parts: int) -> str:
    """Why the CLI keeps a fused experts weight (stored as ``parts`` parts of ``rows`` rows) in float ("" when
    it quantizes it): what ``quantize`` refuses, and static scales, which layer-by-layer calibration does not
    measure for experts."""
    if scheme.activations == "static" or accuracy is not None:
        return "layer-by-layer calibration does not run fused MoE experts (quantize and calibrate the model in memory)"
    return scheme_reason(scheme, accuracy, rows * parts, parts)


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


def plan_layers(found: ModelLinears, plan, checkpoint, scheme: QuantizationScheme, exclude, accuracy) -> LayerPlan:
    """What :func:`qfp8.checkpoint.stream.stream_quantize` quantizes (warning, as it does, about ``exclude``
    patterns that match nothing, a tied head and experts kept float); a ValueError when that is nothing.
    Warnings name ``stream_quantize``'s caller."""
    user_patterns = exclude is not DEFAULT_EXCLUDE
    exclude = exclude_patterns(exclude)
    if user_patterns:
        _warn_unmatched_patterns(found, exclude, checkpoint.config)
    # A fused experts weight is quantized whole (qfp8 holds it with one scheme): a pattern matching its model
    # name or any of its parts' checkpoint names (experts.3.w1) keeps all of it float.
    excluded_fused = {
        fused
        for name, (fused, _) in found.expert_parts.items()
        if excluded_by(name, exclude) or excluded_by(fused, exclude)
    }
    by = "--exclude" if user_patterns else "the default --exclude"
    layers = LayerPlan(weight_keys={name: name + ".weight" for name in found.linears})
    if found.tied is not None:
        _plan_tied_head(layers, found.tied, plan, exclude, user_patterns, by)
    _check_against_config(found, plan, checkpoint.directory, layers.weight_keys)
    _plan_linears(layers, found, plan, scheme, exclude, by)
    experts_reason = _plan_experts(layers, found, plan, scheme, accuracy, excluded_fused)
    if not layers.quantized:  # a float checkpoint labelled compressed-tensors, with no scheme: refused before any work
        raise ValueError(f"{checkpoint.directory}: {_nothing_quantized(found, layers.reasons, user_patterns)}")
    if experts_reason:
        warnings.warn(f"qfp8 quantize: fused MoE experts are kept in float: {experts_reason}", stacklevel=3)
    return layers


def _warn_unmatched_patterns(found: ModelLinears, exclude, config: dict) -> None:
    fused_names = sorted({fused for fused, _ in found.expert_parts.values()})
    tied_names = [found.tied[1]] if found.tied else []  # a pattern naming a tied embedding acts on its head
    for note in unmatched_exclude_notes(
        exclude,
        [*found.linears, *found.expert_parts, *fused_names, *tied_names],
        config.get("model_type", "the model"),
        "qfp8 quantize",
    ):
        warnings.warn(note, stacklevel=4)


def _plan_tied_head(layers: LayerPlan, tied, plan, exclude, user_patterns: bool, by: str) -> None:
    """A head tied to its embedding: one table, stored under either name (or both, equal). Quantized, the
    head is written from it and the embedding as its dequantized rows (see qfp8.nn.embedding), as
    qfp8.quantize + save_pretrained do; kept float where quantize keeps it float."""
    head, embedding, why = tied
    keys = [key for key in (head + ".weight", embedding + ".weight") if key in plan.tensors]
    if len(keys) == 2 and not torch.equal(plan.load(keys[0], mmap=True), plan.load(keys[1], mmap=True)):
        layers.untied = True
        return
    layers.weight_keys[head] = keys[0] if keys else ""
    if why is None and (pattern := excluded_by(embedding, exclude)):
        why = f"excluded by {by} {pattern}"
    elif why is None and not user_patterns:
        why = DEFAULT_KEEPS_TIED.replace("default exclude", "default --exclude")
    if why is not None:
        layers.reasons[head] = f"tied to {embedding} ({why})"
        return
    layers.tied_head, layers.tied_embedding = head, embedding
    layers.skipped.update(keys[1:])  # stored twice (equal): written once, as the head's rows
    if exclude and not excluded_by(head, exclude):  # a bare --exclude asks for everything
        warnings.warn(tied_head_note(head, embedding, "qfp8 quantize", "--exclude"), stacklevel=4)


def _plan_linears(layers: LayerPlan, found: ModelLinears, plan, scheme: QuantizationScheme, exclude, by: str) -> None:
    reasons = layers.reasons
    for name in found.linears:
        stored = plan.tensors.get(layers.weight_keys[name])
        shape = None if stored is None else tuple(stored.file.info(stored.name).shape)
        pattern = excluded_by(name, exclude)
        gate = float_linear_reason(name) or found.kind_reasons.get(name)  # a MoE gate, MHA: float, as in quantize
        if stored is None or pattern or gate or len(shape) != 2 or name in reasons:
            layers.ignored.append(name)  # excluded, or tied to another tensor and not stored
            layers.layers[name] = (None, shape)
            reasons[name] = (
                f"excluded by {by} {pattern}" if pattern
                else gate if gate
                else reasons[name] if name in reasons
                else "not stored in the checkpoint (tied to another tensor)" if stored is None
                else f"stored as a {len(shape)}-D tensor"
            )  # fmt: skip
            continue
        if not stored.file.info(stored.name).dtype.is_floating_point:
            raise ValueError(f"{stored.file.path}: {stored.name} is {stored.file.info(stored.name).dtype}, not float")
        layers.quantized[name] = scheme
        layers.layers[name] = (scheme, shape)


def _plan_experts(
    layers: LayerPlan, found: ModelLinears, plan, scheme: QuantizationScheme, accuracy, excluded_fused: set[str]
) -> str:
    """Plans the fused experts' parts; returns why some are kept in float ("" when none is)."""
    experts_reason = ""
    for name, (fused, siblings) in found.expert_parts.items():
        stored = plan.tensors.get(name + ".weight")
        shape = None if stored is None else tuple(stored.file.info(stored.name).shape)
        reason = (
            f"the checkpoint stores them fused, as {fused} (transformers 5's model names); qfp8 quantize reads "
            "experts stored one by one (transformers' own save). Quantize the model in memory instead "
            "(qfp8.quantize + qfp8.save_pretrained)" if stored is None and fused in plan.tensors
            else "missing or not 2-D" if shape is None or len(shape) != 2
            else _experts_kept_float(scheme, accuracy, shape[0], len(siblings))
        )  # fmt: skip
        if reason or fused in excluded_fused:
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
