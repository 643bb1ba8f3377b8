"""``qfp8 inspect PATH``: what a checkpoint holds, read from headers (and the small scale tensors) only."""

from __future__ import annotations

import argparse
import json
import re

import torch

from qfp8.checkpoint import compat, reader_rules
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.readers import open_checkpoint

__all__ = [
    "add_arguments",
    "describe",
    "format_description",
    "run",
    "vllm_notes",
]


def _group_name(module: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", module)


def _layers(plan) -> dict:
    """Each linear layer's scheme (None: float) and weight shape, as the vLLM and transformers rules take them."""
    layers = {}
    for name, stored in plan.tensors.items():
        module, _, leaf = name.rpartition(".")
        shape = tuple(stored.file.info(stored.name).shape)
        if leaf == "weight" and len(shape) == 2:
            layers[module] = (plan.schemes.get(module), shape)
    return layers


def vllm_notes(plan) -> list[str]:
    """What vLLM makes of a compressed-tensors or qfp8 checkpoint: refused, the rules it breaks, or nothing."""
    if plan.format == qconfig.QFP8_METHOD:
        reasons = qconfig.qfp8_only_reasons(plan.schemes, plan.kv_cache_dtype)
        return [
            f"qfp8_method 'qfp8', no quant_method ({' and '.join(reasons) or 'so marked'}): vLLM and transformers "
            "refuse it (qfp8 only)"
        ]
    if plan.format != "compressed-tensors":
        return []
    return reader_rules.vllm_incompatibilities(_layers(plan))


def serves_on(plan) -> dict[str, str]:
    """Engine -> "yes", "no" or "only on CPUs with ..." (qfp8.checkpoint.compat); {} for other formats."""
    if plan.format not in ("compressed-tensors", qconfig.QFP8_METHOD):
        return {}
    return compat.serves_on(
        _layers(plan), qfp8_only=plan.format == qconfig.QFP8_METHOD, fp8_kv_cache=plan.kv_cache_dtype is not None
    )


def describe(path) -> dict:
    """A JSON-able description: format, files, scheme per module group, sizes, KV-cache scales."""
    checkpoint = open_checkpoint(path)
    plan = checkpoint.plan()
    groups: dict[tuple[str, str], int] = {}
    for module, scheme in plan.schemes.items():
        key = (_group_name(module), scheme.describe())
        groups[key] = groups.get(key, 0) + 1
    quantized_bytes = float_bytes = 0
    for name, stored in plan.tensors.items():
        info = stored.file.info(stored.name)
        module = name.rsplit(".", 1)[0]
        if module in plan.schemes:
            quantized_bytes += info.nbytes
        else:
            float_bytes += info.nbytes
    kv = {}
    for suffix in ("k_scale", "v_scale"):
        values = [plan.load(name).item() for name in plan.tensors if name.endswith("." + suffix)]
        if values:
            kv[suffix] = {"count": len(values), "min": min(values), "max": max(values)}
    float_dtypes = sorted(
        {str(stored.file.info(stored.name).dtype).replace("torch.", "") for name, stored in plan.tensors.items()
         if name.rsplit(".", 1)[0] not in plan.schemes and name.endswith(".weight")}
    )  # fmt: skip
    return {
        "path": str(checkpoint.directory),
        "format": plan.format,
        "files": [f.path.name for f in checkpoint.files],
        "file_bytes": sum(f.size for f in checkpoint.files),
        "tensors": len(plan.tensors),
        "quantized_modules": len(plan.schemes),
        "groups": [{"modules": g, "scheme": s, "count": c} for (g, s), c in groups.items()],
        "quantized_bytes": quantized_bytes,
        "float_bytes": float_bytes,
        "float_weight_dtypes": float_dtypes,
        "kv_cache": {"dtype": str(plan.kv_cache_dtype).replace("torch.", "") if plan.kv_cache_dtype else None, **kv},
        "architecture": (checkpoint.config.get("architectures") or [None])[0],
        "tied_embeddings": checkpoint.config.get(qconfig.TIED_EMBEDDINGS_KEY) or {},
        "vllm": vllm_notes(plan),
        "vllm_cpu": compat.vllm_cpu_problems(_layers(plan)) if plan.format == "compressed-tensors" else [],
        "serves_on": serves_on(plan),
    }


def format_description(info: dict) -> str:
    lines = [
        f"{info['path']}",
        f"  format: {info['format']}   architecture: {info['architecture']}",
        f"  files: {len(info['files'])} ({info['file_bytes'] / 1e6:.1f} MB), tensors: {info['tensors']}",
        f"  quantized: {info['quantized_modules']} modules, {info['quantized_bytes'] / 1e6:.1f} MB; "
        f"float: {info['float_bytes'] / 1e6:.1f} MB ({', '.join(info['float_weight_dtypes']) or '-'})",
    ]
    width = max([len(g["modules"]) for g in info["groups"]] + [7])
    if info["groups"]:
        lines.append(f"  {'modules'.ljust(width)}  count  scheme")
        for g in info["groups"]:
            lines.append(f"  {g['modules'].ljust(width)}  {g['count']:5d}  {g['scheme']}")
    kv = info["kv_cache"]
    if kv["dtype"]:
        parts = [f"{k}: {v['count']} in [{v['min']:.4g}, {v['max']:.4g}]" for k, v in kv.items() if k != "dtype"]
        lines.append(f"  kv cache: {kv['dtype']}" + (f"  ({'; '.join(parts)})" if parts else ""))
    else:
        lines.append("  kv cache: not quantized")
    for embedding, head in info.get("tied_embeddings", {}).items():
        lines.append(
            f"  tied: {embedding} holds {head}'s FP8 weight dequantized; qfp8.from_pretrained reads its rows from "
            f"{head} (one FP8 table)"
        )
    if info.get("serves_on"):
        lines.append("  serves on: " + ", ".join(f"{engine} {answer}" for engine, answer in info["serves_on"].items()))
    for note in info.get("vllm", []):
        lines.append(f"  vLLM: {note}")
    for note in info.get("vllm_cpu", []):
        lines.append(f"  vLLM CPU: {note}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint folder or Hub repo id")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    with torch.no_grad():
        info = describe(args.path)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0
