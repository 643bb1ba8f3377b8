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

Static activation scales (``--activations static``) and FP8 KV-cache scales
(``--kv-cache``) need the model run on calibration text. For Llama-family
checkpoints that runs first, one decoder layer at a time (see
``qfp8/checkpoint/layerwise.py``): at most one layer's float weights are in
memory, plus the hidden states of the calibration tokens. The text is
``--calibration FILE``, or by default a fixed slice of ``pydoc_data``
(``layerwise.DEFAULT_TEXT_OFFSET``), tokenized with the tokenizer in SRC
without special tokens; its first ``--calibration-tokens`` (512, or 8,192
with ``--accuracy``) tokens are cut into rows of up to 512, run as one batch
(or ``--calibration-batch-size`` rows at a time). ``--calibration-ids FILE``
gives token ids instead, used whole. The scales (``input_scale``, ``k_scale``/``v_scale``,
float32 ``[1]``) are the ones ``qfp8.quantize`` + ``qfp8.calibrate`` over the
same batches on the whole model followed by ``qfp8.save_pretrained`` write,
bit for bit. Each
calibrated layer's weights are read once more for it.

``--accuracy gptq`` (or ``scale``) chooses the FP8 weights themselves from the
same layer-by-layer calibration (qfp8/rounding.py); they equal in-memory
``qfp8.quantize(..., accuracy=...)`` + ``qfp8.calibrate``, bit for bit, and
are held in memory until written (the size of the FP8 checkpoint).

As ``qfp8.save_pretrained`` does, it marks ``qfp8_method: "qfp8"`` (no ``quant_method``) for
e5m2 weights or an e5m2 KV cache, and warns (before any work) about that or
about what vLLM would refuse or could not run (see qfp8/checkpoint/config.py).
``--max-shard-size``, whether DST can be written, and the calibration file
are checked before the calibration too. ``qfp8 quantize`` stops on SIGTERM
as on Ctrl-C: no partial file is left in DST.

What is quantized, and what kept in float and why, is planned by
``qfp8.quantize``'s planner (qfp8/quantize_plan.py) on a meta-device build of
the model, translated to the checkpoint in qfp8/checkpoint/stream_plan.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from qfp8 import formats, rounding
from qfp8.checkpoint import compat, layerwise
from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.readers import open_checkpoint
from qfp8.checkpoint.remote_code import check_flag
from qfp8.checkpoint.safetensors_io import PlannedTensor
from qfp8.checkpoint.stream_plan import LayerPlan, ModelLinears, linear_names, plan_layers
from qfp8.checkpoint.tensor_scales import expand_rows
from qfp8.checkpoint.writer import (
    DEFAULT_MAX_SHARD_SIZE,
    add_transformers4_keys,
    carried_files,
    check_output_directory,
    kv_rounding_file,
    parse_size,
    write_checkpoint,
)
from qfp8.nn.scheme import QuantizationScheme
from qfp8.quantize import DEFAULT_EXCLUDE, KV_CACHE_DTYPES

__all__ = [
    "CHUNK_ROWS",
    "ModelLinears",
    "add_arguments",
    "check_option_combinations",
    "dequantize_rows",
    "quantize_rows",
    "read_user_file",
    "run",
    "sigterm_as_exit",
    "stream_quantize",
    "weight_scale",
]

CHUNK_ROWS = 1024  # rows quantized at once: bounds the float32 temporaries


def _row_bands(rows: int, scheme: QuantizationScheme) -> list[tuple[int, int]]:
    return formats.row_bands(rows, CHUNK_ROWS, scheme.block_size[0] if scheme.weight_scale == "block" else 1)


def weight_scale(weight: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """The scale ``qfp8.quantize`` would give ``weight``, computed in row chunks."""
    pieces = [
        formats.weight_amax(weight[r:stop], scheme.weight_scale, scheme.block_size or formats.DEFAULT_BLOCK_SIZE)
        for r, stop in _row_bands(weight.shape[0], scheme)
    ]
    amax = torch.stack(pieces).amax(0) if scheme.weight_scale == "tensor" else torch.cat(pieces)
    return formats.scale_from_amax(amax, scheme.weight_dtype)


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """``formats.quantize_weight(weight, scale=scale)`` in row chunks (same bits)."""
    out = torch.empty(weight.shape, dtype=scheme.weight_dtype)
    for r, stop in _row_bands(weight.shape[0], scheme):
        out[r:stop] = formats.quantize_weight(
            weight[r:stop],
            scheme.weight_dtype,
            scheme.weight_scale,
            scheme.block_size or None,
            scale=_rows_scale(scale, scheme, r, stop - r),
        )[0]
    return out


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, scheme: QuantizationScheme, dtype) -> torch.Tensor:
    """``formats.dequantize_weight(codes, scale, ...)`` in ``dtype``, in row chunks (same bits)."""
    out = torch.empty(codes.shape, dtype=dtype)
    for r, stop in _row_bands(codes.shape[0], scheme):
        part = _rows_scale(scale, scheme, r, stop - r)
        out[r:stop] = formats.dequantize_weight(codes[r:stop], part, scheme.block_size or None, dtype)
    return out


def _rows_scale(scale: torch.Tensor, scheme: QuantizationScheme, r: int, step: int) -> torch.Tensor:
    """The part of a weight's ``scale`` that its rows ``[r, r + step)`` use."""
    if scheme.weight_scale == "tensor":
        return scale
    if scheme.weight_scale == "channel":
        return scale[r : r + step]
    bn = scheme.block_size[0]
    return scale[r // bn : (r + step + bn - 1) // bn]


_linear_names = linear_names  # importable here too


def _untie(config: dict) -> None:
    """``tie_word_embeddings`` false in a config.json dict and its ``text_config`` (a VLM's language model)."""
    for part in (config, config.get("text_config")):
        if isinstance(part, dict):
            part["tie_word_embeddings"] = False


def read_user_file(path: str | os.PathLike, what: str, read=Path.read_text):
    """``read(Path(path))``; a file that cannot be read (a folder, no permission, not UTF-8 text) is a user
    error naming ``what`` and the path: ValueError (FileNotFoundError when it does not exist)."""
    path = Path(path)
    try:
        return read(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a folder, not a file") from None
    except OSError as error:
        raise ValueError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def stream_quantize(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    weights: str = "float8_e4m3fn",
    weight_scale_granularity: str = "channel",
    activations: str | None = None,
    activation_scale: str = "token",
    exclude=DEFAULT_EXCLUDE,
    block_size=formats.DEFAULT_BLOCK_SIZE,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    kv_cache: str | None = None,
    calibration: str | os.PathLike | None = None,
    calibration_ids: torch.Tensor | None = None,
    calibration_tokens: int | None = None,
    calibration_batch_size: int | None = None,
    accuracy: str | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """Quantizes the float checkpoint ``src`` into ``dst``; returns a summary (counts and bytes, and ``"report"``:
    a :class:`qfp8.QuantizeReport` of the checkpoint's linear layers).

    With ``activations="static"`` or ``kv_cache`` (``"float8_e4m3fn"`` /
    ``"float8_e5m2"``), a Llama-family checkpoint is calibrated layer by layer
    first, on ``calibration_ids`` (token ids ``[rows, T]``, or a 1-D stream cut
    into rows of up to 512) or else on the first ``calibration_tokens`` tokens
    of the text file ``calibration`` (default: a fixed slice of pydoc_data;
    ``calibration_tokens`` defaults to 512, or 8,192 with ``accuracy``),
    tokenized with the tokenizer in ``src``; ``calibration_batch_size`` rows
    are run at a time (default: all). ``accuracy`` (``"scale"`` or ``"gptq"``,
    see qfp8/rounding.py) chooses the FP8 weights from the same layer-by-layer
    calibration; they are held in memory until written. Otherwise the
    calibration arguments are not used.

    A model with nothing to quantize (every Linear excluded, say) is a ValueError
    saying why, before anything is written. transformers' ``Conv1D`` layers
    (GPT-2's, weight stored ``[in, out]``) are quantized as linear layers: their
    weight is read transposed and written ``[out, in]``, as ``qfp8.quantize`` +
    ``qfp8.save_pretrained`` write it.
    """
    rounding.check_mode(accuracy)
    scheme = QuantizationScheme.from_args(weights, weight_scale_granularity, activations, activation_scale, block_size)
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; expected one of {list(KV_CACHE_DTYPES)}")
    checkpoint, plan = _open_float_checkpoint(src, dst, max_shard_size)
    needs_calibration = scheme.activations == "static" or kv_cache is not None or accuracy is not None
    if needs_calibration:
        calibration_ids = _calibration_rows(checkpoint, calibration, calibration_ids, calibration_tokens, accuracy)
    found = linear_names(checkpoint.directory, set(plan.tensors), check_flag(trust_remote_code, "stream_quantize"))
    layers = plan_layers(found, plan, checkpoint, scheme, exclude, accuracy)
    kv_dtype = None if kv_cache is None else formats.fp8_dtype(kv_cache)
    # Said before the work: a qfp8-only checkpoint, or what vLLM would refuse (see qfp8/checkpoint/compat.py).
    converted = {name: found.transposed[name] for name in layers.transposed}  # GPT-2's Conv1D, written [out, in]
    for message in compat.save_warnings(layers.layers, kv_dtype, converted):
        warnings.warn(message, UserWarning, stacklevel=2)

    calibrated: dict[str, torch.Tensor] = {}
    if needs_calibration:
        quantize_args = dict(
            weights=weights,
            weight_scale=weight_scale_granularity,
            activations=activations,
            activation_scale=activation_scale,
            block_size=block_size,
            kv_cache=kv_cache,
            accuracy=accuracy,
        )
        calibrated = _calibrate(
            plan, layers.quantized, quantize_args, calibration_ids, calibration_batch_size, progress
        )
    # The KV cache's query moments go to their own file beside the checkpoint (qfp8.save_pretrained's).
    kv_rounding = {name: calibrated.pop(name) for name in list(calibrated) if name.endswith(".k_rounding_hessian")}
    out = _planned_tensors(plan, found, layers, _StreamedWeights(plan, scheme, calibrated, found, layers))
    config = _output_config(checkpoint.config, found, layers, kv_dtype)
    bar = _progress(sum(t.nbytes for t in out), progress)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            extra = {**carried_files(checkpoint.directory), **kv_rounding_file(kv_rounding, scratch)}
            shards = write_checkpoint(dst, out, config, max_shard_size, extra, on_tensor=lambda t: bar(t.nbytes))
    finally:
        bar(None)
    return {
        "quantized": len(layers.quantized),
        "ignored": len(layers.ignored),
        "shards": shards,
        "bytes": sum(t.nbytes for t in out),
        "calibrated": sum(name.endswith(("input_scale", "k_scale", "v_scale")) for name in calibrated),
        "accuracy_weights": sum(name.endswith(".weight") for name in calibrated),
        "calibration_tokens": calibration_ids.numel() if needs_calibration else 0,
        "report": layers.report,
    }


def _open_float_checkpoint(src, dst, max_shard_size):
    """The float checkpoint ``src`` and its plan, after the cheap checks of what is used only at the end
    (calibration can take hours): DST can be written, the shard size parses, DST is not SRC."""
    check_output_directory(dst, "DST")
    parse_size(max_shard_size)
    checkpoint = open_checkpoint(src)
    # samefile: the same folder also through "..", symbolic links or a Hub cache path.
    if Path(dst).is_dir() and os.path.samefile(checkpoint.directory, dst):
        raise ValueError(
            f"DST {dst} is the source folder {checkpoint.directory}; writing there would replace the "
            "float checkpoint. Give another folder for the FP8 checkpoint"
        )
    plan = checkpoint.plan()
    if plan.format != "float":
        raise ValueError(
            f"{checkpoint.directory}: already quantized ({plan.format}); qfp8 quantize takes a float checkpoint"
        )
    return checkpoint, plan


def _calibration_rows(checkpoint, calibration, calibration_ids, calibration_tokens, accuracy) -> torch.Tensor:
    """The calibration batch: ``calibration_ids``, else the tokens of the text file ``calibration`` (default
    text: layerwise's), cut into rows the model takes."""
    layerwise.check_architecture(checkpoint.config, checkpoint.directory)
    if calibration_ids is None:
        text = None if calibration is None else read_user_file(calibration, "calibration text file")
        tokenizer = layerwise.load_tokenizer(checkpoint.directory)
        if calibration_tokens is None:
            calibration_tokens = layerwise.DEFAULT_TOKENS if accuracy is None else layerwise.ACCURACY_TOKENS
        calibration_ids = layerwise.text_token_ids(tokenizer, text, calibration_tokens)
    return layerwise.calibration_rows(
        calibration_ids,
        checkpoint.config.get("vocab_size") or sys.maxsize,
        checkpoint.config.get("max_position_embeddings"),
    )


def _calibrate(plan, quantized, quantize_args, calibration_ids, batch_size, progress: bool) -> dict:
    bar = _progress(0, progress, desc="calibrate", unit="layer")
    try:
        return layerwise.calibrate_layerwise(plan, quantized, quantize_args, calibration_ids, batch_size, on_step=bar)
    finally:
        bar(None, None)


class _StreamedWeights:
    """The FP8 weights and scales of the quantized modules, computed when the writer asks for them.

    A weight is written after its scale (the writer puts float32 first),
    except across a shard boundary: then the scale is computed again. A tied
    head's FP8 weight serves two tensors (the head, and the embedding as its
    dequantized rows): it is quantized once and kept until both are written,
    not read and quantized again for each.
    """

    def __init__(self, plan, scheme: QuantizationScheme, calibrated: dict, found: ModelLinears, layers: LayerPlan):
        self.plan, self.scheme, self.calibrated = plan, scheme, calibrated
        self.expert_parts, self.weight_keys, self.tied_head = found.expert_parts, layers.weight_keys, layers.tied_head
        self.transposed = layers.transposed
        self.scales: dict[str, torch.Tensor] = {}
        self.tied_fp8: list = []  # [codes, scale, writes left]

    def weight_key(self, module: str) -> str:  # where the float weight of a quantized module is stored
        return self.weight_keys.get(module, module + ".weight")

    def scalar(self, name: str) -> PlannedTensor:
        return PlannedTensor(name, torch.float32, (1,), lambda: self.calibrated[name])

    def load_weight(self, module: str, key: str) -> torch.Tensor:
        """The float weight of ``module`` as ``[out, in]`` (a Conv1D's is stored ``[in, out]``)."""
        weight = self.plan.load(key, mmap=False)
        return weight.t().contiguous() if module in self.transposed else weight

    def read_scale(self, module: str, key: str) -> torch.Tensor:
        scale = weight_scale(weight := self.load_weight(module, key), self.scheme)
        if not torch.isfinite(scale).all():  # NaN/Inf in the weight: refused, as quantize refuses it
            raise ValueError(
                f"{self.plan.tensors[key].file.path}: {key} {list(weight.shape)} holds NaN/Inf values, which FP8 "
                f"cannot represent; fix the weight or pass --exclude {module}"
            )
        return scale

    def scale_of(self, module: str) -> torch.Tensor:
        if module + ".weight_scale" in self.calibrated:  # chosen by the accuracy mode
            return self.calibrated[module + ".weight_scale"]
        scales = self.scales
        if module not in scales:
            siblings = self.expert_parts[module][1] if module in self.expert_parts else [module]
            if self.scheme.weight_scale == "tensor" and len(siblings) > 1:
                # One scale for the expert's gate and up parts, as quantize gives their fused weight.
                shared = torch.stack([self.read_scale(m, m + ".weight") for m in siblings])
                scales.update(dict.fromkeys(siblings, shared.amax(0)))
            else:
                scales[module] = self.read_scale(module, self.weight_key(module))
        return scales[module]

    def stored_scale(self, module: str, rows: int | None) -> torch.Tensor:
        """``module``'s scale as written: a per-tensor one repeated over ``rows`` when it is written per channel."""
        scale = self.scale_of(module)
        return scale if rows is None else expand_rows(scale, rows)

    def take_scale(self, module: str) -> torch.Tensor:
        scale = self.scale_of(module)
        del self.scales[module]
        return scale

    def fp8_weight(self, module: str) -> torch.Tensor:
        key = module + ".weight"
        if key in self.calibrated:  # accuracy mode: the weight and its scale as calibration chose them
            return self.calibrated[key]
        return quantize_rows(self.load_weight(module, self.weight_key(module)), self.take_scale(module), self.scheme)

    def tied_head_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        tied_fp8 = self.tied_fp8
        if not tied_fp8:
            scale = self.scale_of(self.tied_head)  # before fp8_weight takes it
            tied_fp8.extend([self.fp8_weight(self.tied_head), scale, 2])
        codes, scale = tied_fp8[0], tied_fp8[1]
        tied_fp8[2] -= 1
        if tied_fp8[2] == 0:
            tied_fp8.clear()
        return codes, scale

    def weight(self, module: str) -> torch.Tensor:
        return self.tied_head_fp8()[0] if module == self.tied_head else self.fp8_weight(module)


def _planned_tensors(plan, found: ModelLinears, layers: LayerPlan, source: _StreamedWeights) -> list[PlannedTensor]:
    """The output checkpoint's tensors in the order of the source's, each computed when written."""
    scheme, quantized, tied_head = source.scheme, layers.quantized, layers.tied_head
    as_channel = scheme in qconfig.channel_written(quantized)  # per-tensor scales written per row (tensor_scales.py)
    # k_scale / v_scale go out with the first tensor of their attention module.
    kv_scales: dict[str, list[str]] = {}
    for name in source.calibrated:
        if name.endswith((".k_scale", ".v_scale")):
            kv_scales.setdefault(name.rpartition(".")[0], []).append(name)
    out: list[PlannedTensor] = []
    for key, stored in plan.tensors.items():
        info = stored.file.info(stored.name)
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if key in layers.skipped and tied_head in quantized:
            continue
        if tied_head in quantized and key == layers.weight_keys[tied_head]:
            # The table the embedding reads: the head's FP8 weight, dequantized in the stored dtype.
            out.append(
                PlannedTensor(
                    layers.tied_embedding + ".weight",
                    info.dtype,
                    info.shape,
                    lambda d=info.dtype: dequantize_rows(*source.tied_head_fp8(), scheme, d),
                )
            )
            module = tied_head
        if module in quantized:
            n, k = reversed(info.shape) if module in layers.transposed else info.shape
            out.append(
                PlannedTensor(module + ".weight", scheme.weight_dtype, (n, k), lambda m=module: source.weight(m))
            )
            rows = n if as_channel else None
            shape = (n, 1) if as_channel else formats.weight_scale_shape((n, k), scheme.weight_scale, scheme.block_size)
            out.append(
                PlannedTensor(
                    module + ".weight_scale", torch.float32, shape, lambda m=module, r=rows: source.stored_scale(m, r)
                )
            )
            if module + ".input_scale" in source.calibrated:
                out.append(source.scalar(module + ".input_scale"))
        else:
            out.append(PlannedTensor(key, info.dtype, info.shape, lambda key=key: plan.load(key, mmap=False)))
        parts = key.split(".")
        for end in range(len(parts) - 1, 0, -1):
            attention = ".".join(parts[:end])
            if attention in kv_scales:
                out += [source.scalar(name) for name in kv_scales.pop(attention)]
    out += [source.scalar(name) for names in kv_scales.values() for name in names]
    # A quantized layer's bias stored under another name only (tied: BERT's decoder.bias is cls.predictions.bias):
    # its QLinear holds a bias of its own, so it is written under the layer's name too, as save_pretrained does.
    for module in quantized:
        key = module + ".bias"
        shared = next((n for n in (found.shared or {}).get(key, []) if n in plan.tensors), None)
        if key not in plan.tensors and shared is not None:
            info = plan.tensors[shared].file.info(plan.tensors[shared].name)
            out.append(PlannedTensor(key, info.dtype, info.shape, lambda shared=shared: plan.load(shared, mmap=False)))
    return out


def _output_config(source_config: dict, found: ModelLinears, layers: LayerPlan, kv_dtype) -> dict:
    """The output's config.json: the source's, with its quantization_config (and ties) as save_pretrained writes."""
    config = dict(source_config)
    config["quantization_config"] = qconfig.build_quantization_config(
        layers.quantized, layers.ignored, kv_dtype, model_names=found.model_names
    )
    if layers.tied_head in layers.quantized or layers.untied:
        _untie(config)
    if layers.tied_head in layers.quantized:
        config[qconfig.TIED_EMBEDDINGS_KEY] = {layers.tied_embedding: layers.tied_head}
    # As qfp8.save_pretrained writes: the class built (a folder converted from GGUF has none) and the keys
    # transformers 4 (vLLM) reads where transformers 5 wrote others (rope_theta: see add_transformers4_keys).
    if config.get("model_type") and not config.get("architectures"):
        config["architectures"] = [found.model_name]
    add_transformers4_keys(found.config_class, config)
    return config


def _progress(total: int, enabled: bool, desc: str = "quantize", unit: str = "B"):
    """An update function for a tqdm bar: ``update(n)`` adds ``n``; ``update(done, total)`` sets both; None closes."""
    if not enabled:
        return lambda *args: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda *args: None
    bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, file=sys.stderr)

    def update(n, total=None):
        if n is None:
            bar.close()
        elif total is not None:
            bar.total = total
            bar.update(n - bar.n)
        else:
            bar.update(n)

    return update


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="float checkpoint folder (safetensors, sharded or not) or Hub repo id")
    parser.add_argument("dst", help="output folder (compressed-tensors float-quantized)")
    parser.add_argument("--weights", default="float8_e4m3fn", choices=sorted(formats.FP8_DTYPES))
    parser.add_argument("--weight-scale", default="channel", choices=formats.WEIGHT_GRANULARITIES)
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own Python code (config.json auto_map) to build its model; off: such a "
        "checkpoint is refused (no prompt)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        nargs=2,
        default=None,
        metavar=("BN", "BK"),
        help=f"with --weight-scale block (default {list(formats.DEFAULT_BLOCK_SIZE)})",
    )
    parser.add_argument(
        "--activations",
        default=None,
        choices=["dynamic", "static"],
        help="default: weights only (W8A16); static calibrates per-tensor input scales (Llama family)",
    )
    parser.add_argument(
        "--activation-scale",
        default=None,
        choices=formats.ACTIVATION_GRANULARITIES,
        help="dynamic scales' granularity (default token); static scales are per tensor. token-mse: per-token scales searched by "
        "qfp8's kernels for the least rounding error (written as dynamic token: vLLM computes amax / fmax)",
    )
    parser.add_argument(
        "--kv-cache",
        default=None,
        choices=[name for name in KV_CACHE_DTYPES if name],
        help="FP8 KV cache with calibrated k_scale/v_scale per attention layer (Llama family)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="calibration text file (default: a fixed slice of Python's pydoc_data topics), tokenized with SRC's "
        "tokenizer",
    )
    parser.add_argument(
        "--calibration-ids",
        default=None,
        metavar="FILE",
        help="calibration token ids instead of text: whitespace-separated integers, one sequence per line "
        "(one line: a stream cut into rows of up to 512)",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens of calibration text, cut into rows of up to 512 (a shorter remainder is dropped); default "
        f"{layerwise.DEFAULT_TOKENS}, or {layerwise.ACCURACY_TOKENS} with --accuracy (not with --calibration-ids, "
        "which are all used)",
    )
    parser.add_argument(
        "--calibration-batch-size", type=int, default=None, metavar="ROWS", help="rows run at a time (default: all)"
    )
    parser.add_argument(
        "--accuracy",
        default=None,
        choices=[mode for mode in rounding.ACCURACY_MODES if mode],
        help="choose each FP8 weight and scale for the least output error on the calibration text, layer by "
        "layer (Llama family; same on-disk format)",
    )
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=None,
        metavar="PATTERN",
        help="fnmatch patterns of modules kept in float (default: lm_head; none: a bare --exclude); it takes every "
        "value after it, so write it after SRC DST (or end its patterns with --)",
    )
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    parser.add_argument("--no-progress", action="store_true")


@contextlib.contextmanager
def sigterm_as_exit():
    """SIGTERM (from ``timeout``, job schedulers, ``docker stop``) raises SystemExit(143) in the main thread, so that
    a checkpoint being written removes its temporary files as it does on Ctrl-C; elsewhere, nothing changes."""

    def exit_on(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous, installed = signal.signal(signal.SIGTERM, exit_on), True
    except ValueError:  # not the main thread
        previous, installed = None, False
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)


def check_option_combinations(args: argparse.Namespace) -> None:
    """Options that would be ignored as given are user errors: the user meant something else."""
    if args.block_size is not None and args.weight_scale != "block":
        raise ValueError(f"--block-size applies to --weight-scale block, not {args.weight_scale}")
    static_tensor = args.activations == "static" and args.activation_scale == "tensor"  # what static means anyway
    if args.activation_scale is not None and args.activations != "dynamic" and not static_tensor:
        raise ValueError(
            "--activation-scale applies to --activations dynamic"
            + (" (static input scales are per tensor)" if args.activations == "static" else "")
        )
    if args.calibration_batch_size is not None and args.calibration_batch_size < 1:
        raise ValueError(f"--calibration-batch-size must be at least 1, got {args.calibration_batch_size}")
    if args.calibration_tokens is not None and args.calibration_tokens < 2:
        raise ValueError(
            f"--calibration-tokens must be at least 2 (tokens of calibration text), got {args.calibration_tokens}"
        )
    if args.calibration is not None and args.calibration_ids is not None:
        raise ValueError("give --calibration (text) or --calibration-ids (token ids), not both")
    if args.calibration_tokens is not None and args.calibration_ids is not None:
        raise ValueError(
            "--calibration-tokens applies to calibration text, not --calibration-ids (every id in the file is "
            "used: give fewer ids to calibrate on fewer tokens)"
        )
    needs_calibration = args.activations == "static" or args.kv_cache is not None or args.accuracy is not None
    given = [
        option
        for option, value in (
            ("--calibration", args.calibration),
            ("--calibration-ids", args.calibration_ids),
            ("--calibration-tokens", args.calibration_tokens),
            ("--calibration-batch-size", args.calibration_batch_size),
        )
        if value is not None
    ]
    if given and not needs_calibration:
        raise ValueError(
            f"{', '.join(given)}: nothing to calibrate (calibration runs for --activations static, --kv-cache or "
            "--accuracy)"
        )


def run(args: argparse.Namespace) -> int:
    check_option_combinations(args)
    calibration_ids = None
    if args.calibration_ids is not None:
        calibration_ids = read_user_file(args.calibration_ids, "--calibration-ids file", layerwise.read_token_ids)
    with sigterm_as_exit():
        summary = stream_quantize(
            args.src,
            args.dst,
            weights=args.weights,
            weight_scale_granularity=args.weight_scale,
            activations=args.activations,
            activation_scale=args.activation_scale or "token",
            exclude=DEFAULT_EXCLUDE if args.exclude is None else tuple(args.exclude),
            block_size=tuple(args.block_size or formats.DEFAULT_BLOCK_SIZE),
            max_shard_size=args.max_shard_size,
            progress=not args.no_progress,
            kv_cache=args.kv_cache,
            calibration=args.calibration,
            calibration_ids=calibration_ids,
            calibration_tokens=args.calibration_tokens,
            calibration_batch_size=args.calibration_batch_size,
            accuracy=args.accuracy,
            trust_remote_code=args.trust_remote_code,
        )
    calibrated = (
        f", {summary['calibrated']} static scales and {summary['accuracy_weights']} accuracy-mode weights "
        f"calibrated on {summary['calibration_tokens']} tokens"
        if summary["calibration_tokens"]
        else ""
    )
    print(
        f"{args.dst}: {summary['quantized']} linear layers quantized, {summary['ignored']} kept in float"
        f"{calibrated}, {len(summary['shards'])} shard(s), {summary['bytes'] / 1e6:.1f} MB"
    )
    return 0
