"""The model's skeleton: built with its parameters on ``meta``, its quantized modules replaced by meta ``QLinear``
(``QExperts``) modules of the checkpoint's scheme."""

from __future__ import annotations

import torch
from torch import nn

from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn.attention import use_packed_sdpa
from qfp8.nn.conv import conv_skeleton
from qfp8.nn.experts import QExperts, find_fused_experts, use_fp8_experts

__all__ = ["build_model", "build_skeleton"]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def build_skeleton(model: nn.Module, schemes: dict[str, QuantizationScheme]) -> None:
    """Replaces the named ``nn.Linear`` modules (and fused experts parameters) by meta ``QLinear`` modules
    (``QExperts``) of their scheme (in place)."""
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    fused = {item.name: item for item in find_fused_experts(model)}
    for name, scheme in schemes.items():
        if name in fused:
            _experts_skeleton(fused[name], scheme)
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the checkpoint quantizes module {name!r}, which the model does not have") from None
        if isinstance(module, QLinear):
            continue  # an alias already replaced
        skeleton = conv_skeleton(module, scheme, name)  # a convolution's (or GPT-2's Conv1D's), else None
        if skeleton is not None:
            for alias in aliases[id(module)]:
                _set_submodule(model, alias, skeleton)
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"the checkpoint quantizes module {name!r}, but the model's module is {type(module).__name__}, "
                "not nn.Linear (nor nn.Conv1d / nn.Conv2d)"
            )
        qlinear = QLinear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            scheme=scheme,
            dtype=module.weight.dtype,
            device=torch.device("meta"),
        )
        qlinear.label = name  # error messages name the module
        if scheme.activations == "static":
            qlinear.input_scale = torch.ones(1, device="meta")  # a slot for the stored scale
        for alias in aliases[id(module)]:
            _set_submodule(model, alias, qlinear)
    uniform = set(schemes.values())
    model.qfp8_scheme = uniform.pop() if len(uniform) == 1 else None
    use_packed_sdpa(model)  # as quantize does: one-token grouped-query steps pack their heads, compiled too


def _experts_skeleton(item, scheme: QuantizationScheme) -> None:
    param = item.module._parameters[item.attr]
    count, out_features, in_features = param.shape
    qexperts = QExperts(count, out_features, in_features, scheme, param.dtype, device=torch.device("meta"))
    qexperts.name_experts(item.name)
    if scheme.activations == "static":
        for expert in qexperts.experts:
            expert.input_scale = torch.ones(1, device="meta")  # a slot for the stored scale
    delattr(item.module, item.attr)
    setattr(item.module, item.attr, qexperts)
    use_fp8_experts(item.module)


def _empty_weights():
    """Parameters on meta, buffers computed for real (they are not in checkpoints)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        return torch.device("meta")
    return init_empty_weights(include_buffers=False)


def build_model(
    transformers, config, dtype: torch.dtype | None = None, bare_fallback: bool = False, trust_remote_code: bool = False
) -> nn.Module:
    """The class config.json's ``architectures`` names (a classifier, an encoder-decoder, a headless model),
    else a causal LM; with ``bare_fallback`` (the CLI, which only needs the module names), else the bare model,
    and a config none of these takes is a one-line ValueError. The checkpoint's own code (``auto_map``) runs
    only with ``trust_remote_code`` (see qfp8/checkpoint/remote_code.py); transformers is never left to prompt."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    auto_kwargs = {**kwargs, "trust_remote_code": trust_remote_code}
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        # Only a class made for this config: a hand-edited architectures could name another model's.
        if (
            isinstance(cls, type)
            and issubclass(cls, transformers.PreTrainedModel)
            and isinstance(config, cls.config_class)
        ):
            return cls._from_config(config, **kwargs)
    if not bare_fallback:
        return transformers.AutoModelForCausalLM.from_config(config, **auto_kwargs)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto.from_config(config, **auto_kwargs)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            last = error
    first_line = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
    architectures = getattr(config, "architectures", None) or []
    raise ValueError(
        f"transformers cannot build a {getattr(config, 'model_type', '?')} model "
        f"({', '.join(architectures) or 'no architectures in config.json'}) to find its linear layers: {first_line}"
    )
