"""``from_pretrained`` and ``load_state_dict``: quantized checkpoints into models.

``from_pretrained`` builds the transformers model with its parameters on
the ``meta`` device (buffers such as rotary frequencies are computed as
usual; they are not in checkpoints), replaces each linear layer the
checkpoint quantizes with a meta :class:`QLinear` of the checkpoint's
scheme, and assigns every tensor as a view of the memory-mapped safetensors
file: no float copy of a quantized weight is made, and float tensors
(embeddings, norms, ``lm_head``) are used as stored (cast, a copy, only when
``dtype`` asks for another float dtype than the stored one).

The steps live in sibling modules, re-exported here: the skeleton
(skeleton.py), per-expert tensors under fused names (expert_state.py),
checked assignment (assign.py), tied embeddings (ties.py), the FP8 KV cache
(kv_load.py) and ``load_state_dict`` (state_dict.py).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint import sources
from qfp8.checkpoint.assign import FP8_DTYPES, assign_state
from qfp8.checkpoint.expert_state import ExpertWeights, checkpoint_to_model
from qfp8.checkpoint.kv_load import enable_kv_cache_skeleton, load_kv_rounding
from qfp8.checkpoint.pages import release_pages
from qfp8.checkpoint.readers import CheckpointPlan, open_checkpoint
from qfp8.checkpoint.remote_code import auto_config, check_flag
from qfp8.checkpoint.skeleton import _empty_weights as _empty_weights
from qfp8.checkpoint.skeleton import build_model, build_skeleton
from qfp8.checkpoint.state_dict import KV_SCALE_RENAMES, load_state_dict, normalize_state_dict
from qfp8.checkpoint.ties import tie_loaded_embeddings
from qfp8.library import memory

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
    tie_loaded_embeddings(model, checkpoint.config.get(qconfig.TIED_EMBEDDINGS_KEY), checkpoint.directory)
    load_kv_rounding(model, checkpoint.directory, plan.kv_cache_dtype is not None)
    model.qfp8_source = str(checkpoint.directory)
    model.qfp8_checkpoint_format = plan.format
    if schemes:
        from qfp8.quantize import enable_transformers_save  # quantize imports the checkpoint package

        enable_transformers_save(model)
    model.eval()
    return model
