"""What vLLM and transformers refuse or cannot run in an otherwise valid qfp8 checkpoint.

Each rule names the reader's code it follows. The writers warn with :func:`save_warnings`
(:mod:`qfp8.checkpoint.compat` adds vLLM's CPU engine), and ``qfp8 inspect`` prints
:func:`vllm_incompatibilities`.
"""

from __future__ import annotations

import re

import torch

from qfp8 import formats
from qfp8.checkpoint.config import (
    EXPERT_NAME,
    FUSED_LAYERS,
    QFP8_METHOD,
    QFP8_METHOD_KEY,
    Layer,
    channel_written,
    qfp8_only_reasons,
    scheme_to_group,
)
from qfp8.nn.scheme import QuantizationScheme

__all__ = [
    "VLLM_EXPERT_PARTS",
    "VLLM_FLOAT_LINEARS",
    "name_pattern",
    "problem_lines",
    "save_warnings",
    "transformers_incompatibilities",
    "vllm_incompatibilities",
]

_SHOWN_NAMES = 6


def name_pattern(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.)", r"\1*", name)


def _vllm_args(scheme: QuantizationScheme | None, as_channel: bool = False) -> dict | None:
    """What vLLM sees of a layer's scheme: its config_group args (e4m3fnuz and e4m3fn weights look the same;
    ``as_channel``: per-tensor weights written as channel scales, :func:`channel_written`)."""
    if scheme is None:
        return None
    group = scheme_to_group(scheme, [], as_channel)
    del group["targets"]
    return group


def problem_lines(found: dict[str, list[str]]) -> list[str]:
    """One line per rule broken: the modules' name patterns (the first few), their count, the rule."""
    lines = []
    for message, names in found.items():
        unique = list(dict.fromkeys(names))
        shown = ", ".join(unique[:_SHOWN_NAMES]) + (
            f" and {len(unique) - _SHOWN_NAMES} more" if len(unique) > _SHOWN_NAMES else ""
        )
        lines.append(f"{shown} ({len(names)} module{'s' if len(names) != 1 else ''}): {message}")
    return lines


# A MoE expert's checkpoint name: transformers stores experts as "<...>.experts.<e>.<part>".
_EXPERT_PART = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.([^.]+)$")
# The expert parts vLLM's CompressedTensorsMoEMethod.get_moe_method looks up, as "<experts>.0.<part>".
VLLM_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_GATE_UP_PARTS = ("gate_proj", "up_proj", "w1", "w3")  # vLLM's w13 (Mixtral's names too)
# Linears vLLM builds without a quantization method whatever the config says (checkpoint leaf name -> why).
VLLM_FLOAT_LINEARS = {
    "shared_expert_gate": "Qwen2MoeSparseMoeBlock builds shared_expert_gate as a plain torch.nn.Linear "
    "(vllm/model_executor/models/qwen2_moe.py), so Qwen2MoeModel.load_weights finds no parameter for its "
    "weight_scale (KeyError); keep it float (qfp8.quantize and qfp8 quantize do)",
}
_EXCLUDE_EXPERTS = "exclude=['lm_head', '*experts.gate_up_proj', '*experts.down_proj']"


def _moe_activations(scheme: QuantizationScheme) -> str:
    """A MoE scheme's input activations as vLLM reads them."""
    if scheme.activations == "static":
        return "static per-tensor"
    if scheme.activation_scale == "token-mse":
        return "dynamic per-token (token-mse, saved as dynamic per-token)"
    return {"token": "dynamic per-token", "tensor": "dynamic per-tensor", "group": "dynamic 1x128 group"}[
        scheme.activation_scale
    ]


def _vllm_fused_moe_takes(scheme: QuantizationScheme) -> bool:
    """Whether vLLM's CompressedTensorsW8A8Fp8MoEMethod takes the W8A8 ``scheme``: per-tensor weights with
    per-tensor activations (static or dynamic), per-channel weights with dynamic per-token ones, block weights."""
    strategy = "tensor" if scheme.activations == "static" else scheme.activation_scale
    if scheme.weight_scale == "tensor":
        return strategy == "tensor"
    if scheme.weight_scale == "channel":
        return scheme.activations == "dynamic" and strategy in ("token", "token-mse")
    return True  # block: with static inputs, the block + static rule's


def _moe_problems(layers: dict[str, Layer], one_scheme: bool, add) -> None:
    """The rules of vLLM's fused MoE layers (see :func:`vllm_incompatibilities`). ``one_scheme``: the config has
    one group, targeting ``Linear``, which vLLM's ``_add_fused_moe_to_target_scheme_map`` extends to FusedMoE."""
    moe: dict[str, dict[tuple[int, str], Layer]] = {}
    for name, layer in layers.items():
        match = _EXPERT_PART.match(name)
        if match:
            moe.setdefault(match[1], {})[(int(match[2]), match[3])] = layer
    lookup = (
        "CompressedTensorsMoEMethod.get_moe_method reads the layer's scheme (and the ignore list) for expert 0's "
        "names only ('<experts>.0.gate_proj', '.0.up_proj', '.0.down_proj')"
    )
    for prefix, parts in sorted(moe.items()):
        schemes = [scheme for scheme, _ in parts.values()]
        leaves = sorted({part for _, part in parts})
        vllm_named = set(leaves) <= set(VLLM_EXPERT_PARTS)
        if len({str(_vllm_args(scheme)) for scheme in schemes}) > 1:
            ignored = sum(scheme is None for scheme in schemes)
            kinds = sorted({"ignored" if scheme is None else scheme.describe() for scheme in schemes})
            add(
                f"MoE experts of one layer not all quantized alike ({ignored} of {len(schemes)} expert parts "
                f"ignored; {', '.join(kinds)}): vLLM fuses all experts of a layer into one FusedMoE with one scheme, and "
                f"{lookup}; quantize every expert of a layer with one scheme, or keep them all float",
                prefix,
            )
            continue
        scheme = schemes[0]
        if scheme is None:
            if not vllm_named and one_scheme:
                add(
                    f"MoE experts kept float under names vLLM does not look up ({'/'.join(leaves)}): {lookup}, "
                    "which these names never match, so the ignore list does not reach them and the layer takes the "
                    "checkpoint's one scheme (its 'Linear' target also covers FusedMoE): vLLM would read the float "
                    "experts as FP8 weights without their scales. Quantize these experts too (W8A8, as vLLM's fused "
                    "MoE takes it)",
                    prefix,
                )
            continue
        if not vllm_named and not one_scheme:
            add(
                f"MoE experts named {'/'.join(leaves)} in a checkpoint with several schemes (its config groups "
                f"target module names): {lookup}, which no target names, so vLLM builds the layer unquantized and "
                "its loader fails on the experts' weight_scale; quantize the model with one scheme (its group then "
                "targets 'Linear', which vLLM also applies to FusedMoE)",
                prefix,
            )
        float_fix = f"; or keep them float ({_EXCLUDE_EXPERTS})" if vllm_named or not one_scheme else ""
        fixes = (
            "activations='dynamic' with weight_scale='channel' and activation_scale='token', weight_scale='tensor' "
            "with activations='static' (or dynamic activation_scale='tensor'), or weight_scale='block' with "
            "activations='dynamic' and activation_scale='group'" + float_fix
        )
        if scheme.activations is None:
            add(
                "MoE experts quantized weight-only (no input activations): vLLM has no FP8 weight-only fused-MoE "
                "method. CompressedTensorsMoEMethod.get_moe_method sends per-channel weights to its WNA16 branch, "
                "which raises for format 'float-quantized' (it takes 'pack-quantized' integers), and per-tensor or "
                "block weights match no method (RuntimeError 'Unsupported FusedMoe scheme', or an AttributeError on "
                "the missing input_activations). Quantize the experts W8A8 as its CompressedTensorsW8A8Fp8MoEMethod "
                f"takes them: {fixes}",
                prefix,
            )
        elif not _vllm_fused_moe_takes(scheme):
            add(
                f"MoE experts with {scheme.weight_scale} weight scales and {_moe_activations(scheme)} input "
                "activations: vLLM's CompressedTensorsW8A8Fp8MoEMethod takes per-tensor weights with per-tensor "
                "activations (static or dynamic), per-channel weights with dynamic per-token activations, or block "
                f"weights with dynamic activations, and asserts block weights for any other pairing. Use {fixes}",
                prefix,
            )
        elif scheme.weight_scale == "block":
            bn = scheme.block_size[0]
            rows = {shape[0] for (_, part), (_, shape) in parts.items() if part in _GATE_UP_PARTS and shape}
            for n in sorted(row for row in rows if row % bn):
                add(
                    f"MoE experts' gate/up N = {n} is not a multiple of block_n = {bn}: vLLM's "
                    "CompressedTensorsW8A8Fp8MoEMethod.create_weights raises (the gate and up halves of its fused "
                    "w13 weight must each be a multiple of block_n)",
                    prefix,
                )


def vllm_incompatibilities(layers: dict[str, Layer]) -> list[str]:
    """What vLLM refuses or cannot run in a compressed-tensors checkpoint of ``layers`` (name -> scheme, shape).

    One line per rule broken, naming the modules (layer numbers as ``*``). The rules, as read in vLLM's source
    (the commits of the versions read):

    - block weight scales with static input scales (CompressedTensorsW8A8Fp8 asserts);
    - the shards of a layer vLLM fuses (q/k/v_proj, gate/up_proj) not all quantized alike or not all ignored;
    - W8A8 block scales vLLM's block path cannot run: bn != bk, K not a multiple of bn; and, W8A8 and W8A16 alike,
      a fused shard other than the last with N not a multiple of bn (validate_fp8_block_shape, which
      CompressedTensorsW8A16Fp8 calls too since it takes block weights, 02e43002; at aa63715b it refused them);
    - a quantized ``lm_head``: vLLM's ParallelLMHead is a VocabParallelEmbedding, not a LinearBase, and
      CompressedTensorsConfig.get_quant_method gives it no scheme (be696453); newer versions (vLLM's API docs,
      2026) take one only from a config group naming it, never from the ``Linear`` target. Unquantized, its
      loader fails on ``lm_head.weight_scale``;
    - a quantized Qwen2-MoE ``shared_expert_gate`` (:data:`VLLM_FLOAT_LINEARS`; qwen2_moe.py 002fb907);
    - MoE experts (``...experts.<e>.<part>``), which vLLM fuses per layer into one FusedMoE with one scheme,
      looked up by expert 0's gate_proj/up_proj/down_proj names (CompressedTensorsMoEMethod.get_moe_method,
      13436117 and 0043d6b5): experts of a layer not all quantized alike or not all ignored; float experts named
      otherwise (Mixtral's w1/w2/w3) under a one-scheme config, whose ``Linear`` target vLLM extends to FusedMoE;
      quantized ones named otherwise under a config with several groups (which target module names);
      weight-only experts (no FP8 weight-only fused-MoE method); W8A8 pairings that
      CompressedTensorsW8A8Fp8MoEMethod refuses (d938d56f, 045d7575: it takes tensor + tensor, channel + dynamic
      token, block + dynamic), and block experts whose gate/up N is not a multiple of bn (it raises).
    """
    found: dict[str, list[str]] = {}

    def add(message: str, name: str) -> None:
        found.setdefault(message, []).append(name_pattern(name))

    one_scheme = len({scheme for scheme, _ in layers.values() if scheme is not None}) == 1
    expanded = channel_written({name: scheme for name, (scheme, _) in layers.items() if scheme is not None})
    fused: dict[tuple[str, str], dict[str, Layer]] = {}
    for name in sorted(layers):  # the same order for a model and for a checkpoint's sorted tensors
        scheme, shape = layers[name]
        parent, _, leaf = name.rpartition(".")
        for fused_name, shards in FUSED_LAYERS.items():
            if leaf in shards and not _EXPERT_PART.match(name):  # experts: the MoE rules below
                fused.setdefault((parent, fused_name), {})[leaf] = (scheme, shape)
        _layer_problems(name, leaf, scheme, shape, add)
    _fused_problems(fused, expanded, add)
    _moe_problems(layers, one_scheme, add)
    return problem_lines(found)


def _layer_problems(name: str, leaf: str, scheme, shape, add) -> None:
    """:func:`vllm_incompatibilities`' rules on one layer: a quantized lm_head or float-only Linear, and block
    scales vLLM cannot run."""
    if scheme is not None and leaf == "lm_head":
        add(
            "a quantized lm_head: vLLM builds lm_head as a ParallelLMHead, a VocabParallelEmbedding and no "
            "LinearBase, which CompressedTensorsConfig.get_quant_method gives no compressed-tensors scheme (newer "
            "vLLM takes one only from a config group naming lm_head, never from the 'Linear' target qfp8 writes "
            "for a one-scheme model); unquantized, its loader fails on lm_head.weight_scale. Keep lm_head float "
            "(the default exclude)",
            name,
        )
    if scheme is not None and leaf in VLLM_FLOAT_LINEARS:
        add(f"a quantized {leaf}: vLLM's {VLLM_FLOAT_LINEARS[leaf]}", name)
    if scheme is None or scheme.weight_scale != "block":
        return
    bn, bk = scheme.block_size
    if scheme.activations == "static":
        add(
            "block weight scales with static input scales: vLLM's CompressedTensorsW8A8Fp8 asserts "
            "(no static-input kernel for block weights); use dynamic activations with activation_scale='group'",
            name,
        )
    if scheme.activations is None:
        return  # the two rules below are those of vLLM's W8A8 block path (CompressedTensorsW8A8Fp8)
    if bn != bk:
        add(
            f"block size [{bn}, {bk}]: vLLM quantizes a block layer's input in 1 x block_n groups and its "
            "block GEMM asserts cdiv(K, block_k) == K / block_n, so it needs block_n == block_k",
            name,
        )
    if shape is not None and shape[1] % bn:
        add(
            f"K = {shape[1]} is not a multiple of block_n = {bn}: vLLM quantizes a block layer's input in "
            f"1 x {bn} groups and asserts K % {bn} == 0",
            name,
        )


def _fused_problems(fused: dict, expanded, add) -> None:
    """:func:`vllm_incompatibilities`' rules on the shards of each layer vLLM fuses (``fused``: (parent, fused
    name) -> {shard: layer}; ``expanded``: the per-tensor schemes written as channel scales)."""
    for (parent, fused_name), shards in fused.items():
        order = [leaf for leaf in FUSED_LAYERS[fused_name] if leaf in shards]
        views = [_vllm_args(shards[leaf][0], shards[leaf][0] in expanded) for leaf in order]
        where = (parent + "." if parent else "") + fused_name
        if any(view != views[0] for view in views):
            states = ", ".join(
                f"{leaf} {'ignored' if shards[leaf][0] is None else shards[leaf][0].describe()}" for leaf in order
            )
            add(
                f"{'/'.join(order)} ({states}): vLLM fuses them into {fused_name} and requires all shards "
                "quantized with one scheme or all ignored",
                where,
            )
            continue
        for leaf in order[:-1]:
            scheme, shape = shards[leaf]
            if scheme is None or scheme.weight_scale != "block" or shape is None:
                continue
            bn = scheme.block_size[0]
            if shape[0] % bn:
                older = (
                    ", which CompressedTensorsW8A16Fp8 calls for W8A16 block layers; older vLLM (commit aa63715b) "
                    "refuses block weights without input activations outright: 'Unsupported weight strategy=block'"
                    if scheme.activations is None
                    else ""
                )
                add(
                    f"{leaf} N = {shape[0]} is not a multiple of block_n = {bn}: vLLM fuses "
                    f"{'/'.join(order)} into {fused_name} and requires every shard but the last to be a multiple "
                    f"of block_n (validate_fp8_block_shape{older})",
                    where,
                )


def transformers_incompatibilities(layers: dict[str, Layer]) -> list[str]:
    """What transformers' compressed-tensors integration cannot load or run in a checkpoint of ``layers``.

    - Dynamic 1 x 128 group activations need K to be a multiple of 128: transformers reshapes each input
      row into [K / 128, 128] groups, which fails for any other K (qfp8 runs the partial last group).
      MoE experts are exempt: transformers dequantizes them to float when it loads them.
    - Block weight scales on MoE experts: that dequantization takes one scale per row, and the load fails.
    """
    size = formats.ACTIVATION_GROUP_SIZE
    found: dict[str, list[str]] = {}
    for name in sorted(layers):
        scheme, shape = layers[name]
        if scheme is None:
            continue
        expert = bool(EXPERT_NAME.search(name))
        if expert and scheme.weight_scale == "block":
            found.setdefault(
                "MoE experts with block weight scales: transformers dequantizes experts with one scale per row "
                "when it loads them and fails on block scales; use weight_scale='channel' for the experts "
                "(or keep them float) for a checkpoint transformers loads",
                [],
            ).append(name_pattern(name))
        elif (
            not expert
            and scheme.activations == "dynamic"
            and scheme.activation_scale == "group"
            and shape is not None
            and shape[1] % size
        ):
            found.setdefault(
                f"in_features not a multiple of {size} with activation_scale='group': transformers splits each "
                f"input row into groups of {size} and fails on the forward pass; use activation_scale='token' for "
                "these modules",
                [],
            ).append(name_pattern(name))
    return problem_lines(found)


def save_warnings(layers: dict[str, Layer], kv_cache_dtype: torch.dtype | None) -> list[str]:
    """The warning a writer gives for ``layers`` (name -> scheme, shape): none for a standard checkpoint.

    A checkpoint marked ``qfp8_method: "qfp8"`` (:func:`qfp8_only_reasons`) gets that warning only: vLLM
    and transformers refuse it whole.
    """
    schemes = {name: scheme for name, (scheme, _) in layers.items() if scheme is not None}
    reasons = qfp8_only_reasons(schemes, kv_cache_dtype)
    if reasons:
        return [
            f"{' and '.join(reasons)}: compressed-tensors' float type means float8_e4m3fn to vLLM and "
            "transformers, which cannot represent this checkpoint. It is written without quant_method (marked "
            f"{QFP8_METHOD_KEY}: {QFP8_METHOD!r}), so that vLLM and transformers refuse it instead of loading it "
            "wrong; qfp8.from_pretrained reads it. Use float8_e4m3fn (weights and KV cache) for a checkpoint "
            "other readers serve"
        ]
    messages = []
    problems = vllm_incompatibilities(layers)
    if problems:
        messages.append(
            "vLLM cannot load or run this checkpoint as written (qfp8 and transformers read it):\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    problems = transformers_incompatibilities(layers)
    if problems:
        messages.append(
            "transformers cannot load or run this checkpoint as written (qfp8 reads it):\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    return messages
