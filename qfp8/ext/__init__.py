"""Loads ``qfp8._C``, the compiled CPU kernels, once; None when unavailable.

The extension is built by the package install (``setup.py``). When it is
missing or fails to load (a CPU-only wheel built elsewhere, an ABI mismatch
with the installed torch), qfp8 warns once and every linear falls back to the
reference op. Set ``QFP8_NO_EXTENSION=1`` to skip loading it on purpose.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

__all__ = ["load_cpu_extension"]

_LOADED: dict[str, ModuleType | None] = {}


def load_cpu_extension() -> ModuleType | None:
    """Imports ``qfp8._C`` (registering its kernels); None, with one warning, if it cannot."""
    if "cpu" in _LOADED:
        return _LOADED["cpu"]
    module = None
    if os.environ.get("QFP8_NO_EXTENSION", "") != "1":
        try:
            module = importlib.import_module("qfp8._C")
        except (ImportError, OSError) as error:
            warnings.warn(
                f"qfp8: the CPU kernels (qfp8._C) could not be loaded ({error}); FP8 linears use the "
                "reference path. Rebuild with `pip install --no-build-isolation -e .`.",
                RuntimeWarning,
                stacklevel=2,
            )
    _LOADED["cpu"] = module
    return module
