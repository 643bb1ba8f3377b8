"""Shared helpers for the checkpoint tests: a tiny random Llama, fast to build and run."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests import models

transformers = pytest.importorskip("transformers", reason="checkpoint tests build transformers models")


TINY_SIZES = {**models.TINY_LLAMA, "max_position_embeddings": 64, "tie_word_embeddings": False}


def tiny_config(**overrides):
    return models.tiny_llama_config(**{**TINY_SIZES, **overrides})


def tiny_model(dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=dtype)
    return model.eval()


def tokens(seed=1, batch=2, length=12):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=generator)


def checkpoint_tensors(path):
    """Every tensor of the ``*.safetensors`` files of a checkpoint folder, by name."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def quantized_model(dtype=torch.float32, **kwargs):
    """The tiny model quantized with ``qfp8.quantize(**kwargs)``; static schemes calibrated on a few tokens."""
    import qfp8

    model = tiny_model(dtype)
    qfp8.quantize(model, **kwargs)
    if kwargs.get("activations") == "static":
        with qfp8.calibrate(model), torch.no_grad():
            model(tokens(seed=5))
    return model


def mixed_model():
    """The tiny model with two schemes: channel-scaled attention, per-tensor MLP (lm_head float)."""
    import qfp8

    model = tiny_model()
    qfp8.quantize(model, weight_scale="channel", exclude=("lm_head", "*mlp*"))
    mlp = tiny_model()
    qfp8.quantize(mlp, weight_scale="tensor", exclude=("lm_head", "*self_attn*"))
    for i, layer in enumerate(model.model.layers):
        layer.mlp = mlp.model.layers[i].mlp
    return model


def qlinears(model):
    """The model's QLinear modules, by name."""
    from qfp8.nn import QLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, QLinear)}


class Tiny:
    """The helpers above, as a fixture (tests are imported with --import-mode=importlib)."""

    sizes = TINY_SIZES  # for other architectures of the same size
    config = staticmethod(tiny_config)
    model = staticmethod(tiny_model)
    tokens = staticmethod(tokens)
    tensors = staticmethod(checkpoint_tensors)
    quantized = staticmethod(quantized_model)
    qlinears = staticmethod(qlinears)
    mixed = staticmethod(mixed_model)


@pytest.fixture
def tiny():
    return Tiny


@pytest.fixture
def x():
    return tokens()
