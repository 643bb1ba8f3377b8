"""``qfp8 quantize SRC DST``: quantize a float safetensors checkpoint tensor by tensor.

The model is never built with real weights: its architecture comes from
``config.json`` (built on the ``meta`` device to learn which tensors are
``nn.Linear`` weights), and each source tensor is read on its own with
``pread``, quantized in row chunks and written out. Peak memory is a few
times the largest tensor, not the model.

Each weight is read twice: once for its scale (the per-tensor, per-channel
or per-block amax) and once to quantize it with that scale, because output
shards are written with their header first (scales are small; weights are
not kept). The result is bit-identical to ``qfp8.quantize`` on the loaded
model followed by ``qfp8.save_pretrained``.

Static activation scales and FP8 KV-cache scales need the model run on
calibration data, which this streaming path does not do: quantize those in
memory (``qfp8.quantize`` + ``qfp8.calibrate`` + ``qfp8.save_pretrained``).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from pathlib import Path

import torch

from qfp8 import formats
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.readers import open_checkpoint
from qfp8.checkpoint.safetensors_io import PlannedTensor
from qfp8.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE, carried_files, write_checkpoint
from qfp8.nn.scheme import QuantizationScheme

CHUNK_ROWS = 1024  # rows quantized at once: bounds the float32 temporaries


def _row_step(scheme: QuantizationScheme) -> int:
    if scheme.weight_scale == "block":
        bn = scheme.block_size[0]
        return bn * max(1, CHUNK_ROWS // bn)
    return CHUNK_ROWS


def weight_scale(weight: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """The scale ``qfp8.quantize`` would give ``weight``, computed in row chunks."""
    step = _row_step(scheme)
    pieces = [
        formats.weight_amax(weight[r : r + step], scheme.weight_scale, scheme.block_size or formats.DEFAULT_BLOCK_SIZE)
        for r in range(0, weight.shape[0], step)
    ]
    amax = torch.stack(pieces).amax(0) if scheme.weight_scale == "tensor" else torch.cat(pieces)
    return formats.scale_from_amax(amax, scheme.weight_dtype)


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """``formats.quantize_weight(weight, scale=scale)`` in row chunks (same bits)."""
    out = torch.empty(weight.shape, dtype=scheme.weight_dtype)
    step = _row_step(scheme)
    for r in range(0, weight.shape[0], step):
        if scheme.weight_scale == "tensor":
            part = scale
        elif scheme.weight_scale == "channel":
            part = scale[r : r + step]
        else:
            bn = scheme.block_size[0]
            part = scale[r // bn : (r + step + bn - 1) // bn]
        out[r : r + step] = formats.quantize_weight(
            weight[r : r + step], scheme.weight_dtype, scheme.weight_scale, scheme.block_size or None, scale=part
        )[0]
    return out


def _linear_names(config_dir: Path) -> list[str]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [name for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, torch.nn.Linear)]


def _excluded(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p) for p in patterns)


def stream_quantize(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    weights: str = "float8_e4m3fn",
    weight_scale_granularity: str = "channel",
    activations: str | None = None,
    activation_scale: str = "token",
    exclude=("lm_head",),
    block_size=formats.DEFAULT_BLOCK_SIZE,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> dict:
    """Quantizes the float checkpoint ``src`` into ``dst``; returns a summary (counts and bytes)."""
    if activations == "static":
        raise ValueError(
            "static activation scales need calibration, which streaming quantization does not run; use "
            "--activations dynamic, or quantize in memory with qfp8.quantize + qfp8.calibrate + qfp8.save_pretrained"
        )
    scheme = QuantizationScheme.from_args(weights, weight_scale_granularity, activations, activation_scale, block_size)
    checkpoint = open_checkpoint(src)
    plan = checkpoint.plan()
    if plan.format != "float":
        raise ValueError(
            f"{checkpoint.directory}: already quantized ({plan.format}); qfp8 quantize takes a float checkpoint"
        )
    linears = _linear_names(checkpoint.directory)
    quantized, ignored = {}, []
    for name in linears:
        stored = plan.tensors.get(name + ".weight")
        if stored is None or _excluded(name, exclude) or len(stored.file.info(stored.name).shape) != 2:
            ignored.append(name)  # excluded, or tied to another tensor and not stored
            continue
        if not stored.file.info(stored.name).dtype.is_floating_point:
            raise ValueError(f"{stored.file.path}: {stored.name} is {stored.file.info(stored.name).dtype}, not float")
        quantized[name] = scheme

    out: list[PlannedTensor] = []
    scales: dict[str, torch.Tensor] = {}

    def scale_of(module: str) -> torch.Tensor:
        if module not in scales:
            scales[module] = weight_scale(plan.load(module + ".weight", mmap=False), scheme)
        return scales[module]

    def take_scale(module: str) -> torch.Tensor:
        # A weight is written after its scale (the writer puts float32 first),
        # except across a shard boundary: then the scale is computed again.
        scale = scale_of(module)
        del scales[module]
        return scale

    for key, stored in plan.tensors.items():
        info = stored.file.info(stored.name)
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in quantized:
            n, k = info.shape
            shape = {"tensor": (1,), "channel": (n, 1)}.get(scheme.weight_scale) or formats.block_scale_shape(
                (n, k), scheme.block_size
            )
            out.append(
                PlannedTensor(
                    key,
                    scheme.weight_dtype,
                    (n, k),
                    lambda m=module, key=key: quantize_rows(plan.load(key, mmap=False), take_scale(m), scheme),
                )
            )
            out.append(PlannedTensor(module + ".weight_scale", torch.float32, shape, lambda m=module: scale_of(m)))
        else:
            out.append(PlannedTensor(key, info.dtype, info.shape, lambda key=key: plan.load(key, mmap=False)))

    config = dict(checkpoint.config)
    config["quantization_config"] = qconfig.build_quantization_config(quantized, ignored, None)
    bar = _progress(sum(t.nbytes for t in out), progress)
    try:
        shards = write_checkpoint(
            dst, out, config, max_shard_size, carried_files(checkpoint.directory), on_tensor=lambda t: bar(t.nbytes)
        )
    finally:
        bar(None)
    return {"quantized": len(quantized), "ignored": len(ignored), "shards": shards, "bytes": sum(t.nbytes for t in out)}


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="quantize", file=sys.stderr)

    def update(n):
        if n is None:
            bar.close()
        else:
            bar.update(n)

    return update


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="float checkpoint folder (safetensors, sharded or not) or Hub repo id")
    parser.add_argument("dst", help="output folder (compressed-tensors float-quantized)")
    parser.add_argument("--weights", default="float8_e4m3fn", choices=sorted(formats.FP8_DTYPES))
    parser.add_argument("--weight-scale", default="channel", choices=formats.WEIGHT_GRANULARITIES)
    parser.add_argument(
        "--block-size", type=int, nargs=2, default=list(formats.DEFAULT_BLOCK_SIZE), metavar=("BN", "BK")
    )
    parser.add_argument("--activations", default=None, choices=["dynamic"], help="default: weights only (W8A16)")
    parser.add_argument("--activation-scale", default="token", choices=formats.ACTIVATION_GRANULARITIES)
    parser.add_argument("--exclude", nargs="*", default=["lm_head"], help="fnmatch patterns of modules kept in float")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    summary = stream_quantize(
        args.src,
        args.dst,
        weights=args.weights,
        weight_scale_granularity=args.weight_scale,
        activations=args.activations,
        activation_scale=args.activation_scale,
        exclude=tuple(args.exclude),
        block_size=tuple(args.block_size),
        max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
    )
    print(
        f"{args.dst}: {summary['quantized']} linear layers quantized, {summary['ignored']} kept in float, "
        f"{len(summary['shards'])} shard(s), {summary['bytes'] / 1e6:.1f} MB"
    )
    return 0
