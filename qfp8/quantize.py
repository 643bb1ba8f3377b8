"""``quantize`` / ``calibrate`` / ``freeze`` and the report of what was done.

``quantize`` runs in stages: its arguments checked, the plan (:mod:`qfp8.quantize_plan`, the one planner, which
``qfp8 quantize`` runs too: what is quantized, what stays float and why), every weight checked, then the modules
replaced. The report types live in
:mod:`qfp8.quantize_report`, calibration and ``freeze`` in :mod:`qfp8.calibration`; every name is importable
from here too.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from qfp8 import formats, rounding
from qfp8.calibration import calibrate, check_calibrated, freeze
from qfp8.library import memory
from qfp8.library.routing import REFERENCE_KERNEL
from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn.conv import is_convolution, is_transformers_conv1d, linear_from_conv1d, quantize_convolution
from qfp8.nn.experts import QExperts, use_fp8_experts
from qfp8.quantize_plan import (
    DEFAULT_EXCLUDE,
    DEFAULT_KEEPS_TIED,
    FLOAT_LINEARS,
    KV_CACHE_DTYPES,
    META_REASON,
    PLAIN_LINEAR_SUBCLASSES,
    QuantizePlan,
    _carry_hooks,
    _set_submodule,
    exclude_patterns,
    excluded_by,
    float_linear_reason,
    linear_class_reason,
    plan_quantization,
    tie_embedding,
    tied_float_holders,
    tied_head_note,
    unmatched_exclude_notes,
    untie_config,
    untie_problem,
    unwrapped,
)
from qfp8.quantize_report import (
    OTHER_WEIGHTS_WARNING,
    OtherWeights,
    QuantizeReport,
    QuantizeResult,
    ReportEntry,
    other_kinds_clause,
    other_weight_kinds,
)

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_KEEPS_TIED",
    "FLOAT_LINEARS",
    "KV_CACHE_DTYPES",
    "META_REASON",
    "OTHER_WEIGHTS_WARNING",
    "OtherWeights",
    "PLAIN_LINEAR_SUBCLASSES",
    "QuantizeReport",
    "QuantizeResult",
    "ReportEntry",
    "calibrate",
    "check_calibrated",
    "enable_transformers_save",
    "exclude_patterns",
    "excluded_by",
    "float_linear_reason",
    "freeze",
    "linear_class_reason",
    "other_kinds_clause",
    "other_weight_kinds",
    "quantize",
    "tie_embedding",
    "tied_float_holders",
    "tied_head_note",
    "unmatched_exclude_notes",
    "untie_config",
    "untie_problem",
    "unwrapped",
]


def quantize(
    model: nn.Module,
    weights: str | None = "float8_e4m3fn",
    weight_scale: str = "channel",
    activations: str | None = None,
    activation_scale: str = "token",
    kv_cache: str | None = None,
    exclude=DEFAULT_EXCLUDE,
    block_size=formats.DEFAULT_BLOCK_SIZE,
    accuracy: str | None = None,
) -> QuantizeResult:
    """Replaces every matching ``nn.Linear`` of ``model`` by a ``QLinear`` (in place); transformers' ``Conv1D``
    (GPT-2's layers, weight ``[in, out]``) too, by a QLinear of its transposed weight.

    Weights are quantized now and packed for their device's kernel; static
    activation scales still need :func:`calibrate`, then :func:`freeze`.
    ``weights=None`` leaves every linear as it is (``kv_cache`` only).

    ``accuracy``: None (round to nearest, ``scale = amax / fmax``), ``"scale"``
    or ``"gptq"``: each weight is chosen again at the end of :func:`calibrate`
    to minimise its layer's output error on the calibration inputs (see
    ``qfp8/rounding.py``); the format is unchanged (FP8 weights with the same
    kind of scales). Needs a calibration pass before :func:`freeze`, and keeps
    the float weights in memory until then.

    ``activation_scale="token-mse"`` (dynamic activations): each token's scale
    is the one of 16 candidates ``amax / fmax * 2^(j/16)`` with the least
    squared rounding error, found at run time by qfp8's kernels (see
    :func:`qfp8.formats.token_mse_scale`). Saved checkpoints stay dynamic
    per-token ones: vLLM computes ``amax / fmax`` for them, qfp8 searches.
    ``exclude``: fnmatch patterns on a Linear's full dotted name or its tail
    (None: none); a pattern you give that matches no ``nn.Linear`` is warned
    about. A Linear whose weight is the same Parameter as a plain
    ``nn.Embedding``'s (a tied ``lm_head``, when the ``exclude`` you pass lets
    it be quantized: the default keeps any tied output layer float, BERT's
    decoder too) is quantized and the embedding becomes a
    :class:`qfp8.nn.embedding.QEmbedding` that reads its rows from the FP8
    weight (the float table goes; ``config.tie_word_embeddings`` is set false,
    as the saved checkpoint says). Tied to any other module kept in float, it
    stays in float, with a warning. A MoE gate that is an nn.Linear (Qwen2-MoE's ``shared_expert_gate``) stays in float
    whatever ``exclude`` says, as the routers do (:data:`FLOAT_LINEARS`). Hooks registered on a Linear
    move to its QLinear. A refused
    call (ValueError) leaves the model as it was.

    Fused MoE experts (transformers' 3-D ``experts.gate_up_proj`` /
    ``experts.down_proj``) are quantized too, expert by expert, with the same
    weight and activation scheme (static scales: one per fused weight, see
    qfp8/nn/experts.py; ``accuracy="gptq"`` leaves them float); their report
    entries carry ``experts``, and the model then runs its experts through
    qfp8's ``"qfp8"`` experts implementation (each hit expert's QLinear).
    ``exclude`` patterns match their ``<module>.<param>`` names.
    Returns ``(model, report)``.
    """
    outer, model, kv_cache = _checked_arguments(model, kv_cache)
    if weights is None:
        if kv_cache is None:
            raise ValueError("quantize: weights=None and kv_cache=None leave nothing to quantize")
        report = QuantizeReport()
        _set_up_attention(model, kv_cache, report, pack_heads=False)  # the FP8 cache's attention replaces sdpa
        return QuantizeResult(outer, report)
    scheme = QuantizationScheme.from_args(weights, weight_scale, activations, activation_scale, block_size)
    rounding.check_mode(accuracy)
    user_patterns = exclude is not DEFAULT_EXCLUDE
    exclude = exclude_patterns(exclude)
    _check_model_state(model, kv_cache)
    plan = plan_quantization(model, scheme, exclude, user_patterns, accuracy)
    # Validate every weight before changing anything: a refused weight
    # leaves the model as it was.
    _check_weights(plan)
    for note in plan.notes:
        warnings.warn(note.text, stacklevel=2)
    _replace_linears(model, plan, scheme, accuracy)
    _replace_experts(plan, scheme, accuracy)
    report = plan.report
    for head_name, embedding_name in plan.ties.items():
        tie_embedding(model, head_name, embedding_name)
        report.tied_embeddings.append(f"{embedding_name} reads its rows from {head_name}'s FP8 weight (one table)")
    _set_up_attention(model, kv_cache, report, pack_heads=True)
    _finish(model, scheme, report, plan.in_peft_model)
    return QuantizeResult(outer, report)


def _checked_arguments(model, kv_cache):
    """``(model as given, the model inside any wrapper, kv_cache as a name)``, or the TypeError / ValueError for a
    model or ``kv_cache`` that quantize cannot take."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize takes an nn.Module, got {type(model).__name__}")
    outer, model = model, unwrapped(model)  # the report's names and the model's attributes: the wrapped model's
    if isinstance(model, nn.Linear) and not isinstance(model, QLinear):
        raise ValueError(
            f"quantize: the model is itself an nn.Linear ({model.in_features} -> {model.out_features}), which "
            "cannot be replaced in place; wrap it, quantize the wrapper and take the layer back: "
            "qfp8.quantize(nn.Sequential(linear))[0][0]"
        )
    if isinstance(kv_cache, torch.dtype):  # taken as weights= takes one: torch.float8_e4m3fn
        kv_cache = str(kv_cache).removeprefix("torch.")
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; expected one of {list(KV_CACHE_DTYPES)}")
    return outer, model, kv_cache


def _check_model_state(model: nn.Module, kv_cache: str | None) -> None:
    """Refuses a model that is already quantized, or whose attention the FP8 KV cache cannot take."""
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (QLinear, QExperts)):
            raise ValueError(
                f"model is already quantized (module {name or type(model).__name__!r} is a {type(module).__name__}); "
                "quantize a float model once"
            )
    if kv_cache is not None:
        from qfp8.nn.kv_cache import check_supported

        # enable_fp8_kv_cache refuses such a model too, but only after the
        # Linears were swapped: check first so that a refusal changes nothing.
        try:
            check_supported(model, f"quantize(kv_cache={kv_cache!r})")
        except ValueError as error:
            raise ValueError(f"{error}. Pass kv_cache=None to quantize its weights only") from None


def _check_weights(plan: QuantizePlan) -> None:
    """The ValueError for a planned weight FP8 cannot represent (NaN/Inf, or float64 beyond float32's range)."""
    weights_of = {entry.name: item.module._parameters[item.attr] for entry, item in plan.experts}
    for entry in plan.report.quantized:
        weight = weights_of[entry.name] if entry.experts else plan.modules[entry.name].weight
        if formats.nonfinite_count(weight):
            raise ValueError(
                f"module {entry.name!r}: weight {list(weight.shape)} holds NaN/Inf values, which FP8 cannot "
                f"represent; fix the weight or pass exclude=[{entry.name!r}]"
            )
        if weight.dtype == torch.float64 and not torch.isfinite((amax := formats.abs_max(weight)).float()):
            raise ValueError(
                f"module {entry.name!r}: float64 weight {list(weight.shape)} holds values beyond float32's range "
                f"(|w| up to {float(amax):.3g}), which its float32 scales cannot cover; "
                f"fix the weight or pass exclude=[{entry.name!r}]"
            )


def _replace_linears(model: nn.Module, plan: QuantizePlan, scheme: QuantizationScheme, accuracy) -> None:
    """Puts a QLinear (QConv1d / QConv2d for a convolution) in place of every planned Linear, under all its names."""
    modules = plan.modules
    for entry in plan.report.quantized:
        if entry.experts:
            continue
        # Popped, not read: once swapped in, nothing here holds the float
        # Linear, so the model peaks at one layer above its float size.
        linear = modules.pop(entry.name)
        if is_convolution(linear):
            qlinear = quantize_convolution(linear, scheme, entry.name, accuracy)
        elif is_transformers_conv1d(linear):  # GPT-2's layers: a QLinear holding the weight transposed
            qlinear = linear_from_conv1d(linear, scheme, entry.name, accuracy)
        else:
            qlinear = QLinear.from_linear(linear, scheme, entry.name, accuracy=accuracy)
        _carry_hooks(linear, qlinear, entry.name, stacklevel=4)
        entry.scheme = scheme.describe() + (f" accuracy-{accuracy}" if accuracy else "")
        entry.kernel = qlinear.packing
        if is_convolution(linear) and qlinear.packing == REFERENCE_KERNEL.name:
            entry.reason = "; ".join(qlinear.kernel_notes)  # why a quantized convolution takes the reference route
        for name in [entry.name, *entry.aliases]:
            modules.pop(name, None)
            _set_submodule(model, name, qlinear)
        del linear, qlinear


def _replace_experts(plan: QuantizePlan, scheme: QuantizationScheme, accuracy) -> None:
    """Puts a QExperts in place of every planned fused experts weight and routes its module through qfp8's
    experts implementation."""
    for entry, item in plan.experts:
        if entry.quantized:
            qexperts = QExperts.from_weight(item.module._parameters[item.attr], scheme, entry.name, accuracy)
            delattr(item.module, item.attr)  # the float Parameter goes
            setattr(item.module, item.attr, qexperts)
            use_fp8_experts(item.module)
            entry.scheme = scheme.describe() + (f" accuracy-{accuracy}" if accuracy else "")
            entry.kernel = qexperts.packing
            del qexperts


def _finish(model: nn.Module, scheme: QuantizationScheme, report: QuantizeReport, in_peft_model: bool) -> None:
    """The last steps once the modules are replaced: peft's LoRA layers adopted, the scheme recorded, the model's
    own save_pretrained enabled, float tensors copied out of file mappings and freed memory returned."""
    if in_peft_model:  # peft's LoRA layers whose base is now FP8 merge by re-quantizing it
        from qfp8.integrations.peft import adopt_lora_layers

        adopt_lora_layers(model)
    model.qfp8_scheme = scheme
    if report.quantized:
        enable_transformers_save(model)
        # The float tensors left, if mapped from a file (transformers' loading), would keep every page
        # quantize read from it resident (see qfp8.library.memory).
        memory.copy_out_of_file_mappings(model)
    # glibc keeps freed heap memory (for a bf16 model, tens to hundreds of MB above the quantized model).
    memory.return_freed_memory()


def _attention_implementation(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _set_up_attention(model: nn.Module, kv_cache: str | None, report: QuantizeReport, pack_heads: bool) -> None:
    """Switches the model's attention (packed SDPA when ``pack_heads``, the FP8 cache's with ``kv_cache``) and
    fills the report's ``kv_cache`` and ``attention`` lines (the latter only when the implementation changed)."""
    from qfp8.nn.attention import PACKED_SDPA, use_packed_sdpa
    from qfp8.nn.kv_cache import FUSED_ATTENTION, enable_fp8_kv_cache

    before = _attention_implementation(model)
    if pack_heads:
        use_packed_sdpa(model)
    if kv_cache is not None:
        layers = enable_fp8_kv_cache(model, formats.fp8_dtype(kv_cache))
        report.kv_cache = (
            f"{kv_cache} in {len(layers)} attention module{'s' if len(layers) != 1 else ''}; static per-tensor "
            "scales once calibrated (qfp8.calibrate), dynamic per-head scales until then"
        )
    after = _attention_implementation(model)
    if after == before:
        return
    what = {
        PACKED_SDPA: "one-token steps pack grouped-query heads, compiled too",
        FUSED_ATTENTION: "decode steps read the FP8 KV cache in qfp8's kernel; prefill runs SDPA",
    }.get(after)
    report.attention = f"{before} -> {after}" + (f" ({what})" if what else "")


def enable_transformers_save(model: nn.Module) -> None:
    """Lets a quantized model's own ``save_pretrained`` write the compressed-tensors checkpoint
    :func:`qfp8.save_pretrained` writes: transformers' (and ``push_to_hub``) through qfp8's transformers quantizer
    (qfp8/integrations/transformers_quantizer.py), diffusers' by calling qfp8's writer (qfp8/checkpoint/diffusers.py)."""
    if "diffusers" in sys.modules:
        from qfp8.checkpoint.diffusers import enable_diffusers_save, is_diffusers_model

        if is_diffusers_model(model):
            enable_diffusers_save(model)
            return
    if "transformers" not in sys.modules or not hasattr(model, "config"):
        return  # not a transformers model: nothing of transformers' to hook
    from qfp8.integrations.transformers_quantizer import enable_transformers_save as enable

    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()  # a PeftModel's own save_pretrained writes the adapter alone
    enable(model)
