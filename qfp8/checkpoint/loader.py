"""``from_pretrained`` and ``load_state_dict``: quantized checkpoints into models.

``from_pretrained`` builds the transformers model with its parameters on
the ``meta`` device (buffers such as rotary frequencies are computed as
usual; they are not in checkpoints), replaces each linear layer the
checkpoint quantizes with a meta :class:`QLinear` of the checkpoint's
scheme, and assigns every tensor as a view of the memory-mapped safetensors
file: no float copy of a quantized weight is made, and float tensors
(embeddings, norms, ``lm_head``) are used as stored (cast, a copy, only when
``dtype`` asks for another float dtype than the stored one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint import sources
from qfp8.checkpoint.naming import KV_ROUNDING_FILE, CheckpointNames
from qfp8.checkpoint.readers import CheckpointPlan, check_scale, check_scale_dtype, open_checkpoint
from qfp8.checkpoint.remote_code import auto_config, check_flag
from qfp8.checkpoint.safetensors_io import SafetensorsFile
from qfp8.checkpoint.validate import check_kv_scales
from qfp8.library import memory
from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn.attention import use_packed_sdpa
from qfp8.nn.conv import conv_skeleton
from qfp8.nn.embedding import QEmbedding, is_plain_embedding
from qfp8.nn.experts import QExperts, find_fused_experts, use_fp8_experts
from qfp8.nn.qlinear import state_spec

__all__ = [
    "COMPUTE_DTYPES",
    "ExpertWeights",
    "FP8_DTYPES",
    "KV_SCALE_RENAMES",
    "assign_state",
    "build_model",
    "build_skeleton",
    "checkpoint_to_model",
    "enable_kv_cache_skeleton",
    "from_pretrained",
    "load_state_dict",
    "normalize_state_dict",
    "release_pages",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)
KV_SCALE_RENAMES = {".kv_scale": (".k_scale", ".v_scale")}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


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


def build_skeleton(model: nn.Module, schemes: dict[str, QuantizationScheme]) -> None:
    """Replaces the named ``nn.Linear`` modules (and fused experts parameters) by meta ``QLinear`` modules
    (``QExperts``) of their scheme (in place)."""
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    fused = {item.name: item for item in find_fused_experts(model)}
    for name, scheme in schemes.items():
        if name in fused:
            _experts_skeleton(fused[name], scheme)
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the checkpoint quantizes module {name!r}, which the model does not have") from None
        if isinstance(module, QLinear):
            continue  # an alias already replaced
        skeleton = conv_skeleton(module, scheme, name)  # a convolution's (or GPT-2's Conv1D's), else None
        if skeleton is not None:
            for alias in aliases[id(module)]:
                _set_submodule(model, alias, skeleton)
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"the checkpoint quantizes module {name!r}, but the model's module is {type(module).__name__}, "
                "not nn.Linear (nor nn.Conv1d / nn.Conv2d)"
            )
        qlinear = QLinear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            scheme=scheme,
            dtype=module.weight.dtype,
            device=torch.device("meta"),
        )
        qlinear.label = name  # error messages name the module
        if scheme.activations == "static":
            qlinear.input_scale = torch.ones(1, device="meta")  # a slot for the stored scale
        for alias in aliases[id(module)]:
            _set_submodule(model, alias, qlinear)
    uniform = set(schemes.values())
    model.qfp8_scheme = uniform.pop() if len(uniform) == 1 else None
    use_packed_sdpa(model)  # as quantize does: one-token grouped-query steps pack their heads, compiled too


def _experts_skeleton(item, scheme: QuantizationScheme) -> None:
    param = item.module._parameters[item.attr]
    count, out_features, in_features = param.shape
    qexperts = QExperts(count, out_features, in_features, scheme, param.dtype, device=torch.device("meta"))
    qexperts.name_experts(item.name)
    if scheme.activations == "static":
        for expert in qexperts.experts:
            expert.input_scale = torch.ones(1, device="meta")  # a slot for the stored scale
    delattr(item.module, item.attr)
    setattr(item.module, item.attr, qexperts)
    use_fp8_experts(item.module)


def enable_kv_cache_skeleton(model: nn.Module, dtype: torch.dtype) -> None:
    """Adds the FP8 KV cache (``k_scale``/``v_scale`` on attention modules) that the checkpoint's scales load into."""
    try:
        from qfp8.nn.kv_cache import enable_fp8_kv_cache
    except ImportError as error:
        raise NotImplementedError(
            "this checkpoint has an FP8 KV cache (kv_cache_scheme / k_scale, v_scale) but qfp8.nn.kv_cache is not "
            f"available in this build: {error}"
        ) from error
    enable_fp8_kv_cache(model, dtype)
    model.qfp8_kv_cache_dtype = dtype


def _load_kv_rounding(model: nn.Module, directory: Path, has_kv_cache: bool) -> None:
    """The FP8 KV cache's query second moments from ``qfp8_kv_rounding.st`` (safetensors), when the folder has it."""
    path = Path(directory) / KV_ROUNDING_FILE
    if not path.is_file():
        return
    if not has_kv_cache:
        warnings.warn(f"{path}: the checkpoint has no FP8 KV cache; its key-rounding file is ignored", stacklevel=3)
        return
    from qfp8.nn.kv_cache import load_k_rounding

    file = SafetensorsFile(path)
    load_k_rounding(model, {name: file.read(name) for name in file.keys()}, str(path))


def _empty_weights():
    """Parameters on meta, buffers computed for real (they are not in checkpoints)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        return torch.device("meta")
    return init_empty_weights(include_buffers=False)


def _tie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if not callable(tie):
        return
    try:
        tie()
    except (KeyError, RuntimeError, AttributeError) as error:
        tied = [name for name, m in model.named_modules() if isinstance(m, (QLinear, QExperts)) and "lm_head" in name]
        if not tied:
            raise
        raise ValueError(
            f"the config ties {tied[0]} to the input embedding (tie_word_embeddings) but the checkpoint quantizes "
            f"{tied[0]}: a tied head shares the float embedding's weight; set tie_word_embeddings to false in "
            f"config.json, or store {tied[0]} in float ({type(error).__name__}: {error})"
        ) from None


def _fill_tied_table(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The word-embedding table a config ties, loaded as transformers loads it.

    - Stored under one of the two names only (qfp8's own SmolLM2 folder holds ``lm_head.weight``), it fills
      both, so that ``tie_weights`` ties two loaded tensors rather than the loaded head to an embedding left
      on meta.
    - Stored as two different tensors, or loaded into a model whose head and embedding are not tied although
      its config says so (T5 v1.1's flag, forced by transformers; BigBirdPegasusForCausalLM ties nothing),
      the two stay apart: the config's flag is cleared, where ``tie_weights`` would silently make one of them
      the other (or fail on a quantized head).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if not any(getattr(c, "tie_word_embeddings", False) for c in (config, text)):
        return
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    where = {id(module): name for name, module in model.named_modules()}
    if head is None or embedding is None or id(head) not in where or id(embedding) not in where:
        return
    from qfp8.quantize import untie_config  # quantize imports the checkpoint package

    float_head = type(head) is nn.Linear
    skeleton = embedding.weight.is_meta or (float_head and head.weight.is_meta)
    keys = [where[id(head)] + ".weight", where[id(embedding)] + ".weight"]
    present = [key for key in keys if key in state]
    if float_head and not skeleton and head.weight is not embedding.weight:
        untie_config(config)  # a live model the flag calls tied and that is not: it stays as it is
        return
    if len(present) == 2:
        first, second = state[keys[0]], state[keys[1]]
        if first.dtype != second.dtype or first.shape != second.shape or not torch.equal(first, second):
            untie_config(config)
        return
    if not float_head or len(present) != 1:
        return
    # A skeleton built on meta has its ties undone (accelerate's empty weights): tie_weights shows what the
    # model ties (BigBirdPegasusForCausalLM sets the flag and ties nothing).
    if skeleton:
        with contextlib.suppress(Exception):
            model.tie_weights()
    if head.weight is embedding.weight:
        state[keys[1 - keys.index(present[0])]] = state[present[0]]


def _where(plan: CheckpointPlan | None, key: str) -> str:
    if plan is not None and key in plan.tensors:
        return f"{plan.tensors[key].file.path}: "
    return ""


def release_pages(tensor: torch.Tensor) -> None:
    """Drops the resident pages of a tensor that views a private file mapping (re-read from the file if used).

    ``madvise(MADV_DONTNEED)`` on whole pages inside the tensor's bytes; a
    no-op where libc or madvise is not available.
    """
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


def _empty_buffer_slot(model: nn.Module, key: str) -> bool:
    """A buffer registered as None (an uncalibrated ``input_scale``, ``k_scale``): the state fills it."""
    module_name, _, leaf = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    if leaf == "input_scale" and isinstance(module, (QLinear, QExperts)) and module.scheme.activations != "static":
        return False  # only a static layer has an input_scale
    return leaf in module._buffers and module._buffers[leaf] is None


def assign_state(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    plan: CheckpointPlan | None = None,
    expert_weights: dict[str, ExpertWeights] | None = None,
) -> None:
    """``model.load_state_dict(state, assign=True)`` after checking every name, shape and dtype.

    Float tensors take the dtype the model has for them (as a copying
    ``load_state_dict`` would): a float32 checkpoint loaded with
    ``dtype=torch.bfloat16`` computes in bfloat16. FP8 weights and float32
    scales stay as stored. Errors name the file (when known), the tensor and both sizes.
    ``expert_weights``: fused experts weights held in ``state`` as meta
    placeholders, read expert by expert (see :func:`checkpoint_to_model`).
    """
    expert_weights = dict(expert_weights or {})
    if plan is not None:
        check_kv_scales(model, state, plan)
    with state_spec():
        expected = model.state_dict(keep_vars=True)
    unexpected = sorted(key for key in set(state) - set(expected) if not _empty_buffer_slot(model, key))
    if unexpected:
        shown = ", ".join(f"{_where(plan, k)}{k}" for k in unexpected[:5])
        raise ValueError(
            f"{len(unexpected)} tensor(s) do not belong to the model ({type(model).__name__}): {shown}"
            + (" ..." if len(unexpected) > 5 else "")
        )
    state = dict(state)
    for key, value in list(state.items()):
        if key not in expected:
            continue  # an empty buffer slot: its owner checks the value when loading
        target = expected[key]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{_where(plan, key)}tensor {key!r} has shape {list(value.shape)}, the model expects "
                f"{list(target.shape)}"
            )
        target_fp8, value_fp8 = target.dtype in FP8_DTYPES, value.dtype in FP8_DTYPES
        if (
            target_fp8 != value_fp8
            or (target_fp8 and value.dtype != target.dtype)
            or (target.is_floating_point() and not value.is_floating_point())
        ):
            raise ValueError(f"{_where(plan, key)}tensor {key!r} is {value.dtype}, the model expects {target.dtype}")
        if target.is_floating_point() and not target_fp8 and value.dtype != target.dtype:
            state[key] = value.to(target.dtype)
    _fill_tied_table(model, state)
    # QLinears (and experts) first, one at a time: a kernel that packs weights
    # makes its own copy, and the mapped pages of the stored weight are
    # released right away so that the file and the packed copy are never both resident.
    for name, module in model.named_modules():
        if not isinstance(module, (QLinear, QExperts)) or name + ".weight" not in state:
            continue
        prefix = name + "."
        own = {key[len(prefix) :]: state.pop(key) for key in list(state) if key.startswith(prefix)}
        if isinstance(module, QExperts):
            _assign_experts(module, name, own, expert_weights.pop(name + ".weight", None), plan is not None)
            continue
        try:
            module.load_state_dict(own, strict=False, assign=True)
        except RuntimeError as error:  # torch's "Error(s) in loading state_dict": the values are unusable
            problems = "; ".join(str(error).split("\n\t")[1:]) or str(error)
            raise ValueError(f"{_where(plan, prefix + 'weight')}module {name!r}: {problems}") from None
        if plan is not None:  # a file's mapped pages; a caller's own tensors are left alone
            _release_if_copied(module, own["weight"])
    result = model.load_state_dict(state, strict=False, assign=True)
    _tie(model)
    still_meta = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor is not None and tensor.device.type == "meta"
    ]
    for module in model.modules():
        if isinstance(module, QEmbedding):
            module.check_loaded()  # a loaded table must be the rows of the head it reads
    missing = sorted(set(result.missing_keys) & set(still_meta)) or still_meta
    if plan is not None:
        missing = _initialize_unsaved(model, missing)
    if missing:
        source = f"{plan.directory}" if plan is not None else "the state dict"
        raise ValueError(
            f"{source} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )


def _initialize_unsaved(model: nn.Module, missing: list[str]) -> list[str]:
    """Initializes, as transformers does, the tensors of ``missing`` that the model's class computes rather than
    stores (its ``_keys_to_ignore_on_load_missing``: Marian's sinusoidal position tables, which its
    ``save_pretrained`` leaves out); returns the rest. Only a module whose own tensors are all missing is
    initialized, so that ``_init_weights`` overwrites nothing loaded."""
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    init = getattr(model, "_init_weights", None)
    if not patterns or init is None:
        return missing
    computed = [name for name in missing if any(re.search(pattern, name) for pattern in patterns)]
    owners: dict[str, list[str]] = {}
    for name in computed:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    done = set()
    for owner, leaves in owners.items():
        module = model.get_submodule(owner)
        own = {**module._parameters, **module._buffers}
        if set(leaves) != {leaf for leaf, tensor in own.items() if tensor is not None}:
            continue
        for leaf in leaves:
            tensor = own[leaf]
            empty = torch.empty(tensor.shape, dtype=tensor.dtype)
            if leaf in module._parameters:
                module._parameters[leaf] = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            else:
                module._buffers[leaf] = empty
        init(module)
        done.update(f"{owner}.{leaf}" if owner else leaf for leaf in leaves)
    return [name for name in missing if name not in done]


def _tie_loaded_embeddings(model: nn.Module, tied, directory: Path) -> None:
    """Ties each embedding config.json lists (``qfp8_tied_embeddings``) to its quantized head again: the
    loaded float table must be the head's dequantized rows (checked), and is then dropped."""
    if tied is None:
        return
    from qfp8.quantize import tie_embedding  # quantize imports the checkpoint package

    where = f"{directory}/config.json: {qconfig.TIED_EMBEDDINGS_KEY}"
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise ValueError(f"{where} must map embedding names to head names, got {tied!r}")
    names = CheckpointNames(model)
    for embedding_name, head_name in tied.items():
        embedding_name, head_name = (
            names.to_model(n + ".weight").removesuffix(".weight") for n in (embedding_name, head_name)
        )
        try:
            embedding, head = model.get_submodule(embedding_name), model.get_submodule(head_name)
        except AttributeError:
            raise ValueError(f"{where}: the model has no {embedding_name!r} or no {head_name!r} to tie") from None
        if not isinstance(head, QLinear) or not is_plain_embedding(embedding):
            raise ValueError(
                f"{where}: {embedding_name!r} ({type(embedding).__name__}) can only be tied to {head_name!r} "
                f"({type(head).__name__}) as a plain nn.Embedding to a quantized Linear"
            )
        table = embedding.weight.detach()
        try:
            tied_module = tie_embedding(model, head_name, embedding_name)
            tied_module.dtype_of_rows = tied_module.dtype_of_rows.to(table.dtype)  # the rows' dtype: the table's
            tied_module._loaded = table
            tied_module.check_loaded()
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        release_pages(table)
        del table, embedding


def _release_if_copied(module: QLinear, stored: torch.Tensor) -> None:
    """Drops the pages of ``stored`` (a tensor mapped from a checkpoint file, never one a caller holds:
    ``MADV_DONTNEED`` zeroes anonymous memory) once the kernel has packed its own copy."""
    if module.qweight.untyped_storage().data_ptr() != stored.untyped_storage().data_ptr():
        release_pages(stored)


def _assign_experts(
    module: QExperts, name: str, own: dict, weights: ExpertWeights | None, mapped: bool = False
) -> None:
    """Loads a QExperts from its state entries, its FP8 weights expert by expert when ``weights`` holds them."""
    if weights is None:  # stacked in the state dict (a checkpoint written by an older qfp8)
        module.load_state_dict(own, strict=False, assign=True)
        return
    buffer = None  # the concatenated parts of one expert, reused while the kernel keeps its own packed copy
    for e, expert in enumerate(module.experts):
        state = {key: value[e] for key, value in own.items() if key != "weight"}
        state["weight"] = weights.expert(e, out=buffer)
        errors: list[str] = []
        expert._load_from_state_dict(state, "", {}, True, [], [], errors)
        if errors:
            raise ValueError(f"{name}[{e}]: " + "; ".join(errors))
        for stored in weights.stored(e) if mapped else ():
            _release_if_copied(expert, stored)
        kept = expert.qweight.untyped_storage().data_ptr() == state["weight"].untyped_storage().data_ptr()
        buffer = None if kept or weights.parts == 1 else state["weight"]


def normalize_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other tools' spellings of a quantized state dict -> qfp8's (and compressed-tensors') names.

    ``weight_scale_inv`` -> ``weight_scale``; 0-dim scales -> ``[1]``; scales
    in another float dtype -> float32; ``kv_scale`` -> ``k_scale`` and ``v_scale``.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state dict key {key!r} is {type(key).__name__}; keys are tensor names (str)")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {key!r} is {type(value).__name__}, not a tensor")
        if key.endswith(".weight_scale_inv"):
            key = key[: -len("_inv")]
        names = [key]
        for old, new in KV_SCALE_RENAMES.items():
            if key.endswith(old):
                names = [key[: -len(old)] + suffix for suffix in new]
        for name in names:
            if name.endswith(("_scale",)):
                check_scale_dtype(value, f"state dict tensor {key!r}")
                value = value.to(torch.float32)
                if value.dim() == 0:
                    value = value.reshape(1)
                check_scale(value, f"state dict tensor {key!r}")
            out[name] = value
    return out


def _key_mismatches(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The model's state names that ``state`` lacks, and the names of ``state`` the model does not have.

    An alias is not missing when its tensor is loaded under another name: a
    QLinear shared under two names, or a tied tensor that ``tie_weights`` ties again.
    """
    with state_spec():
        expected = model.state_dict(keep_vars=True)
    modules = dict(model.named_modules(remove_duplicate=False))
    ties = callable(getattr(model, "tie_weights", None))

    def identity(key: str):
        module_name, _, leaf = key.rpartition(".")
        owner = modules[module_name]
        if isinstance(owner, QLinear):
            return id(owner), leaf  # its "weight" entry is unpacked afresh for each name
        return id(expected[key]) if ties else key

    # A static layer's input_scale is part of its state even before calibration (its slot is empty then).
    for name, module in modules.items():
        if isinstance(module, (QLinear, QExperts)) and module.scheme.activations == "static":
            expected.setdefault(f"{name}.input_scale" if name else "input_scale", None)
    loaded = {identity(key) for key in state if key in expected}
    missing = [key for key in expected if key not in state and identity(key) not in loaded]
    unexpected = [key for key in state if key not in expected and not _empty_buffer_slot(model, key)]
    return missing, unexpected


def _from_checkpoint_names(model: nn.Module, state: dict[str, torch.Tensor]):
    """A state dict under transformers' checkpoint names (what save_pretrained writes: Mixtral's
    ``block_sparse_moe.experts.<e>.w1``...) -> the model's names; one under the model's names as it is."""
    with state_spec():
        own = set(model.state_dict(keep_vars=True))
    if all(key in own for key in state):
        return state, {}
    names = CheckpointNames(model)
    schemes = {}
    for name, module in model.named_modules():
        if isinstance(module, QExperts):
            for parts in names.expert_modules(name, module.num_experts) or ():
                schemes.update(dict.fromkeys(parts, module.scheme))
    _, state, expert_weights = checkpoint_to_model(model, schemes, state)
    return state, expert_weights


def load_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> nn.Module:
    """Loads a quantized state dict into a quantized model or meta skeleton (tensors are assigned, not copied).

    The state dict may use the model's names (``model.state_dict()``) or the
    checkpoint names ``save_pretrained`` writes (per-expert tensors of fused
    MoE experts, Mixtral's ``block_sparse_moe``).
    ``strict`` as in torch's ``load_state_dict``: by default a tensor the model
    has and the state dict lacks (or one the model does not have) raises a
    ``ValueError`` naming it; with ``strict=False`` such tensors are skipped
    and the model keeps its own values (a meta skeleton has none: its missing
    tensors still raise).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict takes an nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_state_dict takes a dict of tensors, got {type(state_dict).__name__} (for a file: "
            "safetensors.torch.load_file(path))"
        )
    if not any(isinstance(m, (QLinear, QExperts)) for m in model.modules()):
        raise ValueError("load_state_dict: the model has no QLinear; quantize it (or build it with from_pretrained)")
    state, expert_weights = _from_checkpoint_names(model, normalize_state_dict(state_dict))
    missing, unexpected = _key_mismatches(model, state)
    if strict and missing:
        raise ValueError(
            f"load_state_dict: the state dict lacks {len(missing)} tensor(s) the model ({type(model).__name__}) "
            f"has: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (strict=False keeps the "
            "model's own values for them)"
        )
    if not strict:
        for key in unexpected:
            del state[key]
    for name, module in model.named_modules():
        static = isinstance(module, (QLinear, QExperts)) and module.scheme.activations == "static"
        if isinstance(module, QLinear) and static and module.input_scale is None and name + ".input_scale" in state:
            module.input_scale = torch.ones(1, device=module.weight_scale.device)  # a slot for the stored scale
        if isinstance(module, QExperts) and static and name + ".input_scale" in state:
            for expert in module.experts:
                if expert.input_scale is None:
                    expert.input_scale = torch.ones(1, device=expert.weight_scale.device)
        if isinstance(module, QLinear) and name + ".weight_scale" in state:
            scale = state[name + ".weight_scale"]
            want = tuple(module.weight_scale.shape)
            if scale.numel() == 1 and want == (1,) or scale.numel() == want[0] and want[1:] == (1,):
                state[name + ".weight_scale"] = scale.reshape(want)
    assign_state(model, state, None, expert_weights)
    return model


def build_model(
    transformers, config, dtype: torch.dtype | None = None, bare_fallback: bool = False, trust_remote_code: bool = False
) -> nn.Module:
    """The class config.json's ``architectures`` names (a classifier, an encoder-decoder, a headless model),
    else a causal LM; with ``bare_fallback`` (the CLI, which only needs the module names), else the bare model,
    and a config none of these takes is a one-line ValueError. The checkpoint's own code (``auto_map``) runs
    only with ``trust_remote_code`` (see qfp8/checkpoint/remote_code.py); transformers is never left to prompt."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    auto_kwargs = {**kwargs, "trust_remote_code": trust_remote_code}
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        # Only a class made for this config: a hand-edited architectures could name another model's.
        if (
            isinstance(cls, type)
            and issubclass(cls, transformers.PreTrainedModel)
            and isinstance(config, cls.config_class)
        ):
            return cls._from_config(config, **kwargs)
    if not bare_fallback:
        return transformers.AutoModelForCausalLM.from_config(config, **auto_kwargs)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto.from_config(config, **auto_kwargs)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            last = error
    first_line = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
    architectures = getattr(config, "architectures", None) or []
    raise ValueError(
        f"transformers cannot build a {getattr(config, 'model_type', '?')} model "
        f"({', '.join(architectures) or 'no architectures in config.json'}) to find its linear layers: {first_line}"
    )


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(dtype, config_dtype) -> torch.dtype:
    """``from_pretrained``'s ``dtype`` argument as a float dtype: None or "auto" take the config's (else float32)."""
    if dtype is None or dtype == "auto":
        dtype = config_dtype or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if dtype in COMPUTE_DTYPES else torch.float32
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype):
        raise TypeError(
            f"from_pretrained: dtype must be a torch.dtype or its name (torch.bfloat16 or 'bfloat16'), got {dtype!r}"
        )
    if named not in COMPUTE_DTYPES:
        raise ValueError(
            f"from_pretrained: dtype {dtype!r} is not a dtype to compute in; expected one of "
            f"{[str(d).removeprefix('torch.') for d in COMPUTE_DTYPES]} or 'auto' (FP8 weights stay FP8 either way)"
        )
    return named


def _usable_device(device) -> torch.device:
    """``device`` as a torch.device this build and machine can put tensors on, checked before the load (torch's
    own error for "cuda" on a CPU build would come only after the whole load)."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"from_pretrained: device must be a str, torch.device or int, got {type(device).__name__}")
    try:
        usable = torch.device(device)
        torch.empty(0, device=usable)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"from_pretrained: device={str(device)!r} cannot be used here: {error}") from None
    return usable


def from_pretrained(
    path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    torch_dtype: torch.dtype | str | None = None,
    device_map=None,
    revision: str | None = None,
    subfolder: str = "",
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    trust_remote_code: bool = False,
    offload_folder: str | os.PathLike | None = None,
):
    """Loads a quantized checkpoint (qfp8's, compressed-tensors, vLLM/AutoFP8 ``fp8``, block ``fp8``, quanto).

    Takes transformers' loading arguments: ``path`` is a folder or a Hub repo
    id (``revision``, ``subfolder``, ``token``, ``cache_dir``,
    ``local_files_only``; ``HF_HUB_OFFLINE`` honoured). ``dtype`` is the
    dtype of the model's float computation (default: the config's); ``torch_dtype``
    is another name for it. ``device`` or ``device_map``: one device, or a map
    accelerate dispatches (``"auto"``, or module names to devices, ``"cpu"`` and
    ``"disk"`` offload included: disk-offloaded FP8 weights go to ``offload_folder``
    and leave memory). ``trust_remote_code``: run the checkpoint's own Python code (``auto_map``) to build its
    model; without it such a checkpoint is a ValueError, never a prompt (see qfp8/checkpoint/remote_code.py).
    ``subfolder`` also picks one model of a diffusers pipeline folder (``unet``, ``transformer``).
    """
    if torch_dtype is not None:
        if dtype is not None:
            raise TypeError("from_pretrained: give dtype or torch_dtype, not both (they are one argument)")
        dtype = torch_dtype
    if device is not None and device_map is not None:
        raise TypeError("from_pretrained: give device or device_map, not both")
    check_flag(trust_remote_code, "from_pretrained")  # before any file is read
    if device is not None:
        device_map = _usable_device(device)
    elif not isinstance(device_map, (dict, type(None))) and device_map not in sources.SINGLE_DEVICE_MAPS:
        device_map = _usable_device(device_map)
    from qfp8.checkpoint import diffusers as diffusers_checkpoint

    folder = sources.checkpoint_folder(path, revision, subfolder, token, cache_dir, local_files_only)
    if not subfolder:
        diffusers_checkpoint.check_pipeline_folder(folder)
    checkpoint = open_checkpoint(folder)
    plan = checkpoint.plan()
    if plan.format == "float":
        raise ValueError(
            f"{checkpoint.directory}: config.json has no quantization_config (a float checkpoint); quantize it "
            "with `qfp8 quantize SRC DST`, qfp8.quantize(model) or transformers' from_pretrained with "
            "quantization_config=qfp8.Qfp8Config()"
        )
    if diffusers_checkpoint.is_diffusers_config(checkpoint.config):
        model = diffusers_checkpoint.load(checkpoint, plan, torch.device("cpu"), dtype)
        return sources.place_model(model, device_map, offload_folder)
    try:
        import transformers
    except ImportError as error:
        raise ImportError("qfp8.from_pretrained needs transformers to build the model") from error
    if not (checkpoint.directory / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint.directory}: no config.json to build the model from")
    if not checkpoint.config.get("model_type"):
        raise ValueError(
            f"{checkpoint.directory}: config.json has no model_type, so there is no transformers model to build (a "
            "plain module was saved?). Build the module, qfp8.quantize it with the same scheme, then "
            "qfp8.load_state_dict(module, safetensors.torch.load_file(...))"
        )
    config = auto_config(checkpoint.directory, check_flag(trust_remote_code, "from_pretrained"))
    with contextlib.suppress(AttributeError):
        del config.quantization_config  # qfp8 does the quantization; transformers must not
    dtype = _compute_dtype(dtype, getattr(config, "dtype", None))
    with _empty_weights():
        model = build_model(transformers, config, dtype, trust_remote_code=trust_remote_code)
    load_checkpoint_into(model, checkpoint, plan)
    model = sources.place_model(model, device_map, offload_folder)
    memory.return_freed_memory()  # glibc kept ~110 MB of loading's freed heap for SmolLM2 (measured)
    return model


def load_checkpoint_into(model: nn.Module, checkpoint, plan: CheckpointPlan) -> nn.Module:
    """Loads ``plan`` (of ``checkpoint``) into ``model``, a transformers model built with its parameters on ``meta``:
    its quantized linear layers become QLinear (QExperts) views of the mapped files, its float tensors are assigned."""
    schemes, state, expert_weights = checkpoint_to_model(model, plan.schemes, plan.state_dict(mmap=True))
    build_skeleton(model, schemes)
    if plan.kv_cache_dtype is not None:
        enable_kv_cache_skeleton(model, plan.kv_cache_dtype)
    assign_state(model, state, plan, expert_weights)
    _tie_loaded_embeddings(model, checkpoint.config.get(qconfig.TIED_EMBEDDINGS_KEY), checkpoint.directory)
    _load_kv_rounding(model, checkpoint.directory, plan.kv_cache_dtype is not None)
    model.qfp8_source = str(checkpoint.directory)
    model.qfp8_checkpoint_format = plan.format
    if schemes:
        from qfp8.quantize import enable_transformers_save  # quantize imports the checkpoint package

        enable_transformers_save(model)
    model.eval()
    return model
