"""diffusers models (UNet2DConditionModel, FluxTransformer2DModel, SD3Transformer2DModel...) in qfp8 checkpoints.

A diffusers model's ``config.json`` is its own (``_class_name``,
``_diffusers_version`` and the constructor's arguments); ``save_pretrained``
writes it with the compressed-tensors ``quantization_config`` added and the
model's float dtype under ``_qfp8_dtype``, and ``from_pretrained`` builds the
class ``_class_name`` names from it on the meta device, swaps in the FP8
modules the checkpoint quantizes (linears and convolutions) and assigns the
stored tensors, as for transformers models. A pipeline folder holds one model
per subfolder (``unet/``, ``transformer/``): ``from_pretrained(path, subfolder=...)``.

diffusers' own ``from_pretrained`` reads only the quantization methods of its
``AUTO_QUANTIZER_MAPPING`` (no public registration, unlike transformers'
``register_quantizer``), so it cannot load these folders; qfp8's does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from qfp8.checkpoint import loader
from qfp8.checkpoint.readers import Checkpoint, CheckpointPlan
from qfp8.library import memory

__all__ = [
    "DTYPE_KEY",
    "PIPELINE_INDEX",
    "check_pipeline_folder",
    "enable_diffusers_save",
    "is_diffusers_config",
    "is_diffusers_model",
    "load",
    "model_config_dict",
]

DTYPE_KEY = "_qfp8_dtype"
PIPELINE_INDEX = "model_index.json"


def is_diffusers_model(model: nn.Module) -> bool:
    return any(cls.__name__ == "ModelMixin" and cls.__module__.startswith("diffusers.") for cls in type(model).__mro__)


def is_diffusers_config(config: dict) -> bool:
    return "_class_name" in config and "_diffusers_version" in config


def model_config_dict(model: nn.Module) -> dict | None:
    """A diffusers model's config.json content (None for any other model), with its float dtype."""
    if not is_diffusers_model(model):
        return None
    as_dict = json.loads(model.to_json_string())
    as_dict.pop("quantization_config", None)
    float_dtype = next((p.dtype for p in model.parameters() if p.dtype in loader.COMPUTE_DTYPES), None)
    if float_dtype is not None:
        as_dict[DTYPE_KEY] = str(float_dtype).removeprefix("torch.")
    return as_dict


def check_pipeline_folder(directory: Path) -> None:
    """A pipeline folder (``model_index.json``, no ``config.json``) names the subfolders to load from instead."""
    if (directory / "config.json").is_file() or not (directory / PIPELINE_INDEX).is_file():
        return
    models = sorted(p.parent.name for p in directory.glob("*/config.json"))
    raise ValueError(
        f"{directory}: a diffusers pipeline folder ({PIPELINE_INDEX}, no config.json); load one of its models with "
        f"from_pretrained(path, subfolder=...): {', '.join(models) or 'no subfolder holds a config.json'}"
    )


def _model_class(config: dict, config_path: Path) -> type:
    try:
        import diffusers
    except ImportError as error:
        raise ImportError(f"{config_path} describes a diffusers model; qfp8 needs diffusers to build it") from error
    name = config["_class_name"]
    cls = getattr(diffusers, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ValueError(f"{config_path}: _class_name {name!r} is not a diffusers model class")
    return cls


def load(checkpoint: Checkpoint, plan: CheckpointPlan, device: torch.device, dtype) -> nn.Module:
    """The quantized diffusers model of ``checkpoint`` (see the module docstring)."""
    config_path = checkpoint.directory / "config.json"
    config = {key: value for key, value in checkpoint.config.items() if key != "quantization_config"}
    cls = _model_class(config, config_path)
    dtype = loader._compute_dtype(dtype, config.pop(DTYPE_KEY, None))
    with loader._empty_weights():
        model = cls.from_config(config)
    nn.Module.to(model, dtype)  # not ModelMixin.to, which warns about a cast it does not make here
    schemes, state, expert_weights = loader.checkpoint_to_model(model, plan.schemes, plan.state_dict(mmap=True))
    loader.build_skeleton(model, schemes)
    loader.assign_state(model, state, plan, expert_weights)
    model.qfp8_source = str(checkpoint.directory)
    model.qfp8_checkpoint_format = plan.format
    if schemes:
        enable_diffusers_save(model)
    model.eval()
    if device.type != "cpu":
        model.to(device)
    memory.return_freed_memory()
    return model


def enable_diffusers_save(model: nn.Module) -> None:
    """Makes diffusers' own ``model.save_pretrained(directory)`` of a quantized model write qfp8's checkpoint.

    diffusers' writer would store the FP8 bytes with no quantization config (a folder that loads back as garbage
    weights), and diffusers has no public quantizer registration to hook, so the model's ``save_pretrained`` (an
    instance attribute) calls :func:`qfp8.save_pretrained`, which keeps the model's own config.
    """
    from qfp8.checkpoint.writer import save_pretrained as qfp8_save_pretrained

    def save_pretrained(save_directory, is_main_process: bool = True, safe_serialization: bool = True, **kwargs):
        if kwargs:
            raise TypeError(
                f"{type(model).__name__}.save_pretrained of a qfp8 model takes save_directory, is_main_process and "
                f"safe_serialization; not {sorted(kwargs)} (qfp8.save_pretrained takes max_shard_size)"
            )
        if not safe_serialization:
            raise ValueError("qfp8 writes safetensors only: safe_serialization=False is refused")
        if is_main_process:
            qfp8_save_pretrained(model, save_directory)

    model.save_pretrained = save_pretrained
