"""``save_pretrained``: a quantized model to a compressed-tensors ``float-quantized`` folder.

The folder holds ``config.json`` (the model's config plus
``quantization_config``), ``model.safetensors`` or shards with
``model.safetensors.index.json``, and the tokenizer and generation files
when the model came from a folder that has them (or ``tokenizer=`` is given).

Tensors are written one at a time: a QLinear's canonical FP8 ``[N, K]``
weight is unpacked from its kernel layout only when its turn comes. Every
file goes to a staging folder beside the destination, swapped in as one step
under a lock (:mod:`qfp8.checkpoint.atomic`): a reader finds the old
checkpoint or the new one, whole, whenever the writer stops.

Tied parameters (an ``lm_head`` sharing the embedding) are written once,
under their first name, as transformers does; loading ties them again.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qfp8 import formats
from qfp8.checkpoint import compat
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.atomic import FolderCommit, previous_checkpoint_files
from qfp8.checkpoint.naming import KV_ROUNDING_FILE, CheckpointNames, split_rows
from qfp8.checkpoint.safetensors_io import PlannedTensor, write_safetensors
from qfp8.checkpoint.tensor_scales import expand_rows
from qfp8.library import memory
from qfp8.nn import QLinear
from qfp8.nn.conv import QConvNd
from qfp8.nn.embedding import QEmbedding
from qfp8.nn.experts import QExperts, find_fused_experts
from qfp8.quantize import check_calibrated, unwrapped

__all__ = [
    "CARRIED_FILES",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "SINGLE_NAME",
    "add_transformers4_keys",
    "carried_files",
    "check_output_directory",
    "kv_rounding_file",
    "model_config_dict",
    "converted_layers",
    "model_layers",
    "model_quantization_config",
    "parse_size",
    "plan_model_tensors",
    "previous_checkpoint_files",
    "save_pretrained",
    "tied_embeddings",
    "write_checkpoint",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files carried from the source folder into a saved checkpoint.
CARRIED_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|chat_template\..*|"
    r"generation_config\.json|preprocessor_config\.json)$"
)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MiB"`` / an int -> bytes."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or (match.group(2).upper() or "B") not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive size like '5GB' or an int of bytes, got {size!r}")
    if not match.group(2) and float(match.group(1)) < 2**20:
        # "50" on a command line: 50 bytes would write a shard per tensor; the user meant a unit.
        raise ValueError(
            f"max_shard_size {size!r} without a unit is {match.group(1)} bytes; give a unit, like '{match.group(1)}GB'"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper() or "B"])


def _tensor_plan(name: str, tensor: torch.Tensor) -> PlannedTensor:
    return PlannedTensor(name, tensor.dtype, tuple(tensor.shape), lambda: tensor.detach())


def _expert_scale_rows(scale: torch.Tensor, scheme, rows: slice) -> torch.Tensor:
    """The part of one expert's ``weight_scale`` that belongs to its weight rows ``rows``."""
    if scheme.weight_scale == "tensor":
        return scale
    if scheme.weight_scale == "channel":
        return scale[rows]
    block = scheme.block_size[0]  # quantize keeps the parts' boundaries on block rows
    return scale[rows.start // block : -(-rows.stop // block)]


def _plan_experts(module: QExperts, fused: str, names: CheckpointNames) -> list[PlannedTensor]:
    """A QExperts' tensors under transformers' per-expert checkpoint names (ValueError if it has none)."""
    modules = names.expert_modules(fused, module.num_experts)
    assert modules is not None, fused  # plan_model_tensors refuses the others first
    # An expert's parts are written one after another: its weight is unpacked once for all of them (again
    # only if the writer takes them apart), and let go with its last part.
    unpacked: dict[QLinear, torch.Tensor] = {}

    def rows_of(expert: QLinear, rows: slice) -> torch.Tensor:
        if expert not in unpacked:
            unpacked.clear()
            unpacked[expert] = expert.canonical_weight()
        part = unpacked[expert][rows]
        if rows.stop == module.out_features:
            unpacked.clear()
        return part

    plan = []
    for expert, parts in zip(module.experts, modules, strict=True):
        for rows, name in zip(split_rows(module.out_features, len(parts), fused), parts, strict=True):
            plan.append(
                PlannedTensor(
                    name + ".weight",
                    module.scheme.weight_dtype,
                    (rows.stop - rows.start, module.in_features),
                    lambda expert=expert, rows=rows: rows_of(expert, rows),
                )
            )
            scale = _expert_scale_rows(expert.weight_scale, module.scheme, rows)
            plan.append(_tensor_plan(name + ".weight_scale", scale))
            if expert.input_scale is not None:  # each part reads the expert's input: the same scale
                plan.append(_tensor_plan(name + ".input_scale", expert.input_scale))
    return plan


def _plan_float_experts(tensor: torch.Tensor, fused: str, names: CheckpointNames) -> list[PlannedTensor] | None:
    """A float fused experts parameter under the per-expert checkpoint names (None: it has none)."""
    modules = names.expert_modules(fused, tensor.shape[0])
    if modules is None:
        return None
    return [
        _tensor_plan(name + ".weight", tensor[e, rows])
        for e, parts in enumerate(modules)
        for rows, name in zip(split_rows(tensor.shape[1], len(parts), fused), parts, strict=True)
    ]


def _check_experts_have_checkpoint_names(model: nn.Module, names: CheckpointNames) -> None:
    """ValueError naming the FP8 experts that transformers stores as one 3-D tensor (GraniteMoE's
    ``input_linear.weight``), not per expert: FP8 checkpoints hold 2-D weights, and neither qfp8's reader
    nor vLLM would take them stacked."""
    stacked = [
        name
        for name, module in model.named_modules()
        if isinstance(module, QExperts) and names.expert_modules(name, module.num_experts) is None
    ]
    if stacked:
        patterns = sorted({"*experts." + name.rsplit(".", 1)[-1] for name in stacked})
        raise ValueError(
            f"save_pretrained: transformers stores the experts of {stacked[0]}"
            + (f" (and {len(stacked) - 1} more)" if len(stacked) > 1 else "")
            + f" as one 3-D tensor ({names.to_checkpoint(stacked[0])}), not per expert; an FP8 checkpoint holds "
            f"2-D weights, so qfp8 cannot write them. To save this model, quantize it with "
            f"exclude=['lm_head', {', '.join(repr(p) for p in patterns)}] (those experts stay float)"
        )


def channel_written_schemes(model: nn.Module) -> set:
    """The per-tensor schemes of ``model`` that the checkpoint holds as channel scales (qconfig.channel_written)."""
    return qconfig.channel_written(
        {name: scheme for name, (scheme, _) in model_layers(model).items() if scheme is not None}
    )


def _scale_plan(name: str, module: QLinear, as_channel: bool) -> PlannedTensor:
    if not as_channel:
        return _tensor_plan(name, module.weight_scale)
    rows = module.out_features
    return PlannedTensor(name, torch.float32, (rows, 1), lambda: expand_rows(module.weight_scale, rows))


def plan_model_tensors(model: nn.Module) -> list[PlannedTensor]:
    """What ``model.state_dict()`` holds, as lazy entries (no weight unpacked yet), tied tensors once,
    under the names transformers writes (see qfp8/checkpoint/naming.py); per-tensor weight scales as channel
    scales where the config says so (:func:`channel_written_schemes`)."""
    names = CheckpointNames(model)
    channel_schemes = channel_written_schemes(model)
    _check_experts_have_checkpoint_names(model, names)
    fused_float = {id(item.module._parameters[item.attr]) for item in find_fused_experts(model)}
    plan: list[PlannedTensor] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(module, QExperts):
            plan += _plan_experts(module, module_name, names)
            continue
        if isinstance(module, QEmbedding):  # the tied head's dequantized rows, as a float table
            shape = (module.num_embeddings, module.embedding_dim)
            plan.append(
                PlannedTensor(names.to_checkpoint(prefix + "weight"), module.dtype_of_rows.dtype, shape, module.table)
            )
            continue
        if isinstance(module, QLinear):
            plan.append(
                PlannedTensor(
                    names.to_checkpoint(prefix + "weight"),
                    module.scheme.weight_dtype,
                    (module.out_features, module.in_features),
                    module.stored_weight if isinstance(module, QConvNd) else module.canonical_weight,
                )
            )
            plan.append(
                _scale_plan(names.to_checkpoint(prefix + "weight_scale"), module, module.scheme in channel_schemes)
            )
            extra = {"input_scale": module.input_scale, "bias": module.bias}
            plan += [
                _tensor_plan(names.to_checkpoint(prefix + key), value)
                for key, value in extra.items()
                if value is not None
            ]
            continue
        tensors = list(module.named_parameters(recurse=False)) + [
            (key, buffer)
            for key, buffer in module.named_buffers(recurse=False)
            if key not in module._non_persistent_buffers_set
        ]
        for key, tensor in tensors:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if tensor.device.type == "meta":
                raise ValueError(
                    f"save_pretrained: {prefix + key} {list(tensor.shape)} is on the meta device (never loaded)"
                )
            split = _plan_float_experts(tensor, prefix + key, names) if id(tensor) in fused_float else None
            plan += split if split is not None else [_tensor_plan(names.to_checkpoint(prefix + key), tensor)]
    return plan


def model_layers(model: nn.Module, model_names: dict[str, str] | None = None) -> dict[str, qconfig.Layer]:
    """Each linear layer of ``model`` under its checkpoint name (a module shared under two names: the first):
    its scheme (None for a float ``nn.Linear``) and weight shape [N, K]. Fused MoE experts count as one layer
    per expert and part (``experts.<e>.w1``...), as checkpoints store them.

    ``model_names``, when given, receives checkpoint name -> module name for each Linear whose two names differ
    (see qconfig.build_quantization_config); expert parts are no modules (their experts are fused)."""
    names = CheckpointNames(model)
    layers: dict[str, qconfig.Layer] = {}
    seen: set[int] = set()

    def add_experts(fused: str, scheme, count: int, out_features: int, in_features: int) -> None:
        modules = names.expert_modules(fused, count)
        if modules is None:  # stored stacked under the model's name
            layers[names.to_checkpoint(fused)] = (scheme, (out_features, in_features))
            return
        for parts in modules:
            for name in parts:
                layers[name] = (scheme, (out_features // len(parts), in_features))

    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, QExperts):
            add_experts(name, module.scheme, module.num_experts, module.out_features, module.in_features)
        elif isinstance(module, (QLinear, nn.Linear)):
            stored = names.to_checkpoint(name)
            scheme = module.scheme if isinstance(module, QLinear) else None
            layers[stored] = (scheme, (module.out_features, module.in_features))
            if model_names is not None and stored != name:
                model_names[stored] = name
    for item in find_fused_experts(model):  # experts left in float
        count, out_features, in_features = item.module._parameters[item.attr].shape
        add_experts(item.name, None, count, out_features, in_features)
    return layers


def converted_layers(model: nn.Module) -> dict[str, str]:
    """Each QLinear of ``model`` that stands for a layer of another class (GPT-2's Conv1D), under its checkpoint
    name: that class's name."""
    names = CheckpointNames(model)
    return {
        names.to_checkpoint(name): module.converted_from
        for name, module in model.named_modules()
        if isinstance(module, QLinear) and module.converted_from
    }


def model_quantization_config(
    model: nn.Module, layers: dict[str, qconfig.Layer] | None = None, model_names: dict[str, str] | None = None
) -> dict:
    """The compressed-tensors ``quantization_config`` describing ``model``'s QLinears (``layers`` and
    ``model_names``: what :func:`model_layers` gave, when the caller has them already).

    What compressed-tensors cannot represent is marked ``qfp8_method: "qfp8"`` instead (see qfp8/checkpoint/config.py).
    """
    if layers is None:
        model_names = {}
        layers = model_layers(model, model_names)
    schemes = {name: scheme for name, (scheme, _) in layers.items() if scheme is not None}
    ignored = [name for name, (scheme, _) in layers.items() if scheme is None]
    if not schemes:
        raise ValueError("save_pretrained: the model has no QLinear; call qfp8.quantize(model, ...) first")
    kv_dtype = getattr(model, "qfp8_kv_cache_dtype", None)
    return qconfig.build_quantization_config(
        schemes, ignored, kv_dtype, kv_dtype is not None and not _kv_scales(model), model_names
    )


def _kv_scales(model: nn.Module) -> bool:
    """Whether any attention layer of ``model`` has a calibrated ``k_scale`` or ``v_scale`` to write."""
    return any(
        getattr(module, "k_scale", None) is not None or getattr(module, "v_scale", None) is not None
        for module in model.modules()
        if hasattr(module, "qfp8_kv_dtype")
    )


def kv_rounding_file(tensors: dict[str, torch.Tensor], scratch: str | os.PathLike) -> dict[str, Path]:
    """Writes the FP8 KV cache's query moments ``tensors`` to ``KV_ROUNDING_FILE`` in ``scratch``; returns
    ``{name: path}`` for :func:`write_checkpoint`'s extra files (empty when there are none)."""
    if not tensors:
        return {}
    path = Path(scratch, KV_ROUNDING_FILE)
    write_safetensors(path, [_tensor_plan(name, tensor) for name, tensor in tensors.items()], {"format": "pt"})
    return {KV_ROUNDING_FILE: path}


def _shards(plan: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def write_checkpoint(
    directory: str | os.PathLike,
    plan: list[PlannedTensor],
    config: dict,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    extra_files: dict[str, Path] | None = None,
    on_tensor: Callable[[PlannedTensor], None] | None = None,
) -> list[str]:
    """Writes ``plan`` in shards, ``config.json`` and ``extra_files`` atomically; returns the shard names."""
    max_bytes = parse_size(max_shard_size)
    names = [entry.name for entry in plan]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"write_checkpoint: tensor names written twice: {duplicates[:5]}")
    shards = _shards(plan, max_bytes)
    if len(shards) == 1:
        shard_names = [SINGLE_NAME]
    else:
        shard_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    directory = check_output_directory(directory, "write_checkpoint")
    # A folder where a file goes cannot be replaced: said before anything is written, so that no shard is
    # moved in before config.json (a folder) would fail.
    targets = [*shard_names, *(extra_files or {}), "config.json", *([INDEX_NAME] if len(shards) > 1 else [])]
    for name in targets:
        path = directory / name
        if path.exists() and not path.is_file():
            raise ValueError(
                f"write_checkpoint: {path} is a folder (or another non-file), where the checkpoint writes its "
                f"{name}; remove it or give another folder. Nothing was written"
            )
    with FolderCommit(directory) as out:
        old = previous_checkpoint_files(directory)
        for shard_name, shard in zip(shard_names, shards, strict=True):
            if on_tensor is not None:
                shard = [_with_callback(entry, on_tensor) for entry in shard]
            write_safetensors(out.path_for(shard_name), shard, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(entry.nbytes for entry in plan)},
                "weight_map": {
                    entry.name: name for name, shard in zip(shard_names, shards, strict=True) for entry in shard
                },
            }
            out.write_text(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, out.path_for(name))
        out.write_text("config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        out.commit(replaced=old)
    return shard_names


def check_output_directory(directory: str | os.PathLike, caller: str) -> Path:
    """``directory`` as a Path, checked before anything (or long work whose result goes there) is written.

    A ValueError naming it if it, or the first existing path above it (where
    it would be created), is a file or a dangling symbolic link, or if no file
    can be created there. Leaves nothing behind.
    """
    directory = Path(directory)
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p.is_symlink())
    if not existing.exists():
        raise ValueError(
            f"{caller} {directory}: {existing} is a symbolic link to {os.readlink(existing)}, which does not exist"
        )
    if not existing.is_dir():
        where = "" if existing == directory else f" (in {directory})"
        raise ValueError(f"{caller}: {existing} is a file, not a folder{where}; give a folder for the checkpoint")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qfp8-write-check.", dir=existing))
    except OSError as error:
        where = "" if existing == directory else f" (it would be created in {existing})"
        raise ValueError(f"{caller} {directory}: cannot write there{where}: {error.strerror or error}") from None
    return directory


def _with_callback(entry: PlannedTensor, callback) -> PlannedTensor:
    def produce():
        value = entry.produce()
        callback(entry)
        return value

    return PlannedTensor(entry.name, entry.dtype, entry.shape, produce)


def carried_files(source: str | os.PathLike | None) -> dict[str, Path]:
    """Tokenizer and generation files of a source folder, by name."""
    if not source or not Path(source).is_dir():
        return {}
    return {p.name: p for p in sorted(Path(source).iterdir()) if p.is_file() and CARRIED_FILES.match(p.name)}


def model_config_dict(model: nn.Module) -> dict:
    """``model.config`` as config.json holds it, with the model's class and float dtype, as transformers writes.

    ``architectures`` names the model's class (``from_pretrained`` builds that
    class); ``dtype`` is the dtype of its float tensors (embedding, norms), which
    a model built from a config and then cast does not record itself.
    """
    from qfp8.checkpoint.diffusers import model_config_dict as diffusers_config  # imports the loader

    if (as_dict := diffusers_config(model)) is not None:
        return as_dict
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    as_dict = config.to_dict()
    as_dict.pop("quantization_config", None)
    if as_dict.get("model_type"):
        as_dict["architectures"] = [type(model).__name__]
    float_dtype = next(
        (
            t.dtype
            for t in model.parameters()  # not buffers: a QLinear's scales are float32 whatever the model's dtype
            if t.is_floating_point() and t.dtype not in formats.FP8_DTYPES.values()
        ),
        None,
    )
    if float_dtype is not None:
        as_dict["dtype"] = str(float_dtype).removeprefix("torch.")
    if as_dict.get("tie_word_embeddings") and not _output_embeddings_tied(model):
        # The lm_head was given its own weight (to quantize it): a reader
        # would tie it to the embedding again, or refuse the FP8 head.
        as_dict["tie_word_embeddings"] = False
    as_dict.pop(qconfig.TIED_EMBEDDINGS_KEY, None)  # a config shared with a wrapping model may carry its ties
    tied = tied_embeddings(model)
    if tied:
        as_dict[qconfig.TIED_EMBEDDINGS_KEY] = tied
    add_transformers4_keys(type(config), as_dict)
    return as_dict


def tied_embeddings(model: nn.Module) -> dict[str, str]:
    """``{embedding: head}``, checkpoint module names, for each QEmbedding of ``model`` (an embedding that reads a
    quantized lm_head's rows): config.json records them, so that qfp8's loader ties them again."""
    names = CheckpointNames(model)
    modules = dict(model.named_modules())
    where = {id(module): name for name, module in modules.items()}
    found = {}
    for name, module in modules.items():
        # A head outside the saved module (model.model saved alone): the table is written, as a plain embedding.
        if isinstance(module, QEmbedding) and id(module.head) in where:
            embedding = names.to_checkpoint(name + ".weight").removesuffix(".weight")
            found[embedding] = names.to_checkpoint(where[id(module.head)] + ".weight").removesuffix(".weight")
    return found


def _output_embeddings_tied(model: nn.Module) -> bool:
    """False when the model's output embeddings (a transformers model's lm_head) hold a weight of their own."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return True  # not a transformers model: its config says what it says
    if head is None or embedding is None:
        return True
    return isinstance(head, nn.Linear) and head.weight is embedding.weight


def add_transformers4_keys(config_class: type, as_dict: dict) -> None:
    """Adds the keys transformers 4 reads where transformers 5 writes others, with the same values
    (``config_class``: the transformers config class of ``as_dict``).

    vLLM runs on transformers 4, whose config classes fill a missing key with
    their default: without ``rope_theta`` a Llama-3 checkpoint would run with
    RoPE base 10000 instead of 500000, without ``num_experts`` a Qwen3-MoE one
    with 128 experts. transformers 5 reads these keys as aliases of its own;
    the RoPE keys are added only when transformers 5 reads the file back to
    the same ``rope_parameters`` (some per-layer-type layouts it would not).
    """
    rope = as_dict.get("rope_parameters")
    added: dict = {}
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # one set per layer type (Gemma 3)
        if isinstance(rope.get("sliding_attention"), dict) and "rope_theta" in rope["sliding_attention"]:
            added["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    if isinstance(rope, dict) and "rope_theta" in rope:
        added["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            added["partial_rotary_factor"] = rope["partial_rotary_factor"]
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        added["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    added = {key: value for key, value in added.items() if key not in as_dict}
    if added and _reads_back(config_class, {**as_dict, **added}, "rope_parameters", as_dict.get("rope_parameters")):
        as_dict.update(added)
    for alias, name in getattr(config_class, "attribute_map", {}).items():  # e.g. num_experts -> num_local_experts
        if name in as_dict and alias not in as_dict:
            as_dict[alias] = as_dict[name]


def _reads_back(config_class: type, as_dict: dict, key: str, expected) -> bool:
    """True when ``config_class`` built from ``as_dict`` holds ``expected`` under ``key``."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its checks of the values it is given are not this save's business
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A copy: transformers edits the nested dicts it is given (it puts rope_theta into rope_scaling).
            return config_class.from_dict(copy.deepcopy(as_dict)).to_dict().get(key) == expected
    except Exception:  # noqa: BLE001 (a config the class cannot read back: the keys stay out)
        return False
    finally:
        transformers.logging.set_verbosity(level)


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tokenizer=None,
) -> Path:
    """Saves a quantized model as a compressed-tensors ``float-quantized`` checkpoint (vLLM/transformers load it).

    e5m2 weights or a KV cache that is not e4m3fn are marked ``qfp8_method:
    "qfp8"`` instead of a ``quant_method`` (only qfp8 reads them; vLLM and
    transformers refuse them) with a UserWarning; a checkpoint vLLM would
    refuse or could not run (block weights with static inputs, fused q/k/v or
    gate/up shards quantized differently, W8A8 block shapes its kernels cannot
    take) gets a UserWarning naming the rule: see qfp8/checkpoint/config.py;
    so does one that vLLM's CPU engine cannot run (qfp8/checkpoint/compat.py).

    Tokenizer and generation files come from ``tokenizer`` if given, else from
    the folder the model was loaded from (``config._name_or_path``) when it has them.
    A model ``qfp8.freeze`` would refuse (static scales or an accuracy mode not yet
    calibrated) is refused here too, before anything is written. Of the files
    already in ``directory``, only an older checkpoint's weights and index are replaced.

    A calibrated FP8 KV cache's query second moments (compensated key rounding,
    :mod:`qfp8.nn.kv_cache`) go to ``qfp8_kv_rounding.st``, which
    :func:`qfp8.from_pretrained` reads and other loaders ignore.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained takes an nn.Module, got {type(model).__name__}")
    model = unwrapped(model)
    check_output_directory(directory, "save_pretrained")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"save_pretrained: tokenizer must be a tokenizer or processor (with save_pretrained), got "
            f"{type(tokenizer).__name__}"
        )
    config = model_config_dict(model)
    model_names: dict[str, str] = {}
    layers = model_layers(model, model_names)
    config["quantization_config"] = model_quantization_config(model, layers, model_names)
    # Saved, an uncalibrated static layer would lack its input_scale (the
    # checkpoint could not be loaded) and an accuracy-mode layer would ship
    # its round-to-nearest weights.
    check_calibrated(model, "save_pretrained")
    converted = converted_layers(model)
    for message in compat.save_warnings(layers, getattr(model, "qfp8_kv_cache_dtype", None), converted):
        warnings.warn(message, UserWarning, stacklevel=2)
    if config["quantization_config"]["kv_cache_scheme"] and config["quantization_config"]["kv_cache_scheme"]["dynamic"]:
        warnings.warn(
            "the FP8 KV cache is not calibrated: the checkpoint holds no k_scale/v_scale and its kv_cache_scheme is "
            "written dynamic (qfp8 takes per-head scales from each prompt). vLLM reads static scales only: with "
            "its default --kv-cache-dtype auto, recent vLLM stores K and V in fp8 because of the kv_cache_scheme, "
            "with scale 1.0 in every layer (no k_scale/v_scale loaded); an explicit --kv-cache-dtype overrides "
            "it. Run the model under qfp8.calibrate(model) before saving to write per-layer scales",
            UserWarning,
            stacklevel=2,
        )
    plan = plan_model_tensors(model)
    source = getattr(model, "qfp8_source", None) or config.get("_name_or_path")
    extra = carried_files(source)
    with tempfile.TemporaryDirectory() as scratch:
        if tokenizer is not None:
            tokenizer.save_pretrained(scratch)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and hasattr(generation_config, "to_json_string"):
            Path(scratch, "generation_config.json").write_text(generation_config.to_json_string())
        extra.update(carried_files(scratch))
        rounding = {}
        if getattr(model, "qfp8_kv_cache_dtype", None) is not None:
            from qfp8.nn.kv_cache import k_rounding_state  # imports transformers

            rounding = k_rounding_state(model)
        extra.update(kv_rounding_file(rounding, scratch))
        write_checkpoint(directory, plan, config, max_shard_size, extra)
    memory.return_freed_memory()  # glibc keeps freed heap (a tied table written from the FP8 head: ~200 MB)
    return Path(directory)
