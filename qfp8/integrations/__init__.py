"""qfp8 inside other libraries' entry points: transformers' ``from_pretrained`` and ``save_pretrained``, peft's LoRA.

Each integration imports its library, so none is imported by ``import qfp8`` for it;
``qfp8.Qfp8Config`` imports :mod:`qfp8.integrations.transformers` when first used.
"""

from qfp8.integrations import peft  # imports no peft itself

__all__ = ["peft"]
