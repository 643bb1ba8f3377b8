"""``quantization_config`` (config.json) <-> :class:`QuantizationScheme`.

qfp8 writes compressed-tensors ``float-quantized`` configs, the format vLLM
and transformers load natively:

- one ``config_group`` per distinct scheme. A model with one scheme gets
  ``targets: ["Linear"]`` and an ``ignore`` list of the linear layers left in
  float; several schemes get each group's module names as targets.
- weights: ``strategy`` ``tensor`` | ``channel`` | ``block`` (with
  ``block_structure [bn, bk]``); ``input_activations``: ``null`` (W8A16),
  dynamic ``token`` / ``tensor`` / ``group`` (``group_size`` 128), or static
  ``tensor`` (the checkpoint then holds ``input_scale``).
- ``kv_cache_scheme``: FP8 per-tensor static, with ``k_scale``/``v_scale``
  per attention module. Its args cannot say e5m2 (compressed-tensors forbids
  extra fields there), so a cache stored in another FP8 type than e4m3fn is
  named by a top-level ``qfp8_kv_cache_dtype`` key (``quantization_config``
  ignores unknown keys). Without it the cache is e4m3fn.
- ``token-mse`` activations (qfp8's searched per-token scales) are written
  as dynamic ``token`` activations, which is what vLLM then computes; the
  top-level ``qfp8_token_mse_groups`` key lists their groups, so that qfp8
  itself searches again after loading.
- per-tensor weights are written as ``channel`` weights, the one scale in
  every row (qfp8/checkpoint/tensor_scales.py says why), except in groups
  holding MoE experts (vLLM's fused MoE takes per-tensor weights only with
  per-tensor activations); the top-level ``qfp8_tensor_weight_groups`` key
  lists those groups, which qfp8 reads back per tensor.

compressed-tensors' float type means e4m3fn to every reader (vLLM and
transformers allocate e4m3fn weights and copy the stored values into them, with
no dtype check). e4m3fnuz weights are written as they are: every e4m3fnuz value
but 16 small ones (the odd multiples of 2^-10 below 2^-6, finer than e4m3fn's
subnormal step 2^-9) is exact in e4m3fn; those few round when another reader converts them (a test
model: 46 of 589,824 weights, logits moved by 7.7e-7). A checkpoint with e5m2 weights or a KV cache that is not
e4m3fn cannot be said in compressed-tensors terms: it gets the same body
without ``quant_method``, marked ``qfp8_method: "qfp8"`` instead
(:func:`qfp8_only_reasons`). Both vLLM ("Unknown quantization method") and
transformers ("no `quant_method` attribute") then refuse the folder; with an
unknown ``quant_method`` such as "qfp8", transformers only warns and loads the
FP8 bytes without their scales. qfp8's readers take the weight dtype from the
safetensors header, and read the marked body exactly as ``"compressed-tensors"``.

:mod:`qfp8.checkpoint.reader_rules` lists what vLLM and transformers refuse or cannot run in an
otherwise valid checkpoint (the writers warn with it, ``qfp8 inspect`` prints it).
"""

from __future__ import annotations

import re

import torch

from qfp8 import formats
from qfp8.nn.scheme import QuantizationScheme

__all__ = [
    "DYNAMIC_STRATEGIES",
    "EXPERT_NAME",
    "FLOAT_FORMAT",
    "FUSED_LAYERS",
    "KV_DTYPE_KEY",
    "Layer",
    "MIXED_FORMAT",
    "QFP8_METHOD",
    "QFP8_METHOD_KEY",
    "QUANT_METHOD",
    "STANDARD_WEIGHT_DTYPES",
    "STORED_FP8_FORMATS",
    "TENSOR_WEIGHTS_KEY",
    "TIED_EMBEDDINGS_KEY",
    "TOKEN_MSE_KEY",
    "build_quantization_config",
    "channel_written",
    "group_to_scheme",
    "kv_cache_dtype",
    "kv_cache_scheme",
    "matches",
    "matching_group",
    "qfp8_only_reasons",
    "scheme_to_group",
    "tensor_weight_groups",
    "token_mse_groups",
]

QUANT_METHOD = "compressed-tensors"
# The same body, for what compressed-tensors cannot represent: written without quant_method (which other
# readers then refuse) and with QFP8_METHOD_KEY: QFP8_METHOD instead.
QFP8_METHOD = "qfp8"
QFP8_METHOD_KEY = "qfp8_method"
FLOAT_FORMAT = "float-quantized"
# compressed-tensors formats whose FP8 weights are stored as they are: "naive-quantized" (what it infers for
# weight-only FP8: its float compressor asks for input activations) holds the same bytes; "mixed-precision"
# says each config group carries its own format.
STORED_FP8_FORMATS = (FLOAT_FORMAT, "naive-quantized")
MIXED_FORMAT = "mixed-precision"
# Weight dtypes a compressed-tensors float checkpoint may hold: its readers take e4m3fn, and convert e4m3fnuz (exact
# but for its smallest subnormals, see the module docstring).
STANDARD_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Linears vLLM fuses into one layer: fused name -> shards, in vLLM's order (the last may end in a partial block).
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _float_args(strategy: str, dynamic: bool, **extra) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": dynamic, **extra}  # fmt: skip


def scheme_to_group(scheme: QuantizationScheme, targets: list[str], as_channel: bool = False) -> dict:
    """One compressed-tensors ``config_group`` for ``scheme``; ``as_channel``: its per-tensor weights are written
    as channel scales (:func:`channel_written`)."""
    if scheme.weight_scale == "block":
        weights = _float_args("block", False, block_structure=list(scheme.block_size))
    else:
        weights = _float_args("channel" if as_channel else scheme.weight_scale, False)
    if scheme.activations is None:
        inputs = None
    elif scheme.activations == "static":
        inputs = _float_args("tensor", False)
    elif scheme.activation_scale == "group":
        inputs = _float_args("group", True)
        inputs["group_size"] = formats.ACTIVATION_GROUP_SIZE
    else:
        strategy = "token" if scheme.activation_scale == "token-mse" else scheme.activation_scale
        inputs = _float_args(strategy, True)
    return {
        "targets": targets,
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
        "format": FLOAT_FORMAT,
    }


def kv_cache_scheme(dtype: torch.dtype | None, dynamic: bool = False) -> dict | None:
    """Per-tensor FP8 (static ``k_scale``/``v_scale``), or ``dynamic`` when the checkpoint holds no scales."""
    if dtype is None:
        return None
    return _float_args("tensor", dynamic)


KV_DTYPE_KEY = "qfp8_kv_cache_dtype"
# config.json (top level): {embedding: head} for each embedding that reads a quantized lm_head's rows (a
# QEmbedding). The checkpoint stores the embedding as the head's dequantized table, untied, which any
# loader reads; qfp8's ties them again.
TIED_EMBEDDINGS_KEY = "qfp8_tied_embeddings"
TOKEN_MSE_KEY = "qfp8_token_mse_groups"
TENSOR_WEIGHTS_KEY = "qfp8_tensor_weight_groups"  # groups of per-tensor weights written as channel scales
# The dynamic activation strategies of compressed-tensors that qfp8 reads.
DYNAMIC_STRATEGIES = ("tensor", "token", "group")


def kv_cache_dtype(qc: dict, where: str) -> torch.dtype | None:
    """The FP8 dtype of a ``quantization_config``'s KV cache (None: no FP8 cache).

    ``kv_cache_scheme`` must be symmetric 8-bit float, per tensor (static ``k_scale``/``v_scale``) or dynamic.
    """
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return None
    if not isinstance(scheme, dict):
        raise ValueError(f"{where}: kv_cache_scheme must be an object, got {scheme!r}")
    _check_float8(scheme, f"{where}: kv_cache_scheme")
    strategy = scheme.get("strategy") or "tensor"
    if strategy != "tensor" and not scheme.get("dynamic"):
        raise ValueError(
            f"{where}: kv_cache_scheme has static strategy {strategy!r}; qfp8 reads an FP8 KV cache with one "
            "k_scale/v_scale per attention layer (strategy 'tensor') or dynamic scales"
        )
    name = qc.get(KV_DTYPE_KEY, "float8_e4m3fn")
    try:
        return formats.fp8_dtype(name)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {KV_DTYPE_KEY} {name!r} is not an FP8 dtype") from error


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def qfp8_only_reasons(schemes: dict[str, QuantizationScheme], kv_cache_dtype: torch.dtype | None) -> list[str]:
    """What compressed-tensors cannot represent (e5m2 weights, a non-e4m3fn KV cache); empty for a standard model."""
    counts: dict[torch.dtype, int] = {}
    for scheme in schemes.values():
        if scheme.weight_dtype not in STANDARD_WEIGHT_DTYPES:
            counts[scheme.weight_dtype] = counts.get(scheme.weight_dtype, 0) + 1
    reasons = [f"{n} layer{'s have' if n != 1 else ' has'} {_dtype_name(dtype)} weights" for dtype, n in counts.items()]
    if kv_cache_dtype is not None and kv_cache_dtype != torch.float8_e4m3fn:
        reasons.append(f"the KV cache is {_dtype_name(kv_cache_dtype)}")
    return reasons


def build_quantization_config(
    schemes: dict[str, QuantizationScheme],
    ignored: list[str],
    kv_cache_dtype: torch.dtype | None,
    kv_cache_dynamic: bool = False,
    model_names: dict[str, str] | None = None,
) -> dict:
    """The ``quantization_config`` of a model whose quantized linears are ``schemes`` (name -> scheme).

    ``kv_cache_dynamic``: the FP8 KV cache has no calibrated scales (none are written).

    ``model_names``: checkpoint module name -> the module's name in the model transformers builds, where the two
    differ (Llava: ``language_model.lm_head`` is the model's ``lm_head``). compressed-tensors under transformers 5
    matches ``ignore`` and the targets against the model's names, vLLM and older transformers against the
    checkpoint's: both are listed. A layer of ``ignore`` named only by its checkpoint name would be quantized by
    transformers 5 with an uninitialised scale (NaN logits for a Llava with ``lm_head`` kept in float).

    ``quant_method`` is ``"compressed-tensors"``; when :func:`qfp8_only_reasons` finds something there is no
    ``quant_method`` but ``qfp8_method: "qfp8"`` (see the module docstring).
    """
    model_names = model_names or {}

    def both(names: list[str]) -> list[str]:
        return sorted({*names, *(model_names[n] for n in names if n in model_names)})

    by_scheme: dict[QuantizationScheme, list[str]] = {}
    for name, scheme in schemes.items():
        by_scheme.setdefault(scheme, []).append(name)
    schemes_of = {f"group_{i}": scheme for i, scheme in enumerate(by_scheme)}
    expanded = channel_written(schemes)
    groups = {
        name: scheme_to_group(
            scheme, ["Linear"] if len(by_scheme) == 1 else both(by_scheme[scheme]), scheme in expanded
        )
        for name, scheme in schemes_of.items()
    }
    qfp8_only = bool(qfp8_only_reasons(schemes, kv_cache_dtype))
    config = {
        QFP8_METHOD_KEY if qfp8_only else "quant_method": QFP8_METHOD if qfp8_only else QUANT_METHOD,
        "format": FLOAT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": both(ignored),
        "kv_cache_scheme": kv_cache_scheme(kv_cache_dtype, kv_cache_dynamic),
        "global_compression_ratio": None,
        "sparsity_config": {},
    }
    if kv_cache_dtype is not None and (kv_cache_dtype != torch.float8_e4m3fn or qfp8_only):
        config[KV_DTYPE_KEY] = _dtype_name(kv_cache_dtype)  # a qfp8_method config always names it
    token_mse = [
        name for name, s in schemes_of.items() if s.activations == "dynamic" and s.activation_scale == "token-mse"
    ]
    if token_mse:
        config[TOKEN_MSE_KEY] = token_mse
    tensor_weights = [name for name, scheme in schemes_of.items() if scheme in expanded]
    if tensor_weights:
        config[TENSOR_WEIGHTS_KEY] = tensor_weights
    return config


EXPERT_NAME = re.compile(r"(^|\.)experts\.\d+\.")


def channel_written(schemes: dict[str, QuantizationScheme]) -> set[QuantizationScheme]:
    """The per-tensor schemes of ``schemes`` (checkpoint name -> scheme) that are written as channel scales: all
    but those of MoE experts, which vLLM's fused MoE takes per tensor with per-tensor activations only."""
    experts = {scheme for name, scheme in schemes.items() if EXPERT_NAME.search(name)}
    return {scheme for scheme in schemes.values() if scheme.weight_scale == "tensor" and scheme not in experts}


def _listed_groups(qc: dict, key: str, where: str) -> list[str]:
    names = qc.get(key) or []
    groups = qc.get("config_groups") or {}
    if not isinstance(names, list) or any(name not in groups for name in names):
        raise ValueError(f"{where}: {key} must list config_groups names, got {names!r}")
    return names


def token_mse_groups(qc: dict, where: str) -> list[str]:
    """The config groups whose dynamic per-token scales qfp8 searches (``token-mse``)."""
    return _listed_groups(qc, TOKEN_MSE_KEY, where)


def tensor_weight_groups(qc: dict, where: str) -> list[str]:
    """The config groups of per-tensor weights written as channel scales (:data:`TENSOR_WEIGHTS_KEY`)."""
    return _listed_groups(qc, TENSOR_WEIGHTS_KEY, where)


# ------------------------------------------------------------------ reading


def _check_float8(args: dict, where: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(
            f"{where}: qfp8 reads 8-bit float quantization, got type={args.get('type')!r} "
            f"num_bits={args.get('num_bits')!r}"
        )
    if args.get("symmetric", True) is not True:
        raise ValueError(
            f"{where}: symmetric={args.get('symmetric')!r} (asymmetric, with zero points) is not supported; qfp8 "
            "reads symmetric FP8 quantization only, as vLLM does"
        )


def group_to_scheme(
    group: dict,
    where: str,
    weight_dtype: torch.dtype = torch.float8_e4m3fn,
    token_mse: bool = False,
    tensor_weights: bool = False,
) -> QuantizationScheme:
    """The :class:`QuantizationScheme` of one compressed-tensors ``config_group``.

    ``token_mse``: the group is listed under ``qfp8_token_mse_groups``; its
    dynamic per-token activations become ``token-mse``. ``tensor_weights``: it
    is listed under ``qfp8_tensor_weight_groups``; its channel weights are per tensor.
    """
    weights = group.get("weights")
    if not weights:
        raise ValueError(f"{where}: config group has no 'weights' entry; qfp8 reads weight-quantized groups only")
    _check_float8(weights, f"{where}.weights")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights: dynamic weight scales are not a stored checkpoint qfp8 can read")
    if group.get("output_activations"):
        raise ValueError(
            f"{where}: output_activations quantization is not supported (qfp8, like vLLM's FP8 schemes, quantizes "
            "weights and inputs)"
        )
    strategy = weights.get("strategy")
    block_size = ()
    if strategy == "block":
        block = weights.get("block_structure")
        try:
            if isinstance(block, str):  # older compressed-tensors wrote "128x128"
                block = [int(part) for part in block.lower().split("x")]
            block_size = formats._check_block_size(tuple(block or ()))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{where}.weights: strategy 'block' needs block_structure [block_n, block_k] (two positive ints), "
                f"got {block!r}"
            ) from error
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}.weights: unsupported strategy {strategy!r}; expected tensor, channel or block")
    if tensor_weights:
        if strategy != "channel":
            raise ValueError(
                f"{where}: listed in {TENSOR_WEIGHTS_KEY} (per-tensor weights written as channel scales) but its "
                f"weights' strategy is {strategy!r}, not 'channel'"
            )
        strategy = "tensor"
    inputs = group.get("input_activations")
    activations, activation_scale = None, "token"
    if inputs:
        _check_float8(inputs, f"{where}.input_activations")
        a_strategy = inputs.get("strategy")
        if not inputs.get("dynamic"):
            if a_strategy != "tensor":
                raise ValueError(f"{where}.input_activations: static scales must be per tensor, got {a_strategy!r}")
            activations, activation_scale = "static", "tensor"
        else:
            if a_strategy not in DYNAMIC_STRATEGIES:
                raise ValueError(f"{where}.input_activations: unsupported dynamic strategy {a_strategy!r}")
            if a_strategy == "group" and inputs.get("group_size") not in (None, formats.ACTIVATION_GROUP_SIZE):
                raise ValueError(
                    f"{where}.input_activations: group_size {inputs.get('group_size')} is not supported "
                    f"(qfp8 uses {formats.ACTIVATION_GROUP_SIZE})"
                )
            activations, activation_scale = "dynamic", a_strategy
    if token_mse:
        if activation_scale != "token" or activations != "dynamic":
            raise ValueError(f"{where}: listed in {TOKEN_MSE_KEY} but its input activations are not dynamic per token")
        activation_scale = "token-mse"
    return QuantizationScheme(weight_dtype, strategy, block_size, activations, activation_scale)


def matches(name: str, class_name: str, target: str) -> bool:
    """compressed-tensors target matching: ``re:`` regex, a class name, or a module name."""
    return _match_rank(name, class_name, target) is not None


def _match_rank(name: str, class_name: str, target: str) -> int | None:
    """How specifically ``target`` names the module: 0 its name, 1 a ``re:`` pattern, 2 its class; None when it
    does not match. As compressed-tensors and vLLM match: no globs (``model.layers.*.mlp`` names nothing)."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) is not None else None
    if target == name:
        return 0
    return 2 if target == class_name else None


def matching_group(name: str, class_name: str, groups: dict) -> str | None:
    """The config group whose targets name the module most specifically (exact name, then ``re:``, then
    class), as compressed-tensors (and so transformers and vLLM) resolves several matching groups; the first
    listed among equals. None when no group matches."""
    best, best_rank = None, None
    for group_name, group in groups.items():
        ranks = [r for r in (_match_rank(name, class_name, t) for t in group.get("targets") or []) if r is not None]
        if ranks and (best_rank is None or min(ranks) < best_rank):
            best, best_rank = group_name, min(ranks)
    return best


# ------------------------------------------------------------ other readers

# A layer of a checkpoint: its scheme (None: kept in float, in ``ignore``) and weight shape [N, K] if known.
Layer = tuple[QuantizationScheme | None, tuple[int, ...] | None]
