"""FP8 tensor subclasses: weights and activations."""

from qfp8.tensor.activations import Float8ActivationTensor
from qfp8.tensor.weights import Float8WeightTensor

__all__ = ["Float8ActivationTensor", "Float8WeightTensor"]
