"""Assigning a checkpoint's tensors to a model skeleton, every name, shape and dtype checked."""

from __future__ import annotations

import re

import torch
from torch import nn

from qfp8.checkpoint.expert_state import ExpertWeights
from qfp8.checkpoint.pages import release_if_copied
from qfp8.checkpoint.readers import CheckpointPlan
from qfp8.checkpoint.ties import fill_tied_table, tie_model
from qfp8.checkpoint.validate import check_kv_scales
from qfp8.nn import QLinear
from qfp8.nn.embedding import QEmbedding
from qfp8.nn.experts import QExperts
from qfp8.nn.qlinear import state_spec

__all__ = ["FP8_DTYPES", "assign_state", "empty_buffer_slot"]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def _where(plan: CheckpointPlan | None, key: str) -> str:
    if plan is not None and key in plan.tensors:
        return f"{plan.tensors[key].file.path}: "
    return ""


def empty_buffer_slot(model: nn.Module, key: str) -> bool:
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
    unexpected = sorted(key for key in set(state) - set(expected) if not empty_buffer_slot(model, key))
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
    fill_tied_table(model, state)
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
            release_if_copied(module, own["weight"])
    result = model.load_state_dict(state, strict=False, assign=True)
    tie_model(model)
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
            release_if_copied(expert, stored)
        kept = expert.qweight.untyped_storage().data_ptr() == state["weight"].untyped_storage().data_ptr()
        buffer = None if kept or weights.parts == 1 else state["weight"]
