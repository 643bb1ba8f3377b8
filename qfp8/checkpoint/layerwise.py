"""Static scales for ``qfp8 quantize``: a float checkpoint calibrated one decoder layer at a time.

Static activation scales (``input_scale``) and FP8 KV-cache scales
(``k_scale``/``v_scale``) need the model run on calibration text. A streamed
checkpoint may not fit in memory, so the model is built from ``config.json``
on the ``meta`` device and run the way its own ``forward`` runs, one piece at
a time:

1. the token embedding is read and applied to the calibration ids, giving the
   hidden states ``[rows, T, hidden]`` (kept for the whole pass);
2. position ids, rotary embeddings and the causal mask are built as the
   transformers model's ``forward`` builds them (no padding, ``use_cache``
   from the config: with it, each layer gets a fresh ``DynamicCache``, so an
   FP8 KV cache quantizes K/V during calibration exactly as it does in
   ``model(ids)``);
3. for each decoder layer: its float weights are read, ``qfp8.quantize``
   replaces its linears, ``qfp8.calibrate(layer)`` runs it on the hidden
   states (batch by batch), which become the layer's output, computed by the
   quantized layer as it calibrates; its scales are kept and the layer freed;
4. if ``lm_head`` is quantized with static scales, the final norm and
   ``lm_head`` are read and calibrated the same way.

Each layer sees its inputs in the same order, through the same quantized
upstream layers, as in ``with qfp8.calibrate(model): for batch in batches:
model(batch)`` on the whole quantized model, so the scales are the same
(bitwise, on the same machine and thread count). At most one decoder layer's
weights are in memory at a time, plus the embedding while it is applied and
the hidden states of the calibration tokens.

Supported: the Llama family, whose models' ``forward`` is the one rebuilt
here (``MODEL_TYPES``); anything else raises ``ValueError`` naming it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qfp8 import formats
from qfp8.checkpoint.readers import CheckpointPlan
from qfp8.nn import QLinear
from qfp8.quantize import calibrate, quantize

__all__ = [
    "ACCURACY_TOKENS",
    "DEFAULT_TEXT_OFFSET",
    "DEFAULT_TOKENS",
    "MODEL_TYPES",
    "TOKENIZER_FILES",
    "WINDOW",
    "architecture_name",
    "calibrate_layerwise",
    "calibration_rows",
    "check_architecture",
    "default_text",
    "load_tokenizer",
    "read_token_ids",
    "text_token_ids",
]

# model_type -> transformers decoder models whose forward is embed -> rotary ->
# causal (or sliding-window) mask -> layers -> norm, with nothing in between.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The default calibration text: pydoc_data (qfp8.evaluate.pydoc_text, about
# 465,000 characters with Python 3.11) from this character on, about 13,500
# SmolLM2 tokens. That is inside the calibration slice of qfp8/evaluate.py
# (from token 98,304, character ~404,800 with SmolLM2's tokenizer), after any
# of its evaluation slices, which start at character 0.
DEFAULT_TEXT_OFFSET = 410_000
DEFAULT_TOKENS = 512
# With an accuracy mode: GPTQ fits each layer to its calibration inputs, and 2,048 tokens
# left it noticeably worse on held-out text than 8,192 (SmolLM2, see qfp8/rounding.py).
ACCURACY_TOKENS = 8192
WINDOW = 512  # calibration tokens per row: longer token streams are cut into rows of this length
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def architecture_name(config: dict) -> str:
    architectures = config.get("architectures") or []
    return architectures[0] if architectures else f"model_type {config.get('model_type')!r}"


def check_architecture(config: dict, directory: Path) -> None:
    """Raises ``ValueError`` unless the checkpoint is a Llama-family causal LM layer-by-layer calibration supports."""
    if config.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"{directory}: layer-by-layer calibration (static activation scales, FP8 KV-cache scales) supports the "
            f"Llama family (model_type {', '.join(MODEL_TYPES)}); this checkpoint is {architecture_name(config)} "
            f"(model_type {config.get('model_type')!r}). Use --activations dynamic without --kv-cache, or quantize "
            "it in memory with qfp8.quantize + qfp8.calibrate + qfp8.save_pretrained"
        )


# ----------------------------------------------------------- token ids


def default_text() -> str:
    """The default calibration text (see :data:`DEFAULT_TEXT_OFFSET`)."""
    from qfp8.evaluate import pydoc_text

    return pydoc_text()[DEFAULT_TEXT_OFFSET:]


def load_tokenizer(directory: Path):
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{directory}: no tokenizer ({', '.join(TOKENIZER_FILES)}) to tokenize the calibration text; add the "
            "tokenizer files to the checkpoint folder or pass token ids (--calibration-ids FILE, calibration_ids=)"
        )
    from qfp8.checkpoint.remote_code import auto_tokenizer

    return auto_tokenizer(directory)


def text_token_ids(tokenizer, text: str | None = None, tokens: int = DEFAULT_TOKENS) -> torch.Tensor:
    """The first ``tokens`` ids of ``text`` (default: :func:`default_text`), without special tokens, 1-D."""
    if tokens < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {tokens}")
    ids = tokenizer(default_text() if text is None else text, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < 2:
        raise ValueError(f"the calibration text gives {len(ids)} token(s); calibration needs at least 2")
    return torch.tensor(ids, dtype=torch.long)


def read_token_ids(path: str | os.PathLike) -> torch.Tensor:
    """Token ids from a text file: whitespace-separated integers, one sequence per line (equal lengths)."""
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append([int(token) for token in line.split()])
        except ValueError:
            raise ValueError(f"{path}:{number}: expected whitespace-separated integer token ids") from None
    if not rows:
        raise ValueError(f"{path}: no token ids")
    if len(rows) == 1:
        return torch.tensor(rows[0], dtype=torch.long)
    lengths = sorted({len(row) for row in rows})
    if len(lengths) > 1:
        raise ValueError(f"{path}: every line is one sequence and all must have the same length; got {lengths}")
    return torch.tensor(rows, dtype=torch.long)


def calibration_rows(ids: torch.Tensor, vocab_size: int, max_positions: int | None) -> torch.Tensor:
    """Checks token ids and shapes them ``[rows, T]``: a 1-D stream is cut into rows of up to :data:`WINDOW`."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"calibration ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() == 1:
        length = min(ids.numel(), WINDOW, max_positions or WINDOW)
        if length < 2:
            raise ValueError(f"calibration needs at least 2 tokens, got {ids.numel()}")
        ids = ids[: ids.numel() // length * length].reshape(-1, length)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"calibration ids must be [tokens] or [rows, tokens], got shape {list(ids.shape)}")
    if max_positions and ids.shape[1] > max_positions:
        raise ValueError(
            f"calibration rows of {ids.shape[1]} tokens exceed the model's max_position_embeddings {max_positions}"
        )
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"calibration token ids span [{low}, {high}]; the model's vocabulary is [0, {vocab_size})")
    return ids.to(torch.long)


# --------------------------------------------------------- calibration


def _meta_model(directory: Path, dtype: torch.dtype):
    import transformers

    from qfp8.checkpoint.loader import _empty_weights
    from qfp8.checkpoint.remote_code import auto_config

    config = auto_config(directory)
    with _empty_weights():  # parameters on meta; rotary frequencies computed for real
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.tie_weights()  # accelerate's empty weights leave a tied lm_head its own meta Parameter
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, part) for part in parts) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{directory}: {type(model).__name__} is not laid out as a Llama-family model "
            "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head)"
        )
    return model.eval()


def _materialize(module: nn.Module, prefix: str, plan: CheckpointPlan, aliases: dict[str, str] | None = None) -> None:
    """Reads ``module``'s tensors (``prefix`` + name) from the checkpoint into it, as stored; a name the
    checkpoint lacks is read under its alias (``aliases``: a tied table's other name), if it has one."""
    state = {}
    for key, meta in module.state_dict().items():
        name = prefix + key
        if name not in plan.tensors and aliases and name in aliases:
            name = aliases[name]
        stored = plan.tensors.get(name)
        if stored is None:
            raise ValueError(f"{plan.directory}: the checkpoint has no tensor {name!r} {list(meta.shape)}")
        info = stored.file.info(stored.name)
        if tuple(info.shape) != tuple(meta.shape) or not info.dtype.is_floating_point:
            raise ValueError(
                f"{stored.file.path}: tensor {name!r} is {info.dtype} {list(info.shape)}, the model expects a float "
                f"tensor of shape {list(meta.shape)}"
            )
        state[key] = plan.load(name, mmap=False)
    module.load_state_dict(state, strict=True, assign=True)


def _mask_kind(config, index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _layer_inputs(model: nn.Module, hidden: torch.Tensor, use_cache: bool) -> dict:
    """Position ids, rotary embeddings and masks by kind, as the model's forward builds them for ``hidden``."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = model.config
    cache = DynamicCache(config=config) if use_cache else None
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask_args = dict(config=config, inputs_embeds=hidden, attention_mask=None, cache=cache, position_ids=position_ids)
    kinds = {_mask_kind(config, i) for i in range(config.num_hidden_layers)}
    masks = {}
    if "full_attention" in kinds:
        masks["full_attention"] = create_causal_mask(**mask_args)
    if "sliding_attention" in kinds:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
    return {
        "position_ids": position_ids,
        "position_embeddings": model.model.rotary_emb(hidden, position_ids=position_ids),
        "masks": masks,
    }


def _return_freed_memory() -> None:
    """Hands freed heap memory back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    glibc raises its mmap threshold after large blocks are freed, so a
    layer's freed weights stay in the heap; without trimming, the resident
    size would creep up layer after layer although nothing is alive.
    """
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _calibrating(module: nn.Module):
    """``qfp8.calibrate(module)`` if anything in it records scales, else just no-grad."""
    if any(hasattr(m, "start_calibration") for m in module.modules()):
        return calibrate(module)
    return torch.no_grad()


def _excluded_here(module: nn.Module, prefix: str, quantized: dict) -> list[str]:
    """Names (relative to ``module``) of its linears the streaming plan keeps in float."""
    return [
        name
        for name, child in module.named_modules()
        if name and isinstance(child, nn.Linear) and prefix + name not in quantized
    ]


def _calibrated_tensors(module: nn.Module, prefix: str, where: str) -> dict[str, torch.Tensor]:
    """What calibration chose in ``module``: ``input_scale`` of each static QLinear, ``k_scale``/``v_scale`` of
    each FP8 KV cache, and ``weight``/``weight_scale`` of each accuracy-mode QLinear."""
    from qfp8.nn.kv_cache import Float8KVAttentionMixin  # imports transformers: not at `qfp8 --help` time

    scales = {}
    for name, child in module.named_modules():
        full = prefix + name
        if isinstance(child, QLinear) and child.scheme.activations == "static":
            if child.input_scale is None:
                raise RuntimeError(f"{where}: {full} received no calibration input")
            scales[full + ".input_scale"] = child.input_scale.detach().clone()
        if isinstance(child, QLinear) and child.accuracy is not None:
            if child.accuracy_pending:
                raise RuntimeError(f"{where}: {full} received no calibration input for accuracy={child.accuracy!r}")
            # The weight itself: the accuracy mode chose it (and its scale) from the calibration inputs.
            scales[full + ".weight"] = child.canonical_weight().detach().clone()
            scales[full + ".weight_scale"] = child.weight_scale.detach().clone()
        if isinstance(child, Float8KVAttentionMixin):
            if child.k_scale is None or child.v_scale is None:
                raise RuntimeError(f"{where}: {full} recorded no K/V during calibration")
            scales[full + ".k_scale"] = child.k_scale.detach().clone()
            scales[full + ".v_scale"] = child.v_scale.detach().clone()
            if child.k_rounding_hessian is not None:  # written beside the checkpoint, not in it
                scales[full + ".k_rounding_hessian"] = child.k_rounding_hessian.detach().clone()
    return scales


def calibrate_layerwise(
    plan: CheckpointPlan,
    quantized: dict,
    quantize_args: dict,
    ids: torch.Tensor,
    batch_size: int | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Static scales of the float checkpoint ``plan``, quantized as ``quantize_args`` says, calibrated on ``ids``.

    ``quantized``: full names of the linears that are quantized (the others
    stay float). ``quantize_args``: keyword arguments of :func:`qfp8.quantize`
    but ``exclude`` (the scheme and ``kv_cache``). ``ids``: token ids
    ``[rows, T]`` (or a 1-D stream, cut into rows), run ``batch_size`` rows at
    a time (default: all at once). ``on_step(done, total)`` is called after
    the embedding and each layer. Returns ``{name: float32 [1]}`` for every
    ``input_scale``, ``k_scale`` and ``v_scale``, and with
    ``quantize_args["accuracy"]`` also each quantized linear's FP8 ``weight``
    and ``weight_scale`` (kept in memory: the FP8 checkpoint's size), named as
    ``qfp8.save_pretrained`` names them.
    """
    from transformers.cache_utils import DynamicCache

    model, tied, aliases = _calibration_model(plan, quantized)
    config, base = model.config, model.model
    layers = base.layers
    ids = calibration_rows(ids, config.vocab_size, getattr(config, "max_position_embeddings", None))
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"calibration batch size must be >= 1, got {batch_size}")
    batches = list(ids.split(batch_size or ids.shape[0]))
    use_cache = bool(getattr(config, "use_cache", True))
    calibrate_head = "lm_head" in quantized and (
        quantize_args.get("activations") == "static" or quantize_args.get("accuracy") is not None
    )
    total = 1 + len(layers) + calibrate_head
    step = on_step or (lambda done, total: None)
    scales: dict[str, torch.Tensor] = {}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        _materialize(base.embed_tokens, "model.embed_tokens.", plan, aliases)
        if tied and "lm_head" in quantized:
            # quantize ties the embedding to the FP8 head: its rows are the head's (round to nearest until
            # the end of calibration, as the head's own weight).
            scheme, table = quantized["lm_head"], base.embed_tokens.weight
            codes, scale = formats.quantize_weight(
                table, scheme.weight_dtype, scheme.weight_scale, scheme.block_size or None
            )
            rows = formats.dequantize_weight(codes, scale, scheme.block_size or None, table.dtype)
            base.embed_tokens.weight = nn.Parameter(rows, requires_grad=False)
            del codes, rows, table
        hidden = [base.embed_tokens(batch) for batch in batches]
        base.embed_tokens.to(torch.device("meta"))  # frees the embedding
        _return_freed_memory()
        shared = {}  # per row length: what every layer takes besides the hidden states
        for state in hidden:
            if state.shape[1] not in shared:
                shared[state.shape[1]] = _layer_inputs(model, state, use_cache)
        step(1, total)
        if quantize_args.get("kv_cache") is not None:
            from qfp8.nn.kv_cache import fused_attention_on  # imports transformers

            # As in a whole model with the FP8 cache: qfp8's attention, which records what key rounding needs.
            stack.enter_context(fused_attention_on(config))
        for index in range(len(layers)):
            prefix = f"model.layers.{index}."
            layer, layers[index] = layers[index], nn.Identity()  # the model keeps no reference to it
            _materialize(layer, prefix, plan)
            quantize(layer, **quantize_args, exclude=_excluded_here(layer, prefix, quantized))
            kind = _mask_kind(config, index)
            with _calibrating(layer):
                for b, state in enumerate(hidden):
                    inputs = shared[state.shape[1]]
                    out = layer(
                        state,
                        attention_mask=inputs["masks"][kind],
                        position_ids=inputs["position_ids"],
                        cache=DynamicCache(config=config) if use_cache else None,
                        use_cache=use_cache,
                        position_embeddings=inputs["position_embeddings"],
                    )
                    hidden[b] = out[0] if isinstance(out, tuple) else out
            scales.update(_calibrated_tensors(layer, prefix, str(plan.directory)))
            del layer, out
            _return_freed_memory()
            step(2 + index, total)
        if calibrate_head:
            scales.update(_calibrate_head(model, plan, aliases, quantize_args, hidden))
            step(total, total)
    return scales


def _calibration_model(plan: CheckpointPlan, quantized: dict) -> tuple[nn.Module, bool, dict | None]:
    """The meta-device model :func:`calibrate_layerwise` fills layer by layer, whether its head is tied to its
    embedding, and the names a tied table is stored under; ValueError for a checkpoint it cannot calibrate."""
    check_architecture(plan.config, plan.directory)
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    # A tied table may be stored under either name (qfp8's own SmolLM2 folder holds lm_head.weight).
    aliases = {embed_name: head_name, head_name: embed_name}
    table_name = embed_name if embed_name in plan.tensors else head_name
    if table_name not in plan.tensors:
        raise ValueError(f"{plan.directory}: the checkpoint has no {embed_name!r}")
    table_stored = plan.tensors[table_name]
    model = _meta_model(plan.directory, table_stored.file.info(table_stored.name).dtype)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if not tied and table_name != embed_name:
        raise ValueError(f"{plan.directory}: the checkpoint has no {embed_name!r}")
    outside = [name for name in quantized if not name.startswith("model.layers.") and name != "lm_head"]
    if outside:
        raise ValueError(f"{plan.directory}: layer-by-layer calibration cannot reach quantized linears {outside[:5]}")
    return model, tied, aliases if tied else None


def _calibrate_head(model: nn.Module, plan: CheckpointPlan, aliases, quantize_args: dict, hidden: list) -> dict:
    """The quantized lm_head's calibrated tensors, from the last layer's ``hidden`` states."""
    base = model.model
    _materialize(base.norm, "model.norm.", plan)
    holder = nn.Module()  # quantize() replaces children: lm_head needs a parent
    holder.lm_head = model.lm_head
    _materialize(holder, "", plan, aliases)
    quantize(holder, **{**quantize_args, "kv_cache": None}, exclude=())
    with calibrate(holder):
        for state in hidden:
            holder.lm_head(base.norm(state))
    return _calibrated_tensors(holder, "", str(plan.directory))
