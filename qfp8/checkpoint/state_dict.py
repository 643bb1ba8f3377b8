"""``load_state_dict``: a quantized state dict (the model's names or the checkpoint's) into a quantized model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from qfp8.checkpoint.assign import assign_state, empty_buffer_slot
from qfp8.checkpoint.expert_state import checkpoint_to_model
from qfp8.checkpoint.naming import CheckpointNames
from qfp8.checkpoint.readers import check_scale, check_scale_dtype
from qfp8.checkpoint.tensor_scales import collapse_rows
from qfp8.nn import QLinear
from qfp8.nn.experts import QExperts
from qfp8.nn.qlinear import state_spec

__all__ = ["KV_SCALE_RENAMES", "load_state_dict", "normalize_state_dict"]


KV_SCALE_RENAMES = {".kv_scale": (".k_scale", ".v_scale")}


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
    unexpected = [key for key in state if key not in expected and not empty_buffer_slot(model, key)]
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
    MoE experts, Mixtral's ``block_sparse_moe``; a per-tensor layer's scale
    written as ``[N, 1]`` equal rows, read as its one value).
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
            key = name + ".weight_scale"
            scale, want = state[key], tuple(module.weight_scale.shape)
            if want == (1,) and tuple(scale.shape) == (module.out_features, 1):  # as the checkpoint writers store it
                scale = collapse_rows(scale, f"state dict tensor {key!r}", f"module {name!r} has per-tensor weights")
            if scale.numel() == 1 and want == (1,) or scale.numel() == want[0] and want[1:] == (1,):
                state[key] = scale.reshape(want)
    assign_state(model, state, None, expert_weights)
    return model
