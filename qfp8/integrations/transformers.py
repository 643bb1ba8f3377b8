"""``Qfp8Config``: qfp8 as a transformers quantization method (``quant_method: "qfp8"``).

Importing this module registers ``"qfp8"`` with transformers' public
registration API (``register_quantization_config`` / ``register_quantizer``).
It is imported when ``qfp8.Qfp8Config`` is first used, and by ``import qfp8``
when transformers is already imported, so that a ``quantization_config``
dict naming ``"qfp8"`` works too. With it:

- a float checkpoint, ``from_pretrained(path, quantization_config=Qfp8Config(...))``:
  each linear layer is quantized as its weight is loaded (see
  :mod:`qfp8.integrations.transformers_quantizer`);
- a pre-quantized FP8 checkpoint (every format ``qfp8.from_pretrained``
  reads), ``from_pretrained(path, config=Qfp8Config().for_checkpoint(path))``:
  transformers builds the model, qfp8's loader fills it with the stored FP8
  bytes and scales, as they are.

transformers' own ``save_pretrained`` and ``push_to_hub`` of a qfp8 model
write the compressed-tensors checkpoint ``qfp8.save_pretrained`` writes.
"""

from __future__ import annotations

import os

from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from qfp8 import formats, rounding
from qfp8.nn.scheme import QuantizationScheme
from qfp8.quantize import DEFAULT_EXCLUDE, KV_CACHE_DTYPES, exclude_patterns

__all__ = [
    "ARGUMENTS",
    "QUANT_METHOD",
    "Qfp8Config",
    "SCHEME_ARGUMENTS",
    "register",
]

QUANT_METHOD = "qfp8"
# quantize's arguments, as Qfp8Config keeps them (and config.json would).
SCHEME_ARGUMENTS = ("weights", "weight_scale", "activations", "activation_scale", "kv_cache", "block_size")
ARGUMENTS = (*SCHEME_ARGUMENTS, "exclude", "accuracy")


class Qfp8Config(QuantizationConfigMixin):
    """qfp8's quantization, for transformers' ``from_pretrained(..., quantization_config=Qfp8Config(...))``.

    Takes :func:`qfp8.quantize`'s arguments (``weights``, ``weight_scale``,
    ``activations``, ``activation_scale``, ``kv_cache``, ``exclude``,
    ``block_size``, ``accuracy``), checked here: an unknown argument is a
    TypeError, a bad value a ValueError, both naming it.

    ``calibration``: for the schemes that need data (``activations="static"``,
    ``kv_cache``, an ``accuracy`` mode), an iterable of model inputs (token id
    tensors or dicts of keyword arguments) run under :func:`qfp8.calibrate`
    once the model is loaded, then :func:`qfp8.freeze`. Without it such a
    model loads uncalibrated with a UserWarning saying what to run (the
    two-step: ``with qfp8.calibrate(model): ...``, then ``qfp8.freeze(model)``);
    its ``save_pretrained`` refuses it until then. ``calibration`` never
    reaches config.json.

    On a pre-quantized checkpoint (:meth:`for_checkpoint`) the stored scheme
    is used; an argument given here must agree with it (``weights="float8_e5m2"``
    of an e4m3 checkpoint is a ValueError naming the argument and the file).
    """

    def __init__(
        self,
        weights: str | None = "float8_e4m3fn",
        weight_scale: str = "channel",
        activations: str | None = None,
        activation_scale: str = "token",
        kv_cache: str | None = None,
        exclude=DEFAULT_EXCLUDE,
        block_size=formats.DEFAULT_BLOCK_SIZE,
        accuracy: str | None = None,
        calibration=None,
        **unknown,
    ):
        unknown.pop("quant_method", None)  # from_dict's dicts carry it
        if unknown:
            raise TypeError(
                f"Qfp8Config got unknown argument(s) {sorted(unknown)}; it takes {list(ARGUMENTS)} and calibration"
            )
        self.quant_method = QUANT_METHOD
        self.weights = str(weights).removeprefix("torch.") if weights is not None else None
        self.weight_scale = weight_scale
        self.activations = activations
        self.activation_scale = activation_scale
        self.kv_cache = str(kv_cache).removeprefix("torch.") if kv_cache is not None else None
        self.exclude = list(exclude_patterns(exclude)) if exclude is not DEFAULT_EXCLUDE else list(DEFAULT_EXCLUDE)
        self._default_exclude = tuple(self.exclude) == DEFAULT_EXCLUDE
        self.block_size = list(block_size) if block_size is not None else None
        self.accuracy = accuracy
        self.calibration = calibration
        self.scheme()  # the checks quantize makes
        rounding.check_mode(accuracy)
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"Qfp8Config: unknown kv_cache {kv_cache!r}; expected one of {list(KV_CACHE_DTYPES)}")
        if weights is None and kv_cache is None:
            raise ValueError("Qfp8Config: weights=None and kv_cache=None leave nothing to quantize")
        if calibration is not None and not hasattr(calibration, "__iter__"):
            raise TypeError(
                f"Qfp8Config: calibration must be an iterable of model inputs, got {type(calibration).__name__}"
            )

    def changed(self) -> dict:
        """The arguments whose values are not quantize's defaults (what a pre-quantized checkpoint must agree with)."""
        defaults = Qfp8Config().to_dict()
        return {name: value for name, value in self.to_dict().items() if value != defaults[name]}

    def scheme(self) -> QuantizationScheme | None:
        """The QLinear scheme these arguments make (None: ``weights=None``, a KV cache only)."""
        if self.weights is None:
            return None
        try:
            block = tuple(self.block_size) if self.block_size is not None else formats.DEFAULT_BLOCK_SIZE
            return QuantizationScheme.from_args(
                self.weights, self.weight_scale, self.activations, self.activation_scale, block
            )
        except (ValueError, TypeError) as error:
            raise type(error)(f"Qfp8Config: {error}") from None

    def exclude_argument(self):
        """``exclude`` as quantize takes it (its default object when none was given, as quantize's warnings want)."""
        return DEFAULT_EXCLUDE if self._default_exclude else tuple(self.exclude)

    @property
    def needs_calibration(self) -> bool:
        return self.activations == "static" or self.kv_cache is not None or self.accuracy is not None

    def quantize_arguments(self) -> dict:
        """The keyword arguments of :func:`qfp8.quantize` this config stands for."""
        block = tuple(self.block_size) if self.block_size is not None else formats.DEFAULT_BLOCK_SIZE
        return dict(
            weights=self.weights,
            weight_scale=self.weight_scale,
            activations=self.activations,
            activation_scale=self.activation_scale,
            kv_cache=self.kv_cache,
            exclude=self.exclude_argument(),
            block_size=block,
            accuracy=self.accuracy,
        )

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, **{name: getattr(self, name) for name in ARGUMENTS}}

    def to_diff_dict(self) -> dict:  # transformers 4's to_json_string asks for it
        return self.to_dict()

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        if not isinstance(config_dict, dict):
            raise TypeError(f"Qfp8Config.from_dict takes a dict, got {type(config_dict).__name__}")
        config = cls(**config_dict)
        return (config, kwargs) if return_unused_kwargs else config

    def for_checkpoint(self, path: str | os.PathLike, **config_kwargs):
        """The transformers config of the pre-quantized checkpoint ``path`` with its ``quantization_config``
        replaced by this one: ``from_pretrained(path, config=Qfp8Config().for_checkpoint(path))`` then loads
        the stored FP8 weights and scales through qfp8 (``config_kwargs``: AutoConfig's, e.g. ``revision``)."""
        from transformers import AutoConfig

        config_kwargs.setdefault("trust_remote_code", False)  # a checkpoint's own code runs only when asked
        config = AutoConfig.from_pretrained(path, **config_kwargs)
        if getattr(config, "quantization_config", None) is None:
            raise ValueError(
                f"{path}: config.json has no quantization_config (a float checkpoint); pass "
                "quantization_config=Qfp8Config(...) to from_pretrained to quantize it while loading"
            )
        config.quantization_config = self.to_dict()
        return config


def register() -> None:
    """Registers ``"qfp8"`` with transformers (once; a second call changes nothing)."""
    from qfp8.integrations.transformers_quantizer import Qfp8HfQuantizer

    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not Qfp8Config:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a reloaded module's older class
        register_quantization_config(QUANT_METHOD)(Qfp8Config)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not Qfp8HfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(Qfp8HfQuantizer)


register()
