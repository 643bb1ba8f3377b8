"""qfp8: FP8 weights and activations for PyTorch models, with fast kernels."""

import sys

from qfp8.checkpoint import from_pretrained, load_state_dict, save_pretrained
from qfp8.nn import QLinear
from qfp8.quantize import QuantizeReport, calibrate, freeze, quantize
from qfp8.tensor import Float8ActivationTensor, Float8WeightTensor

__version__ = "0.1.0"

__all__ = [
    "Float8ActivationTensor",
    "Float8WeightTensor",
    "QLinear",
    "Qfp8Config",
    "QuantizeReport",
    "calibrate",
    "freeze",
    "from_pretrained",
    "load_state_dict",
    "quantize",
    "save_pretrained",
]


def __getattr__(name: str):
    # Qfp8Config is a transformers class: imported (and "qfp8" registered with transformers) when first used.
    if name == "Qfp8Config":
        from qfp8.integrations.transformers import Qfp8Config

        return Qfp8Config
    raise AttributeError(f"module 'qfp8' has no attribute {name!r}")


if "transformers" in sys.modules:  # a quantization_config dict naming "qfp8" then works without touching Qfp8Config
    try:
        from qfp8.integrations import transformers as _transformers_integration  # noqa: F401
    except ImportError:  # a transformers without the registration API: qfp8.Qfp8Config raises when used
        pass
