"""Quantized modules."""

from qfp8.nn.qlinear import QLinear
from qfp8.nn.scheme import QuantizationScheme

__all__ = ["QLinear", "QuantizationScheme"]
