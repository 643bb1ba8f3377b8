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

compressed-tensors' float type is e4m3fn only; weights stored as e5m2 or
e4m3fnuz keep their dtype in the safetensors header, which is where qfp8's
readers take the weight dtype from (vLLM would refuse such a checkpoint).
"""

from __future__ import annotations

import fnmatch
import re

import torch

from qfp8 import formats
from qfp8.nn.scheme import QuantizationScheme

QUANT_METHOD = "compressed-tensors"
FLOAT_FORMAT = "float-quantized"


def _float_args(strategy: str, dynamic: bool, **extra) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": dynamic, **extra}  # fmt: skip


def scheme_to_group(scheme: QuantizationScheme, targets: list[str]) -> dict:
    """One compressed-tensors ``config_group`` for ``scheme``."""
    if scheme.weight_scale == "block":
        weights = _float_args("block", False, block_structure=list(scheme.block_size))
    else:
        weights = _float_args(scheme.weight_scale, False)
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


def kv_cache_scheme(dtype: torch.dtype | None) -> dict | None:
    if dtype is None:
        return None
    return _float_args("tensor", False)


KV_DTYPE_KEY = "qfp8_kv_cache_dtype"
TOKEN_MSE_KEY = "qfp8_token_mse_groups"
# The dynamic activation strategies of compressed-tensors that qfp8 reads.
DYNAMIC_STRATEGIES = ("tensor", "token", "group")


def kv_cache_dtype(qc: dict, where: str) -> torch.dtype | None:
    """The FP8 dtype of a ``quantization_config``'s KV cache (None: no FP8 cache)."""
    if not qc.get("kv_cache_scheme"):
        return None
    name = qc.get(KV_DTYPE_KEY, "float8_e4m3fn")
    try:
        return formats.fp8_dtype(name)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {KV_DTYPE_KEY} {name!r} is not an FP8 dtype") from error


def build_quantization_config(
    schemes: dict[str, QuantizationScheme], ignored: list[str], kv_cache_dtype: torch.dtype | None
) -> dict:
    """The ``quantization_config`` of a model whose quantized linears are ``schemes`` (name -> scheme)."""
    by_scheme: dict[QuantizationScheme, list[str]] = {}
    for name, scheme in schemes.items():
        by_scheme.setdefault(scheme, []).append(name)
    schemes_of = {f"group_{i}": scheme for i, scheme in enumerate(by_scheme)}
    if len(by_scheme) == 1:
        groups = {"group_0": scheme_to_group(schemes_of["group_0"], ["Linear"])}
    else:
        groups = {name: scheme_to_group(scheme, by_scheme[scheme]) for name, scheme in schemes_of.items()}
    config = {
        "quant_method": QUANT_METHOD,
        "format": FLOAT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignored),
        "kv_cache_scheme": kv_cache_scheme(kv_cache_dtype),
        "global_compression_ratio": None,
        "sparsity_config": {},
    }
    if kv_cache_dtype is not None and kv_cache_dtype != torch.float8_e4m3fn:
        config[KV_DTYPE_KEY] = str(kv_cache_dtype).removeprefix("torch.")
    token_mse = [
        name for name, s in schemes_of.items() if s.activations == "dynamic" and s.activation_scale == "token-mse"
    ]
    if token_mse:
        config[TOKEN_MSE_KEY] = token_mse
    return config


def token_mse_groups(qc: dict, where: str) -> list[str]:
    """The config groups whose dynamic per-token scales qfp8 searches (``token-mse``)."""
    names = qc.get(TOKEN_MSE_KEY) or []
    groups = qc.get("config_groups") or {}
    if not isinstance(names, list) or any(name not in groups for name in names):
        raise ValueError(f"{where}: {TOKEN_MSE_KEY} must list config_groups names, got {names!r}")
    return names


# ------------------------------------------------------------------ reading


def _check_float8(args: dict, where: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(
            f"{where}: qfp8 reads 8-bit float quantization, got type={args.get('type')!r} "
            f"num_bits={args.get('num_bits')!r}"
        )


def group_to_scheme(
    group: dict, where: str, weight_dtype: torch.dtype = torch.float8_e4m3fn, token_mse: bool = False
) -> QuantizationScheme:
    """The :class:`QuantizationScheme` of one compressed-tensors ``config_group``.

    ``token_mse``: the group is listed under ``qfp8_token_mse_groups``; its
    dynamic per-token activations become ``token-mse``.
    """
    weights = group.get("weights")
    if not weights:
        raise ValueError(f"{where}: config group has no 'weights' entry; qfp8 reads weight-quantized groups only")
    _check_float8(weights, f"{where}.weights")
    strategy = weights.get("strategy")
    block_size = ()
    if strategy == "block":
        block = weights.get("block_structure")
        if isinstance(block, str):  # older compressed-tensors wrote "128x128"
            block = [int(part) for part in block.lower().split("x")]
        block_size = formats._check_block_size(tuple(block or ()))
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}.weights: unsupported strategy {strategy!r}; expected tensor, channel or block")
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
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == class_name or target == name or fnmatch.fnmatchcase(name, target)
