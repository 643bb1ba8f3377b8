"""What ``quantize`` does to a model, decided before anything changes: which ``nn.Linear`` (and convolutions, fused
MoE experts) are quantized and which stay float and why, the ties between weights, the warnings.

:func:`plan_quantization` is the one planner: ``qfp8.quantize`` runs it on the model it is given, ``qfp8 quantize``
(qfp8/checkpoint/stream_plan.py) on a meta-device build of the checkpoint's class, then adds what only the files
tell. The helpers ``quantize`` uses to carry out a plan (hooks, ties) live here too."""

from __future__ import annotations

import fnmatch
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm  # the hook class (torch.nn.utils.weight_norm names the function)

from qfp8 import formats
from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn.conv import (
    conv1d_class_reason,
    convolution_reason,
    is_convolution,
    is_linear_layer,
    is_transformers_conv1d,
    linear_features,
    quantizes_convolutions,
)
from qfp8.nn.embedding import QEmbedding, untieable_reason
from qfp8.nn.experts import checkpoint_parts, find_fused_experts, scheme_reason
from qfp8.quantize_report import (
    OTHER_WEIGHTS_WARNING,
    QuantizeReport,
    ReportEntry,
    _find_other_weights,
    _first_names,
    other_kinds_clause,
)

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_KEEPS_TIED",
    "FLOAT_LINEARS",
    "KV_CACHE_DTYPES",
    "META_REASON",
    "PLAIN_LINEAR_SUBCLASSES",
    "PlanNote",
    "PlanWording",
    "QuantizePlan",
    "exclude_patterns",
    "excluded_by",
    "float_linear_reason",
    "linear_class_reason",
    "plan_quantization",
    "tie_embedding",
    "tied_float_holders",
    "tied_head_note",
    "unmatched_exclude_notes",
    "untie_config",
    "untie_problem",
    "unwrapped",
    "weight_reason",
]

KV_CACHE_DTYPES = (None, "float8_e4m3fn", "float8_e5m2")
# The default ``exclude``: by identity, a model without ``lm_head`` gets no
# "pattern matches nothing" warning for it (a user-given pattern does).
DEFAULT_EXCLUDE = ("lm_head",)
# nn.Linears kept in float whatever ``exclude`` says, as MoE routers are (transformers' routers are no
# nn.Linear, so quantize never takes them): Qwen2-MoE's shared_expert_gate, a Linear(hidden, 1) that scales
# the shared expert's output, which vLLM builds as a plain torch.nn.Linear with no slot for a weight_scale
# (a quantized one makes its loader fail) and which is too small for FP8 to save anything.
FLOAT_LINEARS = {"shared_expert_gate": "a MoE gate, kept in float as the routers are (vLLM builds it unquantized)"}
# A Linear's hook dicts that move, as they are, to the QLinear that replaces it:
# the same dict objects, so the RemovableHandles already given out still
# remove the hooks. Each main dict comes with the dicts its handles also name.
_CARRIED_HOOKS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_backward_pre_hooks": (),
    "_backward_hooks": ("_is_full_backward_hook",),
}
# State-dict hooks are not carried: a QLinear's state dict has other keys.
_DROPPED_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def exclude_patterns(exclude) -> tuple:
    """``exclude`` as a tuple of patterns: None is none, a string one pattern."""
    if exclude is None:
        return ()
    if isinstance(exclude, str):
        return (exclude,)
    if not isinstance(exclude, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in exclude):
        raise TypeError(f"exclude must be a pattern string or a list of them (or None), got {exclude!r}")
    return tuple(exclude)


def excluded_by(name: str, patterns) -> str | None:
    """The first fnmatch pattern of ``patterns`` that excludes the module ``name``, or None."""
    for pattern in patterns:
        # A pattern matches the full dotted name, or its tail ("lm_head"
        # matches "lm_head" and "model.lm_head").
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return pattern
    return None


def float_linear_reason(name: str) -> str | None:
    """Why the nn.Linear ``name`` stays in float whatever ``exclude`` says (:data:`FLOAT_LINEARS`), or None."""
    return FLOAT_LINEARS.get(name.rpartition(".")[2])


# nn.Linear subclasses whose own forward computes exactly F.linear(x, weight, bias) (read from their source).
PLAIN_LINEAR_SUBCLASSES = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


META_REASON = (
    "weight is on the meta device (offloaded by accelerate, or never loaded): load the model without disk "
    "offload, or stream the checkpoint with `qfp8 quantize`; qfp8.from_pretrained loads a quantized one"
)


def linear_class_reason(module: nn.Linear) -> str | None:
    """Why ``quantize`` keeps a Linear of this kind float whatever its weight (the CLI asks it of a meta-device
    build): a subclass with its own forward, or nn.MultiheadAttention's projection. Also takes transformers'
    ``Conv1D``, which ``quantize`` replaces by a QLinear too."""
    if is_transformers_conv1d(module):
        return conv1d_class_reason(module)
    cls = type(module)
    plain = f"{cls.__module__}.{cls.__qualname__}" in PLAIN_LINEAR_SUBCLASSES
    if cls.forward is not nn.Linear.forward and not plain:
        return f"{type(module).__name__} has its own forward"
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "used by nn.MultiheadAttention through its weight, not its forward"
    return None


# peft's adapter modules (LoRA's low-rank factors, the trainable copies of modules_to_save): what trains on top
# of the base model, so they stay float.
PEFT_ADAPTER_NAMES = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "modules_to_save"})


def _holds_peft_layers(model: nn.Module) -> bool:
    return "peft" in sys.modules and any(type(m).__module__.startswith("peft.") for m in model.modules())


def adapter_reason(name: str, module: nn.Linear, in_peft_model: bool) -> str | None:
    """Why the Linear ``name`` is a peft adapter that ``quantize`` keeps float, or None."""
    found = PEFT_ADAPTER_NAMES.intersection(name.split("."))
    if found:
        return f"peft adapter ({min(found)}): adapters train in float; only base layers are quantized"
    if in_peft_model and module.weight.requires_grad:
        return "trainable in a peft model (its weight requires grad); only frozen base layers are quantized"
    return None


def weight_reason(module: nn.Linear) -> str | None:
    """Why ``quantize`` keeps a Linear float for what its weight is (a dtype, the meta device, no elements, a
    pruning or weight-norm hook recomputing it), or None; a checkpoint's tensors tell these for a meta build."""
    if not module.weight.is_floating_point() or module.weight.dtype in formats.FP8_DTYPES.values():
        return f"weight dtype {module.weight.dtype} is not a float format"
    if module.weight.device.type == "meta":
        return META_REASON
    if module.weight.numel() == 0:
        return "empty weight"
    for hook in module._forward_pre_hooks.values():
        # These hooks recompute `weight` from other tensors of the Linear (weight_orig and weight_mask,
        # weight_g and weight_v) before each forward; a QLinear has none of them.
        if isinstance(hook, BasePruningMethod):
            return "pruned with torch.nn.utils.prune: call prune.remove(module, 'weight') first to make it permanent"
        if isinstance(hook, WeightNorm):
            return (
                "has torch.nn.utils.weight_norm's hook: call torch.nn.utils.remove_weight_norm(module) first "
                "(or use torch.nn.utils.parametrizations.weight_norm, which quantize takes)"
            )
    return None


def unmatched_exclude_notes(patterns, linear_names, model_name: str, caller: str) -> list[str]:
    """One warning text per pattern of ``patterns`` that excludes none of ``linear_names`` (a typo, most likely)."""
    return [
        f"{caller}: exclude pattern {pattern!r} matches no nn.Linear of {model_name}, so it excludes nothing "
        "(a pattern matches a Linear's full dotted name or its tail, e.g. 'lm_head' or 'model.layers.0.*')"
        for pattern in patterns
        if not any(excluded_by(name, (pattern,)) for name in linear_names)
    ]


def tied_float_holders(model: nn.Module, quantized: list[nn.Module]) -> dict[int, list[str]]:
    """For each Linear of ``quantized`` whose weight Parameter another, unquantized module also holds
    (a tied ``lm_head`` and its embedding): ``id(linear) -> [that module's name, ...]``."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((name or type(model).__name__, module))
    quantized_ids = {id(m) for m in quantized}
    tied = {}
    for linear in quantized:
        others = [name for name, module in holders.get(id(linear.weight), []) if id(module) not in quantized_ids]
        if others:
            tied[id(linear)] = others
    return tied


DEFAULT_KEEPS_TIED = "the default exclude keeps a tied output layer float, as it keeps lm_head"


def untie_problem(modules: dict[str, nn.Module], others: list[str], exclude, explicit: bool = True) -> str | None:
    """Why the float modules ``others`` sharing a quantized Linear's weight cannot read it from FP8 (None: they
    are one plain ``nn.Embedding``, which becomes a QEmbedding)."""
    pattern = excluded_by(others[0], exclude)
    return _untie_problem(modules, others, pattern and f"excluded by pattern {pattern!r}", explicit)


def _untie_problem(modules: dict[str, nn.Module], others: list[str], excluded: str | None, explicit: bool):
    """:func:`untie_problem`, ``excluded`` saying how ``others[0]`` is excluded (None: it is not)."""
    holders = {id(modules[name]) for name in others}
    embedding = modules[others[0]]
    if len(holders) > 1 or not isinstance(embedding, nn.Embedding):
        return "tied weights, e.g. tie_word_embeddings"
    if why := untieable_reason(embedding):
        return why
    if excluded:
        return excluded
    if not explicit:  # BERT's cls.predictions.decoder, say: an output layer not named lm_head
        return DEFAULT_KEEPS_TIED
    return None


def tied_head_note(head: str, embedding: str, caller: str, option: str) -> str:
    """The warning for a tied output layer that exclude patterns of the user leave in: it and its embedding go
    to FP8 together, where the default would have kept both float."""
    return (
        f"{caller}: {head!r} and its tied embedding {embedding!r} are quantized to one FP8 table, as your {option} "
        f"patterns do not name {head!r}; the output layer is the most sensitive to FP8 rounding (SmolLM2: KL "
        f"0.048 against 0.019 with it float, 0.008 with accuracy='gptq'), and vLLM loads no quantized lm_head. "
        f"Add {head!r} to {option} to keep both float"
    )


def tie_embedding(model: nn.Module, head_name: str, embedding_name: str) -> QEmbedding:
    """Replaces the plain ``nn.Embedding`` ``embedding_name`` (under each of its names) by a QEmbedding that
    reads its rows from the QLinear ``head_name``, and sets ``config.tie_word_embeddings`` false: qfp8 keeps
    the tie, transformers must not tie the FP8 head to the embedding again."""
    embedding = model.get_submodule(embedding_name)
    tied = QEmbedding.tied_to(embedding, model.get_submodule(head_name), head_name, embedding_name)
    _carry_hooks(embedding, tied, embedding_name)  # transformers' enable_input_require_grads hooks the embedding
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if module is embedding:
            _set_submodule(model, name, tied)
    untie_config(getattr(model, "config", None))
    return tied


def untie_config(config) -> None:
    """Sets ``tie_word_embeddings`` false in a transformers config and in its text config (a VLM's, which
    its language model reads): qfp8 holds the tie, transformers must not tie the FP8 head again."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for part in {id(c): c for c in (config, text) if c is not None}.values():
        if getattr(part, "tie_word_embeddings", False):
            part.tie_word_embeddings = False


def _carry_hooks(linear: nn.Module, qlinear: nn.Module, name: str, stacklevel: int = 3) -> None:
    """Moves ``linear``'s forward and backward hooks to ``qlinear`` (the same dict objects); also an embedding's
    to its QEmbedding.

    A QLinear holding a Linear's plain hook dict instead of its own watched
    one never takes the fast path (see ``QLinear._arm``): the hooks always run.
    """
    for main, companions in _CARRIED_HOOKS.items():
        if getattr(linear, main):
            for attr in (main, *companions):
                qlinear.__dict__[attr] = linear.__dict__[attr]
    if isinstance(qlinear, QLinear):
        qlinear.__dict__["_fast"] = None
    accelerate_hook = getattr(linear, "_hf_hook", None)
    if accelerate_hook is not None:  # dispatch_model's device hook on a single Linear (a split lm_head, say)
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(qlinear, accelerate_hook)
    dropped = sum(len(getattr(linear, attr)) for attr in _DROPPED_HOOKS)
    if dropped:
        warnings.warn(
            f"quantize: module {name!r} had {dropped} state-dict hook(s) registered on its "
            f"{type(linear).__name__}; the {type(qlinear).__name__} replacing it does not keep them (its state dict "
            "holds other tensors)",
            stacklevel=stacklevel,
        )


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's and (Distributed)DataParallel's wrappers.

    A wrapper's names prefix every module (``_orig_mod.``, ``module.``): a
    checkpoint written with them matches no model.
    """
    while True:
        if "torch._dynamo" in sys.modules and isinstance(
            model, sys.modules["torch._dynamo"].eval_frame.OptimizedModule
        ):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


@dataclass(frozen=True)
class PlanWording:
    """How a plan's reasons and warnings name their caller and its exclude option: ``quantize``'s (the default)
    or the CLI's, whose patterns come from ``--exclude``."""

    caller: str = "quantize"
    option: str = "exclude"
    excluded: Callable[[str], str] = lambda pattern: f"excluded by pattern {pattern!r}"


class PlanNote(NamedTuple):
    """A warning the plan asks for, with its kind: ``"unmatched"`` (an exclude pattern matching nothing),
    ``"tied_head"`` (a tied head quantized with its table), ``"tie"`` (a Linear kept float by a tie), ``"shared"``
    (Linears sharing a weight), ``"coverage"`` (what the model keeps float overall)."""

    kind: str
    text: str


@dataclass
class QuantizePlan:
    """What :func:`plan_quantization` decided for a model: the report (its entries say what is quantized and
    why the others are not), the model's modules by name, the fused experts weights as ``(entry,
    FusedExperts)``, the tied heads (a quantized Linear's name -> the embedding that will read its rows), the
    warnings to give, whether the model holds peft layers, and the exclude pattern that keeps each excluded
    entry float (by name)."""

    report: QuantizeReport
    modules: dict[str, nn.Module]
    experts: list = field(default_factory=list)
    ties: dict[str, str] = field(default_factory=dict)
    notes: list[PlanNote] = field(default_factory=list)
    in_peft_model: bool = False
    excluded: dict[str, str] = field(default_factory=dict)


@dataclass
class _Rules:
    """What the plan's decisions take besides the model: the patterns, the names they see, the wording."""

    exclude: tuple
    user_patterns: bool
    accuracy: str | None
    from_files: bool  # a meta-device build: what its weights would tell is the checkpoint's to say
    names: Callable[[str], tuple]
    wording: PlanWording

    def pattern(self, name: str) -> str | None:
        """The first pattern that excludes the module ``name`` (under any name it has), or None."""
        return next((p for n in self.names(name) if (p := excluded_by(n, self.exclude))), None)


def plan_quantization(
    model: nn.Module,
    scheme: QuantizationScheme,
    exclude: tuple,
    user_patterns: bool,
    accuracy,
    *,
    from_files: bool = False,
    names=None,
    wording: PlanWording = PlanWording(),
) -> QuantizePlan:
    """Plans ``quantize`` on ``model`` (``exclude``: patterns, ``user_patterns``: whether the user gave them);
    changes nothing in the model. The one planner: ``qfp8.quantize`` runs it on the model, ``qfp8 quantize``
    (qfp8/checkpoint/stream_plan.py) and transformers' ``Qfp8Config`` loading on a meta-device build of the
    model, with ``from_files``: the weights' dtype and device are not judged (the checkpoint's tensors tell
    those), nor which layers train in a peft model.
    ``names(name)``: the names exclude patterns are matched against (the model's own by default; the CLI
    adds the checkpoint's); ``wording``: how reasons and warnings name the caller and its option."""
    rules = _Rules(exclude, user_patterns, accuracy, from_files, names or (lambda name: (name,)), wording)
    report = QuantizeReport()
    in_peft_model = not from_files and _holds_peft_layers(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    plan = QuantizePlan(report, modules, in_peft_model=in_peft_model)
    linear_names = _plan_linears(model, rules, plan)
    plan.experts = _plan_experts(model, scheme, rules, plan, linear_names)
    linears = [entry for entry in report.quantized if not entry.experts]
    linear_names += _plan_ties(model, plan, linears, rules)
    plan.notes += [PlanNote("shared", note) for note in _shared_weight_notes(modules, linears, wording.caller)]
    if user_patterns:
        seen = [n for name in linear_names for n in rules.names(name)]
        notes = unmatched_exclude_notes(exclude, seen, type(model).__name__, wording.caller)
        plan.notes += [PlanNote("unmatched", note) for note in notes]
    quantized_experts = {id(item.module._parameters[item.attr]) for entry, item in plan.experts if entry.quantized}
    quantized_experts |= {id(modules[e.name].weight) for e in report.entries if is_convolution(modules.get(e.name))}
    _find_other_weights(model, report, quantized_experts)
    plan.notes += [PlanNote("coverage", note) for note in _coverage_notes(model, report, user_patterns)]
    return plan


def _exclusion(rules: _Rules, plan: QuantizePlan, name: str) -> str:
    """The reason text of ``name``'s exclusion ("" when no pattern excludes it), recorded in ``plan.excluded``."""
    pattern = rules.pattern(name)
    if pattern is None:
        return ""
    plan.excluded[name] = pattern
    return rules.wording.excluded(pattern)


def _plan_linears(model: nn.Module, rules: _Rules, plan: QuantizePlan) -> list[str]:
    """Report entries for the model's ``nn.Linear`` and convolutions (one per module, its other names as
    aliases); returns every name they have."""
    planned: dict[int, ReportEntry] = {}
    linear_names = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_linear_layer(module):  # an nn.Linear, or transformers' Conv1D (GPT-2's)
            continue
        linear_names.append(name)
        if id(module) in planned:  # a shared submodule: one QLinear for all its names
            entry = planned[id(module)]
            entry.aliases.append(name)
            if entry.quantized and (excluded := _exclusion(rules, plan, name)):  # excluded by any of its names
                entry.reason, entry.quantized = f"{excluded} (as {name!r})", False
                plan.excluded[entry.name] = plan.excluded[name]
            continue
        entry = ReportEntry(name, *linear_features(module), quantized=False)
        entry.reason = _exclusion(rules, plan, name) or _linear_reason(name, module, rules, plan.in_peft_model)
        entry.quantized = not entry.reason
        planned[id(module)] = entry
        plan.report.entries.append(entry)
    linear_names += _plan_convolutions(model, rules, plan, planned)
    return linear_names


def _linear_reason(name: str, module: nn.Linear, rules: _Rules, in_peft_model: bool) -> str:
    """Why the Linear ``name``, which no pattern excludes, stays float ("" when it is quantized)."""
    return (
        float_linear_reason(name)
        or adapter_reason(name, module, in_peft_model)
        or linear_class_reason(module)
        or (None if rules.from_files else weight_reason(module))
        or ""
    )


def _plan_convolutions(model: nn.Module, rules: _Rules, plan: QuantizePlan, planned: dict) -> list[str]:
    """Report entries for the model's ``nn.Conv1d`` / ``nn.Conv2d`` (quantized as QConv1d / QConv2d, see
    qfp8/nn/conv.py, unless a reason keeps one float); returns their names."""
    names = []
    if not quantizes_convolutions(model):
        return names
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_convolution(module):
            continue
        if not name:
            raise ValueError(
                f"quantize: the model is itself a convolution ({type(module).__name__}), which cannot be replaced in "
                "place; wrap it, quantize the wrapper and take the layer back: qfp8.quantize(nn.Sequential(conv))[0][0]"
            )
        names.append(name)
        if id(module) in planned:
            planned[id(module)].aliases.append(name)
            continue
        entry = ReportEntry(name, module.weight[0].numel(), module.weight.shape[0], quantized=False)
        entry.reason = _exclusion(rules, plan, name) or convolution_reason(module, rules.accuracy)
        entry.quantized = not entry.reason
        planned[id(module)] = entry
        plan.report.entries.append(entry)
    return names


def _plan_experts(model: nn.Module, scheme, rules: _Rules, plan: QuantizePlan, linear_names: list) -> list:
    """Report entries for the fused MoE experts weights; returns them as ``(entry, FusedExperts)`` and adds
    their names to ``linear_names``."""
    experts = []
    for item in find_fused_experts(model, check_weights=not rules.from_files):
        count, out_features, in_features = item.module._parameters[item.attr].shape
        entry = ReportEntry(item.name, in_features, out_features, quantized=False, experts=count)
        entry.reason = (
            _exclusion(rules, plan, item.name)
            or item.reason
            or scheme_reason(scheme, rules.accuracy, out_features, checkpoint_parts(item.attr))
        )
        entry.quantized = not entry.reason
        linear_names.append(item.name)
        experts.append((entry, item))
        plan.report.entries.append(entry)
    return experts


def _plan_ties(model: nn.Module, plan: QuantizePlan, linears: list, rules: _Rules) -> list[str]:
    """Fills ``plan.ties`` and the notes on tied weights; returns the names of the modules tied to a Linear.

    A Linear tied to a plain nn.Embedding (a tied lm_head) is quantized and
    the embedding then reads its rows from the FP8 weight (QEmbedding): the
    table stays one, in FP8. Tied to anything else kept in float, it stays
    in float: an FP8 copy would break the tie and any checkpoint saved from the model.
    """
    modules, names, wording = plan.modules, [], rules.wording
    tied = tied_float_holders(model, [modules[entry.name] for entry in linears])
    for entry in linears:
        others = tied.get(id(modules[entry.name]))
        if not others:
            continue
        names += others  # an exclude pattern naming the embedding acts on the Linear
        pattern = rules.pattern(others[0])
        why = _untie_problem(modules, others, pattern and wording.excluded(pattern), rules.user_patterns)
        if why is None:
            plan.ties[entry.name] = others[0]
            if rules.exclude:  # patterns of yours that leave it in (exclude=() asks for everything: no warning)
                note = tied_head_note(entry.name, others[0], wording.caller, wording.option)
                plan.notes.append(PlanNote("tied_head", note))
            continue
        entry.quantized = False
        entry.reason = f"weight tied to {', '.join(others)} (kept in float)"
        if pattern is not None and why == wording.excluded(pattern):
            remedy = f"to quantize both, leave it out of {wording.option}"
        elif why == DEFAULT_KEEPS_TIED:
            remedy = f"to quantize both (one FP8 table), pass {wording.option}=() or your own patterns"
        else:
            remedy = "to quantize it, give it its own copy of the weight first"
        note = (
            f"{wording.caller}: {entry.name!r} is kept in float: its weight is the same Parameter as that of "
            f"{', '.join(map(repr, others))}, which stays in float ({why}); {remedy}"
        )
        plan.notes.append(PlanNote("tie", note))
    return names


def _shared_weight_notes(modules: dict[str, nn.Module], linears: list, caller: str) -> list[str]:
    """A note for each weight Parameter held by several quantized Linears that are different modules."""
    sharing: dict[int, list[str]] = {}
    for entry in linears:
        if entry.quantized:
            sharing.setdefault(id(modules[entry.name].weight), []).append(entry.name)
    return [
        f"{caller}: {', '.join(map(repr, names))} hold one weight Parameter; each gets its own FP8 copy (the "
        f"tie is not kept, and the weight's bytes count {len(names)} times): make them one module to quantize "
        "it once (a module shared under several names is), or exclude all but one"
        for names in sharing.values()
        if len(names) > 1
    ]


def _coverage_notes(model: nn.Module, report: QuantizeReport, user_patterns: bool) -> list[str]:
    """The notes on what the plan leaves in float: Linears on the meta device, nothing quantized at all, or a
    large share of matrix weights outside nn.Linear."""
    notes = []
    on_meta = [e.name for e in report.entries if e.reason == META_REASON]
    if on_meta and len(on_meta) < len(report.entries):
        shown = _first_names(on_meta, 3)
        notes.append(
            f"quantize: {len(on_meta)} of {len(report.entries)} nn.Linear stay in float because their weights are on "
            f"the meta device ({shown}; accelerate's disk offload keeps them there until a forward): load the model "
            "without disk offload to quantize them all"
        )
    all_excluded = user_patterns and all(e.reason.startswith("excluded by pattern") for e in report.entries)
    if not report.quantized and not (report.entries and all_excluded):
        why = (
            f"every nn.Linear of it was skipped ({len(report.entries)}; the report says why)"
            if report.entries
            else "it has no nn.Linear"
        )
        if report.others:  # a convolution of a transformers model, for one
            why += "; " + other_kinds_clause(sorted({other.kind for other in report.others}))
        notes.append(f"quantize: nothing was quantized in {type(model).__name__}: {why}")
    elif report.other_fraction >= OTHER_WEIGHTS_WARNING:  # fused MoE experts, for one
        notes.append(f"quantize: {type(model).__name__}: {report.others_summary()}")
    return notes
