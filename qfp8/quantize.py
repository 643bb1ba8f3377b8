"""``quantize`` / ``calibrate`` / ``freeze`` and the report of what was done."""

from __future__ import annotations

import contextlib
import fnmatch
import sys
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm  # the hook class (torch.nn.utils.weight_norm names the function)

from qfp8 import formats, rounding
from qfp8.library import memory
from qfp8.library.routing import REFERENCE_KERNEL
from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn.conv import convolution_reason, is_convolution, quantize_convolution, quantizes_convolutions
from qfp8.nn.embedding import QEmbedding, untieable_reason
from qfp8.nn.experts import QExperts, checkpoint_parts, find_fused_experts, scheme_reason, use_fp8_experts

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_KEEPS_TIED",
    "FLOAT_LINEARS",
    "KV_CACHE_DTYPES",
    "META_REASON",
    "OTHER_WEIGHTS_WARNING",
    "OtherWeights",
    "PLAIN_LINEAR_SUBCLASSES",
    "QuantizeReport",
    "QuantizeResult",
    "ReportEntry",
    "calibrate",
    "check_calibrated",
    "enable_transformers_save",
    "exclude_patterns",
    "excluded_by",
    "float_linear_reason",
    "freeze",
    "linear_class_reason",
    "other_kinds_clause",
    "other_weight_kinds",
    "quantize",
    "tie_embedding",
    "tied_float_holders",
    "tied_head_note",
    "unmatched_exclude_notes",
    "untie_config",
    "untie_problem",
    "unwrapped",
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
    (fused MoE experts, GPT-2's Conv1D, convolutions), which stay in float;
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
            "(qfp8 quantizes nn.Linear and fused MoE experts)"
        )

    __repr__ = __str__


class QuantizeResult(NamedTuple):
    model: nn.Module
    report: QuantizeReport


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
    build): a subclass with its own forward, or nn.MultiheadAttention's projection."""
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


def _skip_reason(module: nn.Linear) -> str | None:
    if reason := linear_class_reason(module):
        return reason
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
    holders = {id(modules[name]) for name in others}
    embedding = modules[others[0]]
    if len(holders) > 1 or not isinstance(embedding, nn.Embedding):
        return "tied weights, e.g. tie_word_embeddings"
    if why := untieable_reason(embedding):
        return why
    if pattern := excluded_by(others[0], exclude):
        return f"excluded by pattern {pattern!r}"
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


def _carry_hooks(linear: nn.Module, qlinear: nn.Module, name: str) -> None:
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
            stacklevel=3,
        )


# Matrix weights outside nn.Linear above this share of the model's get a warning, not only a report line.
OTHER_WEIGHTS_WARNING = 0.05


def _find_other_weights(model: nn.Module, report: QuantizeReport, quantized_experts=frozenset()) -> None:
    """Fills ``report.others`` and ``report.other_fraction`` (see :class:`QuantizeReport`).

    ``quantized_experts``: ids of fused experts parameters being quantized, counted with the Linears.
    """
    linear = other = 0
    seen: set[int] = set()
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
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
        if isinstance(module, nn.Linear):
            linear += numel
        elif numel:
            report.others.append(OtherWeights(name or type(model).__name__, type(module).__name__, numel))
            other += numel
    report.other_fraction = other / (linear + other) if other else 0.0


def other_weight_kinds(model: nn.Module, fused_experts=frozenset()) -> list[str]:
    """The classes of the modules that hold float matrix weights outside ``nn.Linear`` (GPT-2's ``Conv1D``), as
    :func:`_find_other_weights` finds them; ``fused_experts``: ids of fused experts parameters, not counted."""
    report = QuantizeReport()
    _find_other_weights(model, report, fused_experts)
    return sorted({other.kind for other in report.others})


def other_kinds_clause(kinds: list[str]) -> str:
    """The part of a "nothing was quantized" message naming the weight-holding classes qfp8 does not take."""
    return f"{', '.join(kinds)} layers have weights but qfp8 quantizes nn.Linear (and fused MoE experts) only"


def _first_names(names: list[str], limit: int) -> str:
    """``names`` for a message: the first ``limit``, then how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


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


def quantize(
    model: nn.Module,
    weights: str | None = "float8_e4m3fn",
    weight_scale: str = "channel",
    activations: str | None = None,
    activation_scale: str = "token",
    kv_cache: str | None = None,
    exclude=DEFAULT_EXCLUDE,
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
    ``exclude``: fnmatch patterns on a Linear's full dotted name or its tail
    (None: none); a pattern you give that matches no ``nn.Linear`` is warned
    about. A Linear whose weight is the same Parameter as a plain
    ``nn.Embedding``'s (a tied ``lm_head``, when the ``exclude`` you pass lets
    it be quantized: the default keeps any tied output layer float, BERT's
    decoder too) is quantized and the embedding becomes a
    :class:`qfp8.nn.embedding.QEmbedding` that reads its rows from the FP8
    weight (the float table goes; ``config.tie_word_embeddings`` is set false,
    as the saved checkpoint says). Tied to any other module kept in float, it
    stays in float, with a warning. A MoE gate that is an nn.Linear (Qwen2-MoE's ``shared_expert_gate``) stays in float
    whatever ``exclude`` says, as the routers do (:data:`FLOAT_LINEARS`). Hooks registered on a Linear
    move to its QLinear. A refused
    call (ValueError) leaves the model as it was.

    Fused MoE experts (transformers' 3-D ``experts.gate_up_proj`` /
    ``experts.down_proj``) are quantized too, expert by expert, with the same
    weight and activation scheme (static scales: one per fused weight, see
    qfp8/nn/experts.py; ``accuracy="gptq"`` leaves them float); their report
    entries carry ``experts``, and the model then runs its experts through
    qfp8's ``"qfp8"`` experts implementation (each hit expert's QLinear).
    ``exclude`` patterns match their ``<module>.<param>`` names.
    Returns ``(model, report)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize takes an nn.Module, got {type(model).__name__}")
    outer, model = model, unwrapped(model)  # the report's names and the model's attributes: the wrapped model's
    if isinstance(model, nn.Linear) and not isinstance(model, QLinear):
        raise ValueError(
            f"quantize: the model is itself an nn.Linear ({model.in_features} -> {model.out_features}), which "
            "cannot be replaced in place; wrap it, quantize the wrapper and take the layer back: "
            "qfp8.quantize(nn.Sequential(linear))[0][0]"
        )
    if isinstance(kv_cache, torch.dtype):  # taken as weights= takes one: torch.float8_e4m3fn
        kv_cache = str(kv_cache).removeprefix("torch.")
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; expected one of {list(KV_CACHE_DTYPES)}")
    if weights is None:
        if kv_cache is None:
            raise ValueError("quantize: weights=None and kv_cache=None leave nothing to quantize")
        report = QuantizeReport()
        _set_up_attention(model, kv_cache, report, pack_heads=False)  # the FP8 cache's attention replaces sdpa
        return QuantizeResult(outer, report)
    scheme = QuantizationScheme.from_args(weights, weight_scale, activations, activation_scale, block_size)
    rounding.check_mode(accuracy)
    user_patterns = exclude is not DEFAULT_EXCLUDE
    exclude = exclude_patterns(exclude)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (QLinear, QExperts)):
            raise ValueError(
                f"model is already quantized (module {name or type(model).__name__!r} is a {type(module).__name__}); "
                "quantize a float model once"
            )
    if kv_cache is not None:
        from qfp8.nn.kv_cache import check_supported

        # enable_fp8_kv_cache refuses such a model too, but only after the
        # Linears were swapped: check first so that a refusal changes nothing.
        try:
            check_supported(model, f"quantize(kv_cache={kv_cache!r})")
        except ValueError as error:
            raise ValueError(f"{error}. Pass kv_cache=None to quantize its weights only") from None

    report = QuantizeReport()
    planned: dict[int, ReportEntry] = {}
    linear_names = []
    in_peft_model = _holds_peft_layers(model)
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear):
            continue
        linear_names.append(name)
        if id(module) in planned:  # a shared submodule: one QLinear for all its names
            entry = planned[id(module)]
            entry.aliases.append(name)
            if entry.quantized and (pattern := excluded_by(name, exclude)):  # excluded by any of its names
                entry.reason, entry.quantized = f"excluded by pattern {pattern!r} (as {name!r})", False
            continue
        entry = ReportEntry(name, module.in_features, module.out_features, quantized=False)
        pattern = excluded_by(name, exclude)
        entry.reason = (
            f"excluded by pattern {pattern!r}"
            if pattern
            else (
                float_linear_reason(name) or adapter_reason(name, module, in_peft_model) or _skip_reason(module) or ""
            )
        )
        entry.quantized = not entry.reason
        planned[id(module)] = entry
        report.entries.append(entry)
    linear_names += _plan_convolutions(model, exclude, accuracy, planned, report)
    experts = []  # (entry, FusedExperts): the fused MoE experts weights
    for item in find_fused_experts(model):
        count, out_features, in_features = item.module._parameters[item.attr].shape
        entry = ReportEntry(item.name, in_features, out_features, quantized=False, experts=count)
        pattern = excluded_by(item.name, exclude)
        entry.reason = (
            f"excluded by pattern {pattern!r}"
            if pattern
            else item.reason or scheme_reason(scheme, accuracy, out_features, checkpoint_parts(item.attr))
        )
        entry.quantized = not entry.reason
        linear_names.append(item.name)
        experts.append((entry, item))
        report.entries.append(entry)

    # A Linear tied to a plain nn.Embedding (a tied lm_head) is quantized and
    # the embedding then reads its rows from the FP8 weight (QEmbedding): the
    # table stays one, in FP8. Tied to anything else kept in float, it stays
    # in float: an FP8 copy would break the tie and any checkpoint saved from the model.
    modules = dict(model.named_modules(remove_duplicate=False))
    notes = []
    linears = [entry for entry in report.quantized if not entry.experts]
    tied = tied_float_holders(model, [modules[entry.name] for entry in linears])
    ties: dict[str, str] = {}  # a quantized Linear's name -> the name of the embedding tied to it
    for entry in linears:
        others = tied.get(id(modules[entry.name]))
        if not others:
            continue
        linear_names += others  # an exclude pattern naming the embedding acts on the Linear
        why = untie_problem(modules, others, exclude, explicit=user_patterns)
        if why is None:
            ties[entry.name] = others[0]
            if exclude:  # patterns of yours that leave it in (exclude=() asks for everything: no warning)
                notes.append(tied_head_note(entry.name, others[0], "quantize", "exclude"))
            continue
        entry.quantized = False
        entry.reason = f"weight tied to {', '.join(others)} (kept in float)"
        if why.startswith("excluded by"):
            remedy = "to quantize both, leave it out of exclude"
        elif why == DEFAULT_KEEPS_TIED:
            remedy = "to quantize both (one FP8 table), pass exclude=() or your own patterns"
        else:
            remedy = "to quantize it, give it its own copy of the weight first"
        notes.append(
            f"quantize: {entry.name!r} is kept in float: its weight is the same Parameter as that of "
            f"{', '.join(map(repr, others))}, which stays in float ({why}); {remedy}"
        )
    sharing: dict[int, list[str]] = {}  # quantized Linears that are different modules holding one weight
    for entry in linears:
        if entry.quantized:
            sharing.setdefault(id(modules[entry.name].weight), []).append(entry.name)
    for names in (names for names in sharing.values() if len(names) > 1):
        notes.append(
            f"quantize: {', '.join(map(repr, names))} hold one weight Parameter; each gets its own FP8 copy (the "
            f"tie is not kept, and the weight's bytes count {len(names)} times): make them one module to quantize "
            "it once (a module shared under several names is), or exclude all but one"
        )
    if user_patterns:
        notes += unmatched_exclude_notes(exclude, linear_names, type(model).__name__, "quantize")
    quantized_experts = {id(item.module._parameters[item.attr]) for entry, item in experts if entry.quantized}
    quantized_experts |= {id(modules[e.name].weight) for e in report.entries if is_convolution(modules.get(e.name))}
    _find_other_weights(model, report, quantized_experts)
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
        if report.others:  # GPT-2's Conv1D, for one
            why += "; " + other_kinds_clause(sorted({other.kind for other in report.others}))
        notes.append(f"quantize: nothing was quantized in {type(model).__name__}: {why}")
    elif report.other_fraction >= OTHER_WEIGHTS_WARNING:  # fused MoE experts, for one
        notes.append(f"quantize: {type(model).__name__}: {report.others_summary()}")

    # Validate every weight before changing anything: a refused weight
    # leaves the model as it was.
    weights_of = {entry.name: item.module._parameters[item.attr] for entry, item in experts}
    for entry in report.quantized:
        weight = weights_of[entry.name] if entry.experts else modules[entry.name].weight
        if formats.nonfinite_count(weight):
            raise ValueError(
                f"module {entry.name!r}: weight {list(weight.shape)} holds NaN/Inf values, which FP8 cannot "
                f"represent; fix the weight or pass exclude=[{entry.name!r}]"
            )
        if weight.dtype == torch.float64 and not torch.isfinite((amax := formats.abs_max(weight)).float()):
            raise ValueError(
                f"module {entry.name!r}: float64 weight {list(weight.shape)} holds values beyond float32's range "
                f"(|w| up to {float(amax):.3g}), which its float32 scales cannot cover; "
                f"fix the weight or pass exclude=[{entry.name!r}]"
            )
    for note in notes:
        warnings.warn(note, stacklevel=2)

    weight = module = weights_of = None  # the loops' last Linear, so that it too can go once replaced
    for entry in report.quantized:
        if entry.experts:
            continue
        # Popped, not read: once swapped in, nothing here holds the float
        # Linear, so the model peaks at one layer above its float size.
        linear = modules.pop(entry.name)
        if is_convolution(linear):
            qlinear = quantize_convolution(linear, scheme, entry.name, accuracy)
        else:
            qlinear = QLinear.from_linear(linear, scheme, entry.name, accuracy=accuracy)
        _carry_hooks(linear, qlinear, entry.name)
        entry.scheme = scheme.describe() + (f" accuracy-{accuracy}" if accuracy else "")
        entry.kernel = qlinear.packing
        if is_convolution(linear) and qlinear.packing == REFERENCE_KERNEL.name:
            entry.reason = "; ".join(qlinear.kernel_notes)  # why a quantized convolution takes the reference route
        for name in [entry.name, *entry.aliases]:
            modules.pop(name, None)
            _set_submodule(model, name, qlinear)
        del linear, qlinear
    for entry, item in experts:
        if entry.quantized:
            qexperts = QExperts.from_weight(item.module._parameters[item.attr], scheme, entry.name, accuracy)
            delattr(item.module, item.attr)  # the float Parameter goes
            setattr(item.module, item.attr, qexperts)
            use_fp8_experts(item.module)
            entry.scheme = scheme.describe() + (f" accuracy-{accuracy}" if accuracy else "")
            entry.kernel = qexperts.packing
            del qexperts
    for head_name, embedding_name in ties.items():
        tie_embedding(model, head_name, embedding_name)
        report.tied_embeddings.append(f"{embedding_name} reads its rows from {head_name}'s FP8 weight (one table)")
    _set_up_attention(model, kv_cache, report, pack_heads=True)
    if in_peft_model:  # peft's LoRA layers whose base is now FP8 merge by re-quantizing it
        from qfp8.integrations.peft import adopt_lora_layers

        adopt_lora_layers(model)
    model.qfp8_scheme = scheme
    if report.quantized:
        enable_transformers_save(model)
        # The float tensors left, if mapped from a file (transformers' loading), would keep every page
        # quantize read from it resident (see qfp8.library.memory).
        memory.copy_out_of_file_mappings(model)
    # glibc keeps freed heap memory (for a bf16 model, tens to hundreds of MB above the quantized model).
    memory.return_freed_memory()
    return QuantizeResult(outer, report)


def _plan_convolutions(model: nn.Module, exclude, accuracy, planned: dict, report: QuantizeReport) -> list[str]:
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
        pattern = excluded_by(name, exclude)
        entry.reason = f"excluded by pattern {pattern!r}" if pattern else convolution_reason(module, accuracy)
        entry.quantized = not entry.reason
        planned[id(module)] = entry
        report.entries.append(entry)
    return names


def _attention_implementation(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _set_up_attention(model: nn.Module, kv_cache: str | None, report: QuantizeReport, pack_heads: bool) -> None:
    """Switches the model's attention (packed SDPA when ``pack_heads``, the FP8 cache's with ``kv_cache``) and
    fills the report's ``kv_cache`` and ``attention`` lines (the latter only when the implementation changed)."""
    from qfp8.nn.attention import PACKED_SDPA, use_packed_sdpa
    from qfp8.nn.kv_cache import FUSED_ATTENTION, enable_fp8_kv_cache

    before = _attention_implementation(model)
    if pack_heads:
        use_packed_sdpa(model)
    if kv_cache is not None:
        layers = enable_fp8_kv_cache(model, formats.fp8_dtype(kv_cache))
        report.kv_cache = (
            f"{kv_cache} in {len(layers)} attention module{'s' if len(layers) != 1 else ''}; static per-tensor "
            "scales once calibrated (qfp8.calibrate), dynamic per-head scales until then"
        )
    after = _attention_implementation(model)
    if after == before:
        return
    what = {
        PACKED_SDPA: "one-token steps pack grouped-query heads, compiled too",
        FUSED_ATTENTION: "decode steps read the FP8 KV cache in qfp8's kernel; prefill runs SDPA",
    }.get(after)
    report.attention = f"{before} -> {after}" + (f" ({what})" if what else "")


def enable_transformers_save(model: nn.Module) -> None:
    """Lets a quantized model's own ``save_pretrained`` write the compressed-tensors checkpoint
    :func:`qfp8.save_pretrained` writes: transformers' (and ``push_to_hub``) through qfp8's transformers quantizer
    (qfp8/integrations/transformers_quantizer.py), diffusers' by calling qfp8's writer (qfp8/checkpoint/diffusers.py)."""
    if "diffusers" in sys.modules:
        from qfp8.checkpoint.diffusers import enable_diffusers_save, is_diffusers_model

        if is_diffusers_model(model):
            enable_diffusers_save(model)
            return
    if "transformers" not in sys.modules or not hasattr(model, "config"):
        return  # not a transformers model: nothing of transformers' to hook
    from qfp8.integrations.transformers_quantizer import enable_transformers_save as enable

    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()  # a PeftModel's own save_pretrained writes the adapter alone
    enable(model)


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
