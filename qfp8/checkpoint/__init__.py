"""Checkpoints: compressed-tensors ``float-quantized`` writer, readers for other FP8 formats, loading."""

from qfp8.checkpoint.loader import from_pretrained, load_state_dict
from qfp8.checkpoint.writer import save_pretrained

__all__ = ["from_pretrained", "load_state_dict", "save_pretrained"]
