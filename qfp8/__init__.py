"""qfp8: FP8 weights and activations for PyTorch models, with fast kernels."""

from qfp8.checkpoint import from_pretrained, load_state_dict, save_pretrained
from qfp8.integrations.peft import install_when_imported
from qfp8.nn import QLinear
from qfp8.quantize import QuantizeReport, calibrate, freeze, quantize
from qfp8.tensor import Float8ActivationTensor, Float8WeightTensor

__version__ = "0.1.0"

install_when_imported()  # peft's LoRA layers for QLinear bases, once (and if) peft is imported

__all__ = [
    "Float8ActivationTensor",
    "Float8WeightTensor",
    "QLinear",
    "QuantizeReport",
    "calibrate",
    "freeze",
    "from_pretrained",
    "load_state_dict",
    "quantize",
    "save_pretrained",
]
