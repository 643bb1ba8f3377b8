"""qfp8: FP8 weights and activations for PyTorch models, with fast kernels."""

import sys

from qfp8.checkpoint import from_pretrained, load_state_dict, save_pretrained
from qfp8.integrations.peft import install_when_imported
from qfp8.nn import QLinear, QuantizationScheme
from qfp8.quantize import QuantizeReport, calibrate, freeze, quantize
from qfp8.tensor import Float8ActivationTensor, Float8WeightTensor

__version__ = "0.1.0"

install_when_imported()  # peft's LoRA layers for QLinear bases, once (and if) peft is imported

__all__ = [
    "Float8ActivationTensor",
    "Float8WeightTensor",
    "QLinear",
    "QuantizationScheme",
    "Qfp8Config",
    "QuantizeReport",
    "calibrate",
    "enable_fp8_kv_cache",
    "freeze",
    "from_pretrained",
    "load_state_dict",
    "quantize",
    "save_pretrained",
]

# Names imported on first use: their modules need transformers (an optional dependency), and
# qfp8.integrations.transformers registers "qfp8" with transformers' from_pretrained when imported.
_LAZY = {"enable_fp8_kv_cache": "qfp8.nn.kv_cache", "Qfp8Config": "qfp8.integrations.transformers"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qfp8' has no attribute {name!r}")


if "transformers" in sys.modules:  # a quantization_config dict naming "qfp8" then works without touching Qfp8Config
    try:
        from qfp8.integrations import transformers as _transformers_integration  # noqa: F401
    except ImportError:  # a transformers without the registration API: qfp8.Qfp8Config raises when used
        pass
