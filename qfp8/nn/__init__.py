"""Quantized modules."""

from qfp8.nn.conv import QConv1d, QConv2d
from qfp8.nn.qlinear import QLinear
from qfp8.nn.scheme import QuantizationScheme

__all__ = ["QConv1d", "QConv2d", "QLinear", "QuantizationScheme"]
