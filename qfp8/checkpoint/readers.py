"""Readers: every FP8 checkpoint format qfp8 takes, mapped onto QLinear's state.

:func:`open_checkpoint` finds a folder's safetensors files (refusing pickle
files), parses their headers and recognises the format:

=====================  ==========================================================
format                 how it is recognised, and what the reader maps
=====================  ==========================================================
``compressed-tensors`` ``quant_method: "compressed-tensors"``, ``format:
                       "float-quantized"`` (qfp8's own output, llm-compressor's):
                       ``weight``, ``weight_scale`` (``[1]``/``[N, 1]``/blocks, any
                       float dtype -> float32; ``[N, 1]`` of the groups listed in
                       ``qfp8_tensor_weight_groups`` -> ``[1]``), ``input_scale``, ``k_scale``/
                       ``v_scale``; zero points of symmetric schemes are dropped
                       (asymmetric schemes, and a ``kv_cache_scheme`` that is
                       not symmetric FP8 per tensor or dynamic, are refused).
``qfp8``               no ``quant_method``, ``qfp8_method: "qfp8"``: the same body,
                       written by qfp8 for e5m2 weights or a non-e4m3fn KV cache,
                       which other readers cannot represent (they refuse it); read
                       as ``compressed-tensors``.
``fp8``                ``quant_method: "fp8"`` (vLLM, AutoFP8): 0-dim
                       ``weight_scale``/``input_scale`` -> ``[1]``; ``kv_scale``
                       -> ``k_scale`` and ``v_scale``; ``k_proj.output_scale``
                       -> the attention's ``k_scale``.
``fp8-block``          ``quant_method: "fp8"`` with ``weight_block_size``
                       (DeepSeek-V3 style): ``weight_scale_inv`` is the block
                       scale that multiplies on dequantization -> ``weight_scale``.
``quanto``             ``quanto_qmap.json`` (optimum-quanto): ``weight._data``
                       -> ``weight``, ``weight._scale`` -> ``weight_scale``.
``float``              no ``quantization_config``: the input of ``qfp8 quantize``.
=====================  ==========================================================

A reader yields a :class:`CheckpointPlan`: the scheme of each quantized
module, the KV-cache dtype, and for each name of the qfp8 state dict where
its tensor is stored. Tensors are fetched one at a time, memory-mapped
(loading) or read into a fresh buffer (streaming).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qfp8 import formats
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.naming import KV_ROUNDING_FILE
from qfp8.checkpoint.safetensors_io import PICKLE_SUFFIXES, SafetensorsFile, read_json_file, refuse_pickle_message
from qfp8.checkpoint.tensor_scales import collapse_rows
from qfp8.checkpoint.validate import (
    check_config,
    check_kv_dtype_key,
    check_quanto_map,
    check_scale_bounds,
    check_unused_input_scales,
)
from qfp8.nn.scheme import QuantizationScheme

__all__ = [
    "Checkpoint",
    "CheckpointPlan",
    "FP8_WEIGHT_DTYPES",
    "IGNORED_SUFFIXES",
    "INDEX_NAME",
    "QUANTO_QMAP",
    "QUANTO_QMAP_NAMES",
    "QUANTO_WEIGHT_TYPES",
    "SINGLE_NAME",
    "StoredTensor",
    "check_scale",
    "check_scale_dtype",
    "open_checkpoint",
    "resolve",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
QUANTO_QMAP = "quanto_qmap.json"
# The name optimum-quanto's README saves the map under, beside save_file(model.state_dict()): read as well.
QUANTO_QMAP_NAMES = (QUANTO_QMAP, "quantization_map.json")
FP8_WEIGHT_DTYPES = tuple(formats.FP8_DTYPES.values())
# Tensors some writers keep that qfp8 rebuilds itself or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor of the qfp8 state dict is stored, and how to make it canonical."""

    file: SafetensorsFile
    name: str
    scale_shape: tuple[int, ...] | None = None  # set for scales: cast to float32, reshape to this
    collapse: bool = False  # a per-tensor scale stored as [N, 1] equal rows: read as its one value

    def load(self, mmap: bool = True) -> torch.Tensor:
        value = self.file.get(self.name) if mmap else self.file.read(self.name)
        if self.scale_shape is not None:
            where = f"{self.file.path}: {self.name}"
            check_scale_dtype(value, where)
            value = value.to(torch.float32)
            check_scale(value, where)
            if self.collapse:
                value = collapse_rows(value, where, f"its config group is listed in {qconfig.TENSOR_WEIGHTS_KEY}")
            value = value.reshape(self.scale_shape)
        return value


def check_scale_dtype(value: torch.Tensor, where: str) -> None:
    """A scale is stored in a float dtype; an integer or bool one would be read as the wrong numbers."""
    if not value.is_floating_point() or value.dtype.itemsize == 1:
        raise ValueError(
            f"{where} is {value.dtype}; scales are stored as float32, bfloat16 or float16 (as the quantizing tool "
            "wrote them)"
        )


def check_scale(value: torch.Tensor, where: str) -> None:
    """ValueError naming ``where`` for a scale the kernels cannot use (:func:`qfp8.formats.scale_problem`)."""
    problem = formats.scale_problem(value)
    if problem is not None:
        raise ValueError(f"{where} holds {problem}")


@dataclass
class CheckpointPlan:
    format: str
    directory: Path
    config: dict
    schemes: dict[str, QuantizationScheme] = field(default_factory=dict)
    kv_cache_dtype: torch.dtype | None = None
    tensors: dict[str, StoredTensor] = field(default_factory=dict)

    def load(self, name: str, mmap: bool = True) -> torch.Tensor:
        return self.tensors[name].load(mmap)

    def state_dict(self, mmap: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor, canonical names (memory-mapped views by default: no copy)."""
        return {name: stored.load(mmap) for name, stored in self.tensors.items()}


@dataclass
class Checkpoint:
    """A checkpoint folder: its config, files and the stored name -> file map."""

    directory: Path
    config: dict
    files: list[SafetensorsFile]
    where: dict[str, SafetensorsFile]
    quanto_map: dict | None = None
    quanto_map_name: str | None = None  # the file it came from

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    @property
    def format(self) -> str:
        if self.quanto_map is not None:
            return "quanto"
        qc = self.quantization_config
        if not qc:
            return "float"
        method = qc.get("quant_method")
        if method is None and qc.get(qconfig.QFP8_METHOD_KEY) == qconfig.QFP8_METHOD:
            method = qconfig.QFP8_METHOD
        if method in (qconfig.QUANT_METHOD, qconfig.QFP8_METHOD):
            fmt = qc.get("format")
            if fmt not in (*qconfig.STORED_FP8_FORMATS, qconfig.MIXED_FORMAT):
                raise ValueError(
                    f"{self.directory / 'config.json'}: {method} format {fmt!r} is not FP8; qfp8 reads "
                    f"{' and '.join(map(repr, qconfig.STORED_FP8_FORMATS))} (or {qconfig.MIXED_FORMAT!r} groups of them)"
                )
            return method
        if method == "fp8":
            return "fp8-block" if qc.get("weight_block_size") else "fp8"
        raise ValueError(
            f"{self.directory / 'config.json'}: unknown quant_method {method!r}; qfp8 reads 'compressed-tensors' "
            "and qfp8's own (qfp8_method 'qfp8'; float-quantized), 'fp8' (vLLM/AutoFP8, block-wise weight_scale_inv) and "
            "optimum-quanto folders"
        )

    def stored(self, name: str, scale_shape=None, collapse: bool = False) -> StoredTensor:
        return StoredTensor(self.where[name], name, scale_shape, collapse)

    def info(self, name: str):
        return self.where[name].info(name)

    def plan(self) -> CheckpointPlan:
        reader = {
            "compressed-tensors": _read_compressed_tensors,
            "qfp8": _read_compressed_tensors,
            "fp8": _read_fp8,
            "fp8-block": _read_fp8,
            "quanto": _read_quanto,
            "float": _read_float,
        }[self.format]
        plan = CheckpointPlan(self.format, self.directory, self.config)
        reader(self, plan)
        _check_plan(self, plan)
        return plan


# -------------------------------------------------------------- discovery


_GGUF_MESSAGE = (
    "{what}; qfp8 reads safetensors checkpoints. Load it with transformers "
    "(AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)), then qfp8.quantize(model) and "
    "qfp8.save_pretrained(model, out)"
)


def resolve(path: str | os.PathLike) -> Path:
    """A local folder, or a Hugging Face Hub repo id resolved through its local cache rules."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.is_file():
        if local.suffix in PICKLE_SUFFIXES:
            raise ValueError(refuse_pickle_message(local))
        if local.suffix == ".gguf":
            raise ValueError(_GGUF_MESSAGE.format(what=f"{local} is a GGUF file"))
        return local.parent
    text = str(path)
    if text.count("/") == 1 and not text.startswith((".", "/")):
        try:
            import huggingface_hub
        except ImportError:
            raise FileNotFoundError(f"{text}: no such folder (and huggingface_hub is not installed)") from None
        try:
            # Honours HF_HUB_OFFLINE (then only the local cache is used).
            return Path(
                huggingface_hub.snapshot_download(
                    text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", KV_ROUNDING_FILE]
                )
            )
        except Exception as error:  # the hub's errors differ between versions; re-raise as one
            raise FileNotFoundError(f"{text}: not a folder, and the Hub repo could not be resolved: {error}") from error
    raise FileNotFoundError(f"{text}: no such checkpoint folder")


def _check_config_types(config, config_path: Path) -> None:
    """ValueError naming the file and key for JSON of the wrong type where qfp8 reads a checkpoint's config (a
    string where an object goes, an int target, a bad ``re:`` pattern, an unknown dtype): they had surfaced as
    AttributeError, TypeError or re.error from deep in the reader."""
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: must hold a JSON object, got {type(config).__name__}")
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if value is None or value == "auto":
            continue
        if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(f"{config_path}: {key} {value!r} is not a torch dtype name (such as 'bfloat16')")
    qc = config.get("quantization_config")
    if qc is None:
        check_config(config, config_path)
        return
    if not isinstance(qc, dict):
        raise ValueError(f"{config_path}: quantization_config must be a JSON object, got {type(qc).__name__}")

    def patterns(value, where: str) -> None:
        if value is None:
            return
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"{config_path}: {where} must be a list of module names or patterns (strings)")
        for item in value:
            if item.startswith("re:"):
                try:
                    re.compile(item[3:])
                except re.error as error:
                    raise ValueError(f"{config_path}: {where} pattern {item!r} is not a regex: {error}") from None

    patterns(qc.get("ignore"), "quantization_config.ignore")
    groups = qc.get("config_groups")
    if groups is not None and not isinstance(groups, dict):
        raise ValueError(f"{config_path}: quantization_config.config_groups must be a JSON object of groups")
    for name, group in (groups or {}).items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{config_path}: {where} must be a JSON object, got {type(group).__name__}")
        patterns(group.get("targets"), f"{where}.targets")
        for part in ("weights", "input_activations", "output_activations"):
            if group.get(part) is not None and not isinstance(group[part], dict):
                raise ValueError(f"{config_path}: {where}.{part} must be a JSON object or null")
    check_config(config, config_path)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Parses the config and safetensors headers of a checkpoint folder (reads no tensor data)."""
    directory = resolve(path)
    config_path = directory / "config.json"
    config = {}
    if os.path.lexists(config_path):
        config = read_json_file(config_path, "config.json")
    _check_config_types(config, config_path)
    index_path = directory / INDEX_NAME
    if os.path.lexists(index_path):
        index = read_json_file(index_path, "safetensors index")
        if not isinstance(index, dict) or "weight_map" not in index:
            raise ValueError(f"{index_path}: not a safetensors index (no weight_map)")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{index_path}: weight_map must map tensor names to shard file names (strings)")
        names = sorted(set(weight_map.values()))
        if not names:
            raise ValueError(f"{index_path}: its weight_map names no tensor and no shard")
        for name in names:
            if Path(name).name != name or name in (".", ".."):  # no "../other/model.safetensors"
                raise ValueError(
                    f"{index_path} lists shard {name!r}, which is not a file name in {directory}; shards sit "
                    "beside the index"
                )
            if Path(name).suffix in PICKLE_SUFFIXES:
                raise ValueError(refuse_pickle_message(directory / name))
            if not os.path.lexists(directory / name):
                raise FileNotFoundError(f"{index_path} lists shard {name!r}, which is not in {directory}")
    elif os.path.lexists(directory / SINGLE_NAME):
        names = [SINGLE_NAME]  # as transformers reads it: other *.safetensors beside it are not the checkpoint's
        weight_map = None
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not names:
            pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise ValueError(refuse_pickle_message(directory / pickles[0]))
            ggufs = sorted(p.name for p in directory.iterdir() if p.suffix == ".gguf")
            if ggufs:
                what = f"{directory} holds a GGUF file ({ggufs[0]}) and no *.safetensors file"
                raise ValueError(_GGUF_MESSAGE.format(what=what))
            raise FileNotFoundError(f"{directory}: no *.safetensors file")
        weight_map = None
    files = [SafetensorsFile(directory / name) for name in names]
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for key in f.keys():
            if key in where:
                raise ValueError(f"tensor {key!r} is stored twice: in {where[key].path.name} and {f.path.name}")
            where[key] = f
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in where or where[key].path.name != name:
                raise ValueError(f"{index_path}: tensor {key!r} is mapped to {name}, which does not hold it")
    quanto_map = quanto_map_name = None
    for name in QUANTO_QMAP_NAMES:
        if os.path.lexists(directory / name):
            quanto_map, quanto_map_name = read_json_file(directory / name, "optimum-quanto map"), name
            check_quanto_map(quanto_map, directory / name)
            break
    return Checkpoint(directory, config, files, where, quanto_map, quanto_map_name)


# ---------------------------------------------------------------- helpers


def _scale_shape(
    checkpoint: Checkpoint,
    module: str,
    scale_name: str,
    scheme: QuantizationScheme,
    weight_name: str = "",
    as_channel: bool = False,
) -> tuple[tuple[int, ...], QuantizationScheme]:
    """Checks a stored weight scale against the weight and scheme; returns its canonical shape. ``as_channel``: a
    per-tensor scale may be stored as a channel scale (qfp8_tensor_weight_groups)."""
    weight = checkpoint.info(weight_name or module + ".weight")
    scale = checkpoint.info(scale_name)
    n, k = weight.shape if len(weight.shape) == 2 else (None, None)
    where = f"{checkpoint.where[scale_name].path.name}: {scale_name}"
    if n is None:
        raise ValueError(f"{where}: its weight {module}.weight has shape {list(weight.shape)}, expected 2-D [N, K]")
    numel = 1
    for size in scale.shape:
        numel *= size
    if scheme.weight_scale == "block":
        expected = formats.block_scale_shape((n, k), scheme.block_size)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{where} has shape {list(scale.shape)}; weight [{n}, {k}] with blocks {list(scheme.block_size)} "
                f"needs {list(expected)}"
            )
        return expected, scheme
    if numel == 1 and scheme.weight_scale == "tensor":
        return (1,), scheme
    if numel == n and (scheme.weight_scale == "channel" or as_channel) and len(scale.shape) <= 2:
        return (n, 1), scheme
    raise ValueError(
        f"{where} has shape {list(scale.shape)}: not a {scheme.weight_scale} scale for weight [{n}, {k}] "
        f"(expected {'[1]' if scheme.weight_scale == 'tensor' else [n, 1]})"
    )


def _check_weight(checkpoint: Checkpoint, module: str, weight_name: str) -> torch.dtype:
    info = checkpoint.info(weight_name)
    if info.dtype not in FP8_WEIGHT_DTYPES:
        raise ValueError(
            f"{checkpoint.where[weight_name].path.name}: {weight_name} is {info.dtype} {list(info.shape)}, "
            f"but the checkpoint quantizes module {module!r}: expected an FP8 weight"
        )
    return info.dtype


def _add_scalar(checkpoint: Checkpoint, plan: CheckpointPlan, stored: str, canonical: str) -> None:
    info = checkpoint.info(stored)
    if len(info.shape) > 1 or (info.shape and info.shape[0] != 1):
        raise ValueError(
            f"{checkpoint.where[stored].path.name}: {stored} has shape {list(info.shape)}, expected one value"
        )
    plan.tensors[canonical] = checkpoint.stored(stored, (1,))


def _module_of(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name


def _add_kv_scale(checkpoint: Checkpoint, plan: CheckpointPlan, key: str) -> bool:
    """Maps the KV-cache scale spellings onto ``<attention>.k_scale`` / ``.v_scale``."""
    for old, new in ((".k_proj.output_scale", ["k_scale"]), (".v_proj.output_scale", ["v_scale"])):
        if key.endswith(old):
            attention = key[: -len(old)]
            for target in new:
                _add_scalar(checkpoint, plan, key, f"{attention}.{target}")
            return True
    if key.endswith(".kv_scale"):  # older vLLM/AutoFP8: one scale for both
        attention = _module_of(key, ".kv_scale")
        _add_scalar(checkpoint, plan, key, attention + ".k_scale")
        _add_scalar(checkpoint, plan, key, attention + ".v_scale")
        return True
    if key.endswith((".k_scale", ".v_scale")):
        _add_scalar(checkpoint, plan, key, key)
        return True
    return False


def _add_float(checkpoint: Checkpoint, plan: CheckpointPlan, key: str) -> None:
    info = checkpoint.info(key)
    if info.dtype in FP8_WEIGHT_DTYPES and plan.format == "float":
        why = "config.json has no quantization_config" if plan.config else "the folder has no config.json"
        raise ValueError(
            f"{checkpoint.where[key].path.name}: {key} is a {info.dtype} {list(info.shape)} weight, but {why}: "
            "qfp8 cannot tell how it is quantized (restore the config.json written with the checkpoint)"
        )
    if info.dtype in FP8_WEIGHT_DTYPES:
        module = _module_of(key, ".weight")
        raise ValueError(
            f"{checkpoint.where[key].path.name}: {key} is a {info.dtype} {list(info.shape)} weight with no scale "
            f"(missing {module}.weight_scale)"
        )
    plan.tensors[key] = checkpoint.stored(key)


# ---------------------------------------------------------------- formats


def _read_compressed_tensors(checkpoint: Checkpoint, plan: CheckpointPlan) -> None:
    qc = checkpoint.quantization_config
    groups = qc.get("config_groups") or {}
    ignore = qc.get("ignore") or []
    where = str(checkpoint.directory / "config.json")
    token_mse = qconfig.token_mse_groups(qc, where)
    tensor_weights = qconfig.tensor_weight_groups(qc, where)
    modules = [_module_of(key, ".weight_scale") for key in checkpoint.where if key.endswith(".weight_scale")]
    for module in modules:
        if any(qconfig.matches(module, "Linear", target) for target in ignore):
            raise ValueError(f"{where}: module {module!r} is in 'ignore' but the checkpoint holds its weight_scale")
        group_name = qconfig.matching_group(module, "Linear", groups)
        if group_name is None:
            raise ValueError(f"{where}: module {module!r} has a weight_scale but matches no config_group's targets")
        if module + ".weight" not in checkpoint.where:
            raise ValueError(f"{checkpoint.where[module + '.weight_scale'].path.name}: {module}.weight is missing")
        group_format = groups[group_name].get("format") or qc.get("format")
        if group_format not in qconfig.STORED_FP8_FORMATS:
            raise ValueError(
                f"{where}: config_groups.{group_name} (module {module!r}) has format {group_format!r}; qfp8 reads "
                f"{' and '.join(map(repr, qconfig.STORED_FP8_FORMATS))} FP8 weights"
            )
        dtype = _check_weight(checkpoint, module, module + ".weight")
        as_channel = group_name in tensor_weights
        scheme = qconfig.group_to_scheme(
            groups[group_name], f"{where}: config_groups.{group_name}", dtype, group_name in token_mse, as_channel
        )
        shape, scheme = _scale_shape(checkpoint, module, module + ".weight_scale", scheme, as_channel=as_channel)
        plan.schemes[module] = scheme
        plan.tensors[module + ".weight"] = checkpoint.stored(module + ".weight")
        collapse = as_channel and shape != (1,)
        plan.tensors[module + ".weight_scale"] = checkpoint.stored(
            module + ".weight_scale", (1,) if collapse else shape, collapse
        )
        if scheme.activations == "static":
            if module + ".input_scale" not in checkpoint.where:
                raise ValueError(f"{where}: module {module!r} has static input activations but no input_scale")
            _add_scalar(checkpoint, plan, module + ".input_scale", module + ".input_scale")
    plan.kv_cache_dtype = qconfig.kv_cache_dtype(qc, where)
    check_unused_input_scales(plan, checkpoint.where, where)
    for key in checkpoint.where:
        if key in plan.tensors or key.endswith(("_zero_point", ".input_scale")) and _module_of_any(key) in plan.schemes:
            continue
        if _add_kv_scale(checkpoint, plan, key):
            continue
        _add_float(checkpoint, plan, key)


def _module_of_any(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _read_fp8(checkpoint: Checkpoint, plan: CheckpointPlan) -> None:
    qc = checkpoint.quantization_config
    where = str(checkpoint.directory / "config.json")
    block = qc.get("weight_block_size")
    activation_scheme = qc.get("activation_scheme", "dynamic")
    if activation_scheme not in ("static", "dynamic"):
        raise ValueError(f"{where}: unknown activation_scheme {activation_scheme!r}; expected 'static' or 'dynamic'")
    if block:
        try:
            block = formats._check_block_size(tuple(block) if isinstance(block, (list, tuple)) else block)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: weight_block_size must be two positive ints [block_n, block_k], got {block!r}"
            ) from None
        if activation_scheme == "static":
            raise ValueError(
                f"{where}: weight_block_size with activation_scheme 'static' is not a scheme qfp8 (or vLLM) runs: "
                "block-scaled FP8 checkpoints quantize activations dynamically in 1 x 128 groups"
            )
        if block[0] != formats.ACTIVATION_GROUP_SIZE:
            warnings.warn(
                f"{where}: weight_block_size {list(block)}: vLLM quantizes this checkpoint's activations in "
                f"1 x {block[0]} groups (block_n), qfp8 in 1 x {formats.ACTIVATION_GROUP_SIZE} groups: the outputs "
                "differ by that rounding (the weights are read exactly)",
                UserWarning,
                stacklevel=4,
            )
    elif any(key.endswith(".weight_scale_inv") for key in checkpoint.where):
        raise ValueError(
            f"{where}: the checkpoint holds block-wise weight_scale_inv tensors but its quantization_config has no "
            "weight_block_size"
        )
    scale_suffix = ".weight_scale_inv" if block else ".weight_scale"
    for key in list(checkpoint.where):
        if not key.endswith(scale_suffix):
            continue
        module = _module_of(key, scale_suffix)
        if module + ".weight" not in checkpoint.where:
            raise ValueError(f"{checkpoint.where[key].path.name}: {module}.weight is missing (its {key} is present)")
        dtype = _check_weight(checkpoint, module, module + ".weight")
        if block:
            scheme = QuantizationScheme(dtype, "block", block, "dynamic", "group")
        else:
            info = checkpoint.info(key)
            granularity = "tensor" if len(info.shape) == 0 or info.shape == (1,) else "channel"
            if activation_scheme == "static":
                scheme = QuantizationScheme(dtype, granularity, (), "static", "tensor")
            else:
                scheme = QuantizationScheme(dtype, granularity, (), "dynamic", "tensor")
        shape, scheme = _scale_shape(checkpoint, module, key, scheme)
        plan.schemes[module] = scheme
        plan.tensors[module + ".weight"] = checkpoint.stored(module + ".weight")
        plan.tensors[module + ".weight_scale"] = checkpoint.stored(key, shape)
        if scheme.activations == "static":
            if module + ".input_scale" not in checkpoint.where:
                raise ValueError(f"{where}: activation_scheme is 'static' but {module}.input_scale is missing")
            _add_scalar(checkpoint, plan, module + ".input_scale", module + ".input_scale")
    done = {stored.name for stored in plan.tensors.values()}
    for key in checkpoint.where:
        if key in done or key.endswith(".input_scale") and _module_of_any(key) in plan.schemes:
            continue
        if _add_kv_scale(checkpoint, plan, key):
            plan.kv_cache_dtype = torch.float8_e4m3fn
            continue
        _add_float(checkpoint, plan, key)
    if qc.get("kv_cache_scheme") == "static":  # AutoFP8's word for static per-tensor scales (output_scale above)
        plan.kv_cache_dtype = torch.float8_e4m3fn
    elif qc.get("kv_cache_scheme"):
        plan.kv_cache_dtype = qconfig.kv_cache_dtype(qc, where)


QUANTO_WEIGHT_TYPES = {
    "qfloat8": torch.float8_e4m3fn,
    "qfloat8_e4m3fn": torch.float8_e4m3fn,
    "qfloat8_e5m2": torch.float8_e5m2,
    "qfloat8_e4m3fnuz": torch.float8_e4m3fnuz,
}


def _read_quanto(checkpoint: Checkpoint, plan: CheckpointPlan) -> None:
    where = str(checkpoint.directory / checkpoint.quanto_map_name)
    for module, entry in checkpoint.quanto_map.items():
        weights, activations = entry.get("weights"), entry.get("activations", "none")
        if weights not in QUANTO_WEIGHT_TYPES:
            raise ValueError(
                f"{where}: module {module!r} has quanto weights {weights!r}; qfp8 reads FP8 ones "
                f"({sorted(QUANTO_WEIGHT_TYPES)})"
            )
        if activations not in ("none", None, "qfloat8", "qfloat8_e4m3fn"):
            raise ValueError(f"{where}: module {module!r} has activations {activations!r}; qfp8 takes e4m3 or none")
        data, scale = module + ".weight._data", module + ".weight._scale"
        for key in (data, scale):
            if key not in checkpoint.where:
                raise ValueError(f"{where} quantizes module {module!r} but the checkpoint has no {key}")
        info = checkpoint.info(data)
        if info.dtype != QUANTO_WEIGHT_TYPES[weights]:
            raise ValueError(f"{checkpoint.where[data].path.name}: {data} is {info.dtype}, {where} says {weights}")
        numel = 1
        for size in checkpoint.info(scale).shape:
            numel *= size
        static = activations not in ("none", None)
        scheme = QuantizationScheme(
            info.dtype, "tensor" if numel == 1 else "channel", (), "static" if static else None,
            "tensor" if static else "token",
        )  # fmt: skip
        plan.schemes[module] = scheme
        plan.tensors[module + ".weight"] = checkpoint.stored(data)
        shape, _ = _scale_shape(checkpoint, module, scale, scheme, data)
        plan.tensors[module + ".weight_scale"] = checkpoint.stored(scale, shape)
        if static:
            if module + ".input_scale" not in checkpoint.where:
                raise ValueError(f"{where}: module {module!r} has activations {activations!r} but no input_scale")
            _add_scalar(checkpoint, plan, module + ".input_scale", module + ".input_scale")
    for key in checkpoint.where:
        module = _module_of_any(_module_of(_module_of(key, "._data"), "._scale"))
        if module in plan.schemes and key.endswith((".input_scale", ".output_scale", "._data", "._scale")):
            continue  # quanto keeps input/output scales on every module; qfp8 uses the static input ones
        _add_float(checkpoint, plan, key)


def _read_float(checkpoint: Checkpoint, plan: CheckpointPlan) -> None:
    for key in checkpoint.where:
        _add_float(checkpoint, plan, key)


def _check_plan(checkpoint: Checkpoint, plan: CheckpointPlan) -> None:
    check_scale_bounds(plan)
    if checkpoint.quantization_config:
        check_kv_dtype_key(checkpoint.quantization_config, plan, checkpoint.directory / "config.json")
    for key in [key for key in plan.tensors if key.endswith(IGNORED_SUFFIXES)]:
        del plan.tensors[key]
