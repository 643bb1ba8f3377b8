"""Fused mixture-of-experts weights in FP8.

transformers 5 keeps a MoE layer's experts as 3-D parameters of one module
(``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``), and its eager forward multiplies by one expert at a time:
``F.linear(x, self.gate_up_proj[e])``. :class:`QExperts` takes such a
parameter's place: ``experts.gate_up_proj[e]`` is then expert ``e``'s
:class:`ExpertWeight`, whose ``F.linear`` is a call of the
:class:`~qfp8.QLinear` holding that expert (same scheme, no bias): its kernel
on the pre-packed weight, the input quantized as the scheme says (W8A8), and
calibration recorded, so the model's own forward runs unchanged.

The forward qfp8 selects is :func:`experts_forward`, registered in
transformers' ``ExpertsInterface`` as the ``"qfp8"`` experts
implementation: the eager computation without the eager loop's per-expert
masking, calling each hit expert's QLinear directly.

Static activation scales: one per fused weight, shared by its experts (the
largest any expert measured), as vLLM's fused MoE kernels take it; an expert
no calibration token reached gets it too.

The experts are not submodules: the module's state dict has the stacked
canonical tensors under the parameter's name (``gate_up_proj.weight``
``[E, N, K]``, ``gate_up_proj.weight_scale`` ``[E, ...]``,
``gate_up_proj.input_scale`` ``[E, 1]``), which the checkpoint writer splits
into transformers' per-expert names.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qfp8.library.experts import ExpertsLinear, expert_rows
from qfp8.nn.qlinear import QLinear, take_expected
from qfp8.nn.scheme import QuantizationScheme
from qfp8.tensor import Float8WeightTensor

__all__ = [
    "ExpertWeight",
    "FusedExperts",
    "QExperts",
    "checkpoint_parts",
    "find_fused_experts",
    "experts_forward",
    "register_experts_implementation",
    "scheme_reason",
    "use_fp8_experts",
]

# The 3-D parameters of transformers' experts modules that hold one [out, in] matrix per expert.
FUSED_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")


class ExpertWeight(Float8WeightTensor):
    """One expert's FP8 weight, bound to the :class:`~qfp8.QLinear` that holds it.

    ``F.linear(x, w)`` is ``layer(x)``: the layer's kernel and activation
    scheme (an unbound :class:`~qfp8.Float8WeightTensor` multiplies
    weight-only), and calibration sees the input. Every other use, and a
    copy (transposed, detached, moved, rebuilt by ``torch.compile``), is a
    plain weight.
    """

    layer: QLinear | None = None

    @classmethod
    def bound(cls, layer: QLinear) -> ExpertWeight:
        weight = cls(
            layer.qweight,
            layer.weight_scale,
            layer.packing,
            layer.scheme.block_size,
            layer.orig_dtype,
            layer.out_features,
            layer.in_features,
        )
        weight.layer = layer
        return weight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear and len(args) >= 2 and type(args[1]) is ExpertWeight:
            weight, kwargs = args[1], kwargs or {}
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.layer is not None and not weight.transposed:
                y = weight.layer(args[0])
                return y if bias is None else y + bias
        return super().__torch_function__(func, types, args, kwargs)


class NotATensorError(TypeError, AttributeError):
    """A tensor attribute asked of :class:`QExperts` (an AttributeError too, so ``hasattr`` says False)."""


class QExperts(nn.Module):
    """``num_experts`` FP8 weights ``[out_features, in_features]``, indexed as the 3-D parameter they replace."""

    def __init__(
        self,
        num_experts: int,
        out_features: int,
        in_features: int,
        scheme: QuantizationScheme,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.out_features = out_features
        self.in_features = in_features
        self.scheme = scheme
        self.experts = [
            QLinear(in_features, out_features, bias=False, scheme=scheme, dtype=dtype, device=device)
            for _ in range(num_experts)
        ]

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, scheme: QuantizationScheme, name: str, accuracy: str | None = None
    ) -> QExperts:
        """Quantizes the float ``weight`` ``[E, N, K]`` expert by expert (refusing NaN/Inf, naming the expert).

        ``accuracy="scale"``: each expert's scales are chosen again at the end
        of :func:`qfp8.calibrate` from the inputs routed to it; an expert no
        calibration token reached keeps its round-to-nearest weights.
        """
        if weight.dim() != 3:
            raise ValueError(f"{name}: fused experts weight must be 3-D [experts, out, in], got {list(weight.shape)}")
        module = cls(weight.shape[0], weight.shape[1], weight.shape[2], scheme, weight.dtype, device="meta")
        module.experts = [
            QLinear.from_weight(w, None, scheme, f"{name}[{e}]", accuracy) for e, w in enumerate(weight.detach())
        ]
        module.name_experts(name)
        return module

    def name_experts(self, name: str) -> None:
        """Names each expert ``f"{name}[e]"`` in its error messages (``name``: this module's)."""
        for label, expert in self.named_experts(name):
            expert.label = label

    # ------------------------------------------------------------ the 3-D view
    def __getitem__(self, index) -> ExpertWeight:
        if isinstance(index, torch.Tensor) and index.numel() != 1 or isinstance(index, (slice, list, tuple)):
            raise TypeError(
                f"QExperts ({self.extra_repr()}) is indexed one expert at a time, got {type(index).__name__}"
                + (f" of shape {list(index.shape)}" if isinstance(index, torch.Tensor) else "")
                + "; an experts implementation that gathers several experts' weights cannot run FP8 experts: "
                + USE_FP8_IMPLEMENTATION
            )
        e = int(index)
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"expert {e} of QExperts with {self.num_experts} experts")
        return ExpertWeight.bound(self.experts[e])

    def __len__(self) -> int:
        return self.num_experts

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_experts, self.out_features, self.in_features))

    @property
    def packing(self) -> str:
        return self.experts[0].packing if self.experts else ""

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.experts[0].orig_dtype

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme.describe()}, kernel={self.packing}"
        )

    def __setstate__(self, state):
        # Unpickled in another process (torch.load of a whole model): the model's config still names the
        # "qfp8" experts implementation, which that process has not registered yet.
        super().__setstate__(state)
        register_experts_implementation()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or not hasattr(torch.Tensor, name):
                raise
        raise NotATensorError(
            f"QExperts ({self.extra_repr()}) is not a tensor (asked for .{name}): an experts implementation that "
            f"takes the 3-D weights whole cannot run FP8 experts; {USE_FP8_IMPLEMENTATION}"
        )

    def named_experts(self, name: str) -> list[tuple[str, QLinear]]:
        """``(f"{name}[e]", expert)`` for every expert, ``name`` being this module's."""
        return [(f"{name}[{e}]", expert) for e, expert in enumerate(self.experts)]

    def _apply(self, fn, recurse=True):
        for expert in self.experts:
            expert._apply(fn, recurse)
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------ calibration
    def start_calibration(self) -> None:
        for expert in self.experts:
            expert.start_calibration()

    def abort_calibration(self) -> None:
        for expert in self.experts:
            expert.abort_calibration()

    def end_calibration(self) -> None:
        reached = [e for e in self.experts if e._calibration_amax is not None]
        pending = [e for e in self.experts if e.accuracy_pending]
        for expert in self.experts:
            expert.end_calibration()
        if len(pending) > sum(e.accuracy_pending for e in self.experts):
            # Calibration reached this layer: an expert the routing never chose keeps its nearest rounding
            # (it has no inputs to fit) rather than holding its float weight and blocking freeze and save.
            for expert in self.experts:
                expert.float_weight = None
        if self.scheme.activations == "static" and reached:
            # One scale for the fused weight: the largest measured (what vLLM's fused MoE takes), for every
            # expert, those no calibration token reached included.
            shared = torch.stack([e.input_scale for e in reached]).amax(0)
            for expert in self.experts:
                expert.input_scale = shared.clone()
                expert._bind_op()

    # ------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        states = []
        for expert in self.experts:
            state: dict[str, torch.Tensor] = {}
            expert._save_to_state_dict(state, "", keep_vars)
            states.append(state)
        for key in states[0]:
            destination[prefix + key] = torch.stack([state[key].detach() for state in states])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        first = self.experts[0]
        expected = {
            "weight": (self.shape, self.scheme.weight_dtype),
            "weight_scale": ((self.num_experts, *first.weight_scale.shape), torch.float32),
        }
        static = self.scheme.activations == "static"
        if static and first.input_scale is not None:  # calibrated: the scales are part of the state
            expected["input_scale"] = ((self.num_experts, 1), torch.float32)
        if strict:  # as QLinear: names this module never has (an input_scale unless static) are unexpected
            allowed = {*expected, "input_scale"} if static else set(expected)
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :] not in allowed:
                    unexpected_keys.append(key)
        loaded = take_expected(state_dict, prefix, expected, missing_keys, error_msgs)
        if len(loaded) < len(expected):
            return
        if static and "input_scale" not in expected and prefix + "input_scale" in state_dict:
            value = state_dict[prefix + "input_scale"]  # fills uncalibrated experts' empty slots
            if tuple(value.shape) != (self.num_experts, 1):
                error_msgs.append(
                    f"{prefix}input_scale: expected float [{self.num_experts}, 1], got {value.dtype} "
                    f"{list(value.shape)}"
                )
                return
            loaded["input_scale"] = value
        for e, expert in enumerate(self.experts):
            errors: list[str] = []
            expert._load_from_state_dict(
                {key: value[e] for key, value in loaded.items()}, "", local_metadata, True, [], [], errors
            )
            error_msgs.extend(f"{prefix}[{e}]: {error}" for error in errors)


class FusedExperts(NamedTuple):
    """A fused experts parameter of a model: ``module.<attr>``, named ``name`` (``<module name>.<attr>``)."""

    name: str
    module: nn.Module
    attr: str
    reason: str  # why it cannot be quantized ("" when it can)


def find_fused_experts(model: nn.Module, check_weights: bool = True) -> list[FusedExperts]:
    """Every 3-D float parameter of a transformers experts module (``@use_experts_implementation``).

    Quantizable are the layouts whose eager forward computes
    ``F.linear(x, param[e])``: not transposed, no bias, gate and up
    concatenated (not interleaved). ``check_weights=False`` judges the layout
    only (a meta-device build whose weights a checkpoint holds).
    """
    found = []
    for module_name, module in model.named_modules():
        if not hasattr(module, "is_transposed") or not hasattr(module, "config"):
            continue
        for attr in FUSED_PARAMETERS:
            param = module._parameters.get(attr)
            if param is None or param.dim() != 3:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            reason = ""
            if module.is_transposed:
                reason = (
                    f"{type(module).__name__} stores its experts transposed ([E, in, out]); qfp8 takes [E, out, in]"
                )
            elif getattr(module, "has_bias", False):
                reason = f"{type(module).__name__} has expert biases"
            elif attr == "gate_up_proj" and not getattr(module, "is_concatenated", True):
                reason = f"{type(module).__name__} interleaves gate and up rows"
            elif not check_weights:
                pass
            elif not param.is_floating_point() or param.dtype.itemsize == 1:
                reason = f"weight dtype {param.dtype} is not a float format"
            elif param.device.type == "meta":
                reason = "weight is on the meta device (offloaded, or never loaded)"
            found.append(FusedExperts(name, module, attr, reason))
    return found


def scheme_reason(scheme: QuantizationScheme, accuracy: str | None, out_features: int, parts: int) -> str:
    """Why a fused experts weight of ``out_features`` rows per expert, stored in checkpoints as ``parts``
    equal row blocks (gate and up: 2), cannot take ``scheme`` and ``accuracy`` ("" when it can)."""
    if accuracy == "gptq":
        return (
            "accuracy='gptq' is not built for fused MoE experts (it would hold [in, in] statistics per expert; "
            "accuracy='scale' reaches them)"
        )
    rows = out_features // parts
    if scheme.weight_scale == "block" and parts > 1 and rows % scheme.block_size[0]:
        halves = "gate and up halves" if parts == 2 else f"{parts} parts"
        return (
            f"block rows of {scheme.block_size[0]} would straddle the {halves} ({rows} rows each) that "
            "checkpoints store apart"
        )
    return ""


def checkpoint_parts(attr: str) -> int:
    """Row blocks each expert's matrix of the fused parameter ``attr`` is stored as (gate and up: 2)."""
    return 2 if attr == "gate_up_proj" else 1


def _expert_linear(weights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``x @ weights[expert]^T`` for a :class:`QExperts` (the expert's QLinear) or a float 3-D parameter."""
    if isinstance(weights, QExperts):
        return weights.experts[expert](x)
    return F.linear(x, weights[expert])


def _check_expert_ids(module: nn.Module, lowest: int, highest: int) -> None:
    # num_experts itself marks a pair another rank computes (expert parallelism), as in transformers' loop.
    if lowest < 0 or highest > module.num_experts:
        bad = lowest if lowest < 0 else highest
        raise ValueError(
            f"{type(module).__name__}: top_k_index holds expert {bad}; this layer has experts 0 to "
            f"{module.num_experts - 1}"
        )


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts computation (its ``eager`` one), registered as the ``"qfp8"`` implementation.

    The token-expert pairs are sorted by expert once; each expert hit then
    costs its two QLinear calls, its gate, and a slice, instead of the eager
    loop's mask, ``where`` and ``index_add_`` per expert (which, on a
    128-expert top-8 layer at one token, cost more than half the FP8 matmuls'
    time). The
    routing-weighted sum runs in float32 (as transformers' ``grouped_mm``
    does), then takes the input's dtype.
    """
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.shape[-1]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    if torch.compiler.is_compiling() and _traceable(up, self.down_proj):
        return _experts_forward_traced(self, up, hidden_states, top_k_index, top_k_weights)

    def expert_output(expert: int, x: torch.Tensor) -> torch.Tensor:
        h = _expert_linear(up, expert, x)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _expert_linear(self.down_proj, expert, h)
        return self.post_expert_norm(h) if self.has_post_expert_norm else h

    if num_tokens == 1:  # one token (decoding a single sequence): its experts in turn, one weighted sum
        ids = top_k_index.reshape(-1).tolist()
        _check_expert_ids(self, min(ids, default=0), max(ids, default=0))
        pairs = [(k, e) for k, e in enumerate(ids) if e < self.num_experts]
        if not pairs:
            return torch.zeros_like(hidden_states)
        outs = torch.cat([expert_output(e, hidden_states) for _, e in pairs]).float()
        weights = top_k_weights.reshape(-1)[[k for k, _ in pairs]].float()
        return (weights @ outs).reshape(1, hidden_dim).to(hidden_states.dtype)
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    if expert_ids.numel():
        _check_expert_ids(self, int(expert_ids[0]), int(expert_ids[-1]))
    tokens = order // num_top_k
    selected = hidden_states[tokens]
    out = torch.zeros(len(order), hidden_dim, dtype=torch.float32, device=hidden_states.device)
    for expert, rows in expert_rows(expert_ids, self.num_experts):  # ids past the experts: not this rank's (EP)
        out[rows] = expert_output(expert, selected[rows])
    out *= top_k_weights.reshape(-1)[order, None]
    final = torch.zeros(num_tokens, hidden_dim, dtype=torch.float32, device=hidden_states.device)
    return final.index_add_(0, tokens, out).to(hidden_states.dtype)


def _traceable(up, down) -> bool:
    """Whether a traced graph can run the layer through ``torch.ops.qfp8.experts_linear``: both weights FP8
    experts and none calibrating (a gradient goes through :class:`ExpertsLinear`)."""
    return (
        isinstance(up, QExperts)
        and isinstance(down, QExperts)
        and not any(e.calibrating for e in (*up.experts, *down.experts))
    )


def _experts_linear(weights: QExperts, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    experts, first = weights.experts, weights.experts[0]
    static = first.scheme.activations == "static"
    grad = torch.is_grad_enabled() and x.requires_grad
    return (ExpertsLinear.apply if grad else torch.ops.qfp8.experts_linear)(
        x,
        expert_ids,
        [e.qweight for e in experts],
        [e.weight_scale for e in experts],
        [e.input_scale for e in experts] if static else [],
        first.packing,
        first.scheme.weight_scale,
        list(first.scheme.block_size),
        first.scheme.activation_mode,
        first.scheme.activation_dtype,
        weights.out_features,
        weights.in_features,
    )


def _experts_forward_traced(
    self: nn.Module, up: QExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """:func:`experts_forward` in a traced graph: the same arithmetic with no data-dependent Python (each
    expert's rows go to its kernel inside ``experts_linear``), so ``fullgraph=True`` compiles it and a new
    routing does not recompile. Expert ids are checked inside the op, when it runs."""
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    tokens = order // top_k_index.shape[-1]
    h = _experts_linear(up, hidden_states[tokens], expert_ids)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _experts_linear(self.down_proj, h, expert_ids)
    if self.has_post_expert_norm:
        h = self.post_expert_norm(h)
    out = h.float() * top_k_weights.reshape(-1)[order, None].float()
    final = torch.zeros(num_tokens, hidden_dim, dtype=torch.float32, device=hidden_states.device)
    return final.index_add_(0, tokens, out).to(hidden_states.dtype)


IMPLEMENTATION = "qfp8"
USE_FP8_IMPLEMENTATION = (
    f"set config._experts_implementation to {IMPLEMENTATION!r} (what qfp8.quantize sets) or 'eager'"
)


def register_experts_implementation() -> bool:
    """Registers :func:`experts_forward` as transformers' ``"qfp8"`` experts implementation (False: this
    transformers has no experts registry)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION) is not experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    return True


def use_fp8_experts(module: nn.Module) -> None:
    """Makes transformers run ``module``'s experts through :func:`experts_forward` (registered as the
    ``"qfp8"`` experts implementation; transformers without that registry: its eager forward, which indexes
    the weights). The grouped and batched implementations take the 3-D tensors whole."""
    module.config._experts_implementation = IMPLEMENTATION if register_experts_implementation() else "eager"
