"""``Qfp8HfQuantizer``: what transformers' ``from_pretrained`` and ``save_pretrained`` call for ``quant_method: "qfp8"``.

Written against the ``HfQuantizer`` hooks of transformers 4.57 and 5.x:

- **float checkpoint** (quantized while loading): each linear weight the
  config quantizes is handed to qfp8 as transformers reads it (5.x: a
  quantize op, ``get_quantize_ops``; 4.57: ``create_quantized_param``), cast
  to the model's dtype and quantized at once; the float copy goes with it,
  so the process holds the FP8 model plus about one float layer. The
  QLinears are put in place after transformers has finished with the model
  (it re-creates every non-persistent buffer, which a QLinear's FP8 weight
  is, before its post-processing).
- **pre-quantized checkpoint** (``Qfp8Config().for_checkpoint(path)``):
  transformers builds the model on ``meta``; every stored tensor it reads is
  passed over, and qfp8's loader (:func:`qfp8.checkpoint.loader.load_checkpoint_into`)
  fills the model from the checkpoint files, as ``qfp8.from_pretrained`` does.
- **saving**: ``get_state_dict_and_metadata`` (called by ``save_pretrained``
  and ``push_to_hub`` before config.json is written) puts the
  compressed-tensors ``quantization_config`` of the model's layers on
  ``model.config``; the state dict of a qfp8 model is the checkpoint body
  (FP8 ``weight``, ``weight_scale``, ``input_scale``), its per-tensor weight
  scales written as channel scales as the config says (qfp8/checkpoint/tensor_scales.py).
"""

from __future__ import annotations

import bisect
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from qfp8.checkpoint import loader, sources
from qfp8.checkpoint.readers import open_checkpoint
from qfp8.integrations.transformers import Qfp8Config
from qfp8.library import memory
from qfp8.nn import QLinear
from qfp8.nn.conv import is_linear_layer, is_transformers_conv1d
from qfp8.nn.experts import find_fused_experts
from qfp8.quantize import QuantizeReport, _set_up_attention
from qfp8.quantize_plan import DEFAULT_EXCLUDE, PlanWording, exclude_patterns, plan_quantization

__all__ = [
    "LATE_PLACEMENT",
    "Qfp8HfQuantizer",
    "check_checkpoint_agrees",
    "enable_transformers_save",
    "prepare_save",
]

try:  # transformers 5: loading runs through conversion ops
    from transformers.core_model_loading import ConversionOps, WeightConverter
except ImportError:  # transformers 4: create_quantized_param
    ConversionOps = WeightConverter = None
# transformers 5 re-creates every non-persistent buffer (a QLinear's FP8 weight is one) after loading, and before
# its post-processing: qfp8's modules go in then. transformers 4 dispatches the model (device_map) before its
# post-processing, and re-creates only the buffers still on meta: they go in while loading.
LATE_PLACEMENT = WeightConverter is not None


def _is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize > 1


class Qfp8HfQuantizer(HfQuantizer):
    """Loads float checkpoints quantizing layer by layer, pre-quantized ones through qfp8's readers; saves
    compressed-tensors (see the module's docstring)."""

    requires_calibration = False
    quantization_config: Qfp8Config

    def __init__(self, quantization_config, **kwargs):
        if isinstance(quantization_config, dict):
            quantization_config = Qfp8Config.from_dict(quantization_config)
        super().__init__(quantization_config, **kwargs)
        self.targets: dict[str, list[str]] = {}  # module name -> its aliases (a shared Linear has several)
        self.quantized: dict[str, QLinear] = {}  # made while loading, put in place after (transformers 5)
        self.placed: set[str] = set()
        self.errors: list[str] = []  # weights refused while loading (NaN/Inf), raised after it
        self.report = QuantizeReport()
        self.checkpoint = self.plan = None

    # ------------------------------------------------------------ checks
    def validate_environment(self, *args, device_map=None, **kwargs):
        if isinstance(device_map, dict) and sources.single_device(device_map) is None:
            raise ValueError(
                f"Qfp8Config: device_map {device_map!r} spreads the model over several devices or disk; load it on "
                "one device (device_map='cpu', 'auto' on a CPU machine) or use qfp8.from_pretrained(path, "
                "device_map=..., offload_folder=...) on a quantized checkpoint, which dispatches it with accelerate"
            )

    def update_dtype(self, dtype):
        return dtype

    def update_device_map(self, device_map):
        # The CPU unless told otherwise, as transformers loads; named, so that what looks at the placement while
        # the model is still on meta (transformers 5's kernelize) takes the CPU.
        return {"": "cpu"} if device_map is None and LATE_PLACEMENT else device_map

    update_torch_dtype = update_dtype  # transformers 4's name

    @property
    def quantized_element_size(self) -> float | None:
        return 1.0

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (peft) train over the FP8 layers, through qfp8's autograd ops

    @property
    def is_compileable(self) -> bool:
        return True  # generate may compile its static-cache steps, as qfp8 models compile

    # ------------------------------------------------------------ before loading
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            self._open_checkpoint(model, checkpoint_files)
            # The checkpoint's own names (weight_scale, per-expert tensors...) are qfp8's loader's to map: none is
            # reported as unexpected.
            model._keys_to_ignore_on_load_unexpected = {".*"} if LATE_PLACEMENT else [".*"]
            return model
        config = self.quantization_config
        if config.weights is not None:
            self._plan(model)
        experts = [item.name for item in find_fused_experts(model)]
        if experts and config.weights is not None:
            warnings.warn(
                f"Qfp8Config: the {len(experts)} fused MoE experts weight(s) ({experts[0]}...) load in float; to "
                "quantize them too, load the float model and call qfp8.quantize(model)",
                UserWarning,
                stacklevel=2,
            )
        return model

    def _plan(self, model) -> None:
        """The layers to quantize as they are read: qfp8.quantize's plan of the model (transformers builds it on
        the meta device), less what loading keeps float (:func:`_loading_reason`) and the fused experts."""
        config = self.quantization_config
        exclude = config.exclude_argument()
        user_patterns = exclude is not DEFAULT_EXCLUDE
        scheme, patterns = config.scheme(), exclude_patterns(exclude)
        decided = plan_quantization(
            model, scheme, patterns, user_patterns, config.accuracy, from_files=True, wording=PlanWording("Qfp8Config")
        )
        tied = _tied_output_linear(model)
        for entry in decided.report.entries:
            module = decided.modules[entry.name]
            if entry.experts or not is_linear_layer(module):  # experts load in float (warned); no convolution
                continue
            entry.reason = entry.reason or _loading_reason(entry.name, module, tied, model) or ""
            entry.quantized = not entry.reason
            self.report.entries.append(entry)
            if entry.quantized:
                self.targets[entry.name] = [entry.name, *entry.aliases]

    def _open_checkpoint(self, model, checkpoint_files) -> None:
        """Reads the checkpoint's headers and plan (no tensor data), checking what this config asks of it."""
        if checkpoint_files:
            folder = Path(checkpoint_files[0]).parent
        else:  # transformers 4 does not pass the files: the path the config was read from
            folder = sources.checkpoint_folder(model.config.name_or_path)
        self.checkpoint = open_checkpoint(folder)
        self.plan = self.checkpoint.plan()
        if self.plan.format == "float":
            raise ValueError(
                f"{folder}: config.json has no FP8 quantization_config; pass quantization_config=Qfp8Config(...) "
                "(not config=...for_checkpoint(...)) to quantize a float checkpoint while loading"
            )
        check_checkpoint_agrees(self.quantization_config, self.plan, folder)

    def _load_checkpoint(self, model) -> None:
        if self.checkpoint is None:
            return  # loaded already
        _mark_initialized(model)
        loader.load_checkpoint_into(model, self.checkpoint, self.plan)
        self.checkpoint = None

    # ------------------------------------------------------------ while loading
    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return self.plan is not None  # transformers 4: every stored tensor goes to create_quantized_param (skipped)
        module_name, _, leaf = param_name.rpartition(".")
        return leaf == "weight" and module_name in self.targets

    check_quantized_param = param_needs_quantization  # transformers 4.5x's name

    def create_quantized_param(self, model, param_value, param_name, *args, **kwargs):
        """transformers 4: one tensor read from the checkpoint (pre-quantized: the first one loads them all, through
        qfp8's loader, once transformers has initialized what the checkpoint lacks)."""
        if not self.pre_quantized:
            self.quantize_weight(model, param_name, param_value)
        elif self.checkpoint is not None:
            self._load_checkpoint(model)

    def get_quantize_ops(self):
        return _QuantizeOp(self)

    def update_weight_conversions(self, weight_conversions, model):
        """transformers 5, pre-quantized: every stored tensor goes through an op that passes over it (qfp8's loader
        reads the files itself); qfp8 maps the checkpoint's names onto the model, so transformers' renamings go."""
        if not self.pre_quantized:
            return super().update_weight_conversions(weight_conversions, model)
        leaves = sorted({key.rpartition(".")[2] for key in self.checkpoint.where})
        return [WeightConverter(leaf, leaf, [_PassOverOp(self)]) for leaf in leaves]

    def get_weight_conversions(self):
        return []

    def get_new_dtype(self, converter, param, dtype):
        # transformers 5, pre-quantized: the stored tensors it reads are passed over; not cast on the way.
        return None if self.pre_quantized else super().get_new_dtype(converter, param, dtype)

    # transformers 4, pre-quantized: it loads one stored float tensor (its first, create_quantized_param, loads the
    # whole checkpoint through qfp8's loader), after it has initialized the model's missing tensors (none); the
    # other stored tensors count as unexpected, which keeps them out of its loading (and out of its report).
    def update_expected_keys(self, model, expected_keys, loaded_keys):
        if not self.pre_quantized:
            return expected_keys
        stored = set(loaded_keys)
        first = next((key for key in expected_keys if key in stored), None)
        return expected_keys if first is None else [first]

    def update_missing_keys(self, model, missing_keys, prefix):
        if self.pre_quantized:
            return []
        return [key for key in missing_keys if key.rpartition(".")[0] not in self.targets]

    def quantize_weight(self, model, param_name: str, value: torch.Tensor) -> None:
        """Quantizes the float weight ``param_name`` as it is read: a QLinear, kept aside until loading is done."""
        name = param_name.rpartition(".")[0]
        linear = model.get_submodule(name)
        dtype = linear.weight.dtype if _is_float_dtype(linear.weight.dtype) else value.dtype
        weight = value.detach().to(dtype)
        if is_transformers_conv1d(linear):  # GPT-2's layers store [in, out]: a QLinear holds [out, in]
            weight = weight.t()
        bias = linear.bias if linear.bias is not None else None
        qlinear = QLinear.from_weight(
            weight, bias, self.quantization_config.scheme(), name, self.quantization_config.accuracy, label=name
        )
        if is_transformers_conv1d(linear):
            qlinear.converted_from = type(linear).__name__
        if LATE_PLACEMENT:
            self.quantized[name] = qlinear
        else:
            self._place(model, name, qlinear)
        if _file_mapped(value):
            # A view of the memory-mapped checkpoint: its pages, read once to quantize, leave the process now
            # (else every weight read would stay resident until loading ends).
            loader.release_pages(value)
        del weight, value

    # ------------------------------------------------------------ after loading
    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            self._load_checkpoint(model)
        elif not self.pre_quantized:
            self._put_in_place(model)
        model.config.quantization_config = self.quantization_config
        model.qfp8_report = self.report
        if self.quantization_config.needs_calibration and not self.pre_quantized:
            _calibrate_or_warn(model, self.quantization_config)
        self.quantization_config.calibration = None  # the data is not kept with the model
        enable_transformers_save(model)
        memory.return_freed_memory()
        return model

    def _put_in_place(self, model) -> None:
        config = self.quantization_config
        if self.errors:
            raise ValueError(
                f"Qfp8Config: {self.errors[0]}"
                + (f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else "")
            )
        missing = [name for name in self.targets if name not in self.quantized and name not in self.placed]
        if missing:
            raise ValueError(
                f"Qfp8Config: the checkpoint holds no weight for {len(missing)} linear layer(s) to quantize: "
                f"{', '.join(missing[:5])}"
            )
        for name in list(self.quantized):
            self._place(model, name, self.quantized.pop(name))
        _set_up_attention(model, config.kv_cache, self.report, pack_heads=config.weights is not None)
        model.qfp8_scheme = config.scheme()

    def _place(self, model, name: str, qlinear: QLinear) -> None:
        """Puts ``qlinear`` where the Linear ``name`` (and its aliases) was, with the Linear's loaded bias."""
        linear = model.get_submodule(name)
        if linear.bias is not None and linear.bias.device.type != "meta":
            qlinear.bias = nn.Parameter(linear.bias.detach().to(qlinear.orig_dtype), requires_grad=False)
        for entry in self.report.entries:
            if entry.name == name:
                entry.scheme, entry.kernel = self.quantization_config.scheme().describe(), qlinear.packing
        for alias in self.targets[name]:
            model.set_submodule(alias, qlinear)
        self.placed.add(name)

    # ------------------------------------------------------------ saving
    def get_state_dict_and_metadata(self, model, *args, **kwargs):
        """Before ``save_pretrained`` writes config.json: the compressed-tensors config of the model's layers, and
        the state dict to write when it differs from ``model.state_dict()``."""
        prepare_save(model)
        return _channel_written_state(model), {}

    def _dequantize(self, model, dtype=None):
        raise NotImplementedError(
            "qfp8 models are not dequantized in place; load the float checkpoint again for a float model"
        )


class _QuantizeOp(ConversionOps if ConversionOps is not None else object):
    """transformers 5's quantize op: the float weight of one linear layer, quantized as soon as it is read."""

    def __init__(self, quantizer: Qfp8HfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict, *args, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        value = next(iter(input_dict.values()))
        if isinstance(value, list):
            (value,) = value
        try:
            self.quantizer.quantize_weight(model, full_layer_name, value)
        except ValueError as error:  # transformers would log it and go on: raised once loading is done
            self.quantizer.errors.append(str(error))
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {}


class _PassOverOp(ConversionOps if ConversionOps is not None else object):
    """transformers 5, pre-quantized: a stored tensor transformers read, left to qfp8's loader. Nothing the model
    has counts as missing: qfp8's loader fills (or names as missing) every tensor of the model."""

    def __init__(self, quantizer: Qfp8HfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict, *args, missing_keys=None, **kwargs):
        if missing_keys is not None:
            missing_keys.clear()
        return {}


def _file_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a file mapping (a view of a memory-mapped checkpoint)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    starts, ends = memory._file_mapped_ranges()
    address = tensor.untyped_storage().data_ptr()
    index = bisect.bisect_right(starts, address) - 1
    return index >= 0 and address < ends[index]


def _tied_output_linear(model) -> int | None:
    """id of the output Linear whose weight is the input embedding's (kept float: qfp8.quantize's default)."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    tied = getattr(model.config, "tie_word_embeddings", False)
    if head is not None and embedding is not None and tied:
        return id(head)
    return None


def _loading_reason(name: str, module: nn.Module, tied: int | None, model) -> str | None:
    """Why a layer qfp8.quantize's plan quantizes stays float when transformers loads the model: a tied output
    layer (qfp8.quantize ties an FP8 table, loading does not), ``_keep_in_fp32_modules``, a non-float weight."""
    if id(module) == tied:
        return "weight tied to the input embedding (kept in float; qfp8.quantize can tie an FP8 table)"
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if any(part in name.split(".") for part in keep):
        return "kept in float32 by the model (_keep_in_fp32_modules)"
    if not _is_float_dtype(module.weight.dtype):
        return f"weight dtype {module.weight.dtype} is not a float format"
    return None


def _mark_initialized(model) -> None:
    """transformers must not initialize what qfp8's loader fills."""
    for module in model.modules():
        module._is_hf_initialized = True


def check_checkpoint_agrees(config: Qfp8Config, plan, folder) -> None:
    """ValueError naming the argument and the file when the config asks a pre-quantized checkpoint for another scheme."""
    asked = config.changed()
    stored = set(plan.schemes.values())
    checks = {
        "weights": lambda s: str(s.weight_dtype).removeprefix("torch."),
        "weight_scale": lambda s: s.weight_scale,
        "activations": lambda s: s.activations,
        "activation_scale": lambda s: s.activation_scale if s.activations else "token",
        "block_size": lambda s: list(s.block_size) if s.block_size else None,
    }
    for argument, value in asked.items():
        if argument in ("exclude", "accuracy"):
            raise ValueError(
                f"Qfp8Config({argument}={value!r}): {folder} is already quantized; which layers are FP8 and how "
                "their weights were chosen is the checkpoint's (leave the argument out)"
            )
        if argument == "kv_cache":
            have = None if plan.kv_cache_dtype is None else str(plan.kv_cache_dtype).removeprefix("torch.")
            if have != value:
                raise ValueError(f"Qfp8Config(kv_cache={value!r}): {folder / 'config.json'} stores KV cache {have}")
            continue
        if argument == "block_size" and config.weight_scale != "block":
            continue
        found = sorted({repr(checks[argument](s)) for s in stored})
        if found != [repr(value)]:
            raise ValueError(
                f"Qfp8Config({argument}={value!r}): the checkpoint {folder / 'config.json'} stores "
                f"{argument} {', '.join(found) or 'none'}; qfp8 keeps a checkpoint's FP8 bytes and scales as they are "
                f"(leave {argument} out, or quantize the float model)"
            )


def _calibrate_or_warn(model, config: Qfp8Config) -> None:
    import qfp8

    if config.calibration is None:
        warnings.warn(
            "Qfp8Config: the model needs calibration data (static activation scales, an FP8 KV cache or an accuracy "
            "mode) and none was given: run `with qfp8.calibrate(model): model(batch)` over a few batches, then "
            "qfp8.freeze(model); save_pretrained refuses it until then (or pass Qfp8Config(calibration=batches))",
            UserWarning,
            stacklevel=2,
        )
        return
    with torch.no_grad(), qfp8.calibrate(model):
        for batch in config.calibration:
            if isinstance(batch, dict):
                model(**batch)
            else:
                model(batch)
    if any(isinstance(m, QLinear) for m in model.modules()):
        qfp8.freeze(model)


def prepare_save(model) -> None:
    """Puts on ``model.config`` the compressed-tensors ``quantization_config`` of its layers (what transformers'
    ``save_pretrained`` writes to config.json), after the checks ``qfp8.save_pretrained`` makes."""
    from qfp8.checkpoint import config as qconfig
    from qfp8.checkpoint.writer import model_layers, model_quantization_config, tied_embeddings
    from qfp8.quantize import check_calibrated

    check_calibrated(model, "save_pretrained")
    names: dict[str, str] = {}
    layers = model_layers(model, names)
    model.config.quantization_config = model_quantization_config(model, layers, names)
    tied = tied_embeddings(model)
    if tied:
        setattr(model.config, qconfig.TIED_EMBEDDINGS_KEY, tied)
    elif hasattr(model.config, qconfig.TIED_EMBEDDINGS_KEY):  # set when the model around this one (its head) was
        delattr(model.config, qconfig.TIED_EMBEDDINGS_KEY)


def _channel_written_state(model) -> dict | None:
    """``model.state_dict()`` with the per-tensor weight scales the config says are written per channel repeated over
    their rows, as qfp8.save_pretrained writes them; None when there are none."""
    from qfp8.checkpoint.tensor_scales import expand_rows
    from qfp8.checkpoint.writer import channel_written_schemes

    schemes = channel_written_schemes(model)
    if not schemes:
        return None
    state = model.state_dict()
    for name, module in model.named_modules():
        key = f"{name}.weight_scale" if name else "weight_scale"
        if isinstance(module, QLinear) and module.scheme in schemes and key in state:
            state[key] = expand_rows(module.weight_scale, module.out_features)
    return state


def enable_transformers_save(model: nn.Module) -> None:
    """Lets transformers' ``save_pretrained`` / ``push_to_hub`` of a model qfp8 quantized write the compressed-tensors
    checkpoint ``qfp8.save_pretrained`` writes (a model around it sharing its config writes that config too), and
    undoes transformers' kernelize, whose layers would run around qfp8's kernels."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(type(model), "save_pretrained", None)):
        return
    if getattr(model, "use_kernels", False):
        # transformers 5 kernelizes what it loads by default: a hub kernel layer (a fused MLP, say) reads its
        # Linears' weights itself, around qfp8's kernels (the FP8 weights then take the reference path).
        model.use_kernels = False
    existing = getattr(model, "hf_quantizer", None)
    if not isinstance(existing, Qfp8HfQuantizer):
        model.hf_quantizer = Qfp8HfQuantizer(Qfp8Config(), pre_quantized=True)
    try:
        prepare_save(model)
    except Exception:  # noqa: BLE001 (not calibrated yet, no QLinear...: the save hook runs it again, and raises)
        pass
