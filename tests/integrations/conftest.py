"""Shared helpers for the transformers integration tests: a tiny random Llama saved as a float checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the integration tests load transformers models")

SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def float_model(dtype=torch.bfloat16, seed=0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SIZES, **overrides})
    # Built in its dtype (a float32 build cast with .to would cast the rotary frequencies too, which loading does not).
    return transformers.LlamaForCausalLM._from_config(config, **dtype_argument(dtype)).eval()


def tokens(seed=1, batch=2, length=9):
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, x=None):
    with torch.no_grad():
        return model(tokens() if x is None else x).logits


def load(path, **kwargs):
    """transformers' from_pretrained of ``path`` (the causal LM class), quietly."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def dtype_argument(dtype) -> dict:
    """``dtype=`` on transformers 5, ``torch_dtype=`` on 4 (where ``dtype`` is not yet a from_pretrained argument)."""
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def read_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture
def float_checkpoint(tmp_path):
    model = float_model()
    model.save_pretrained(tmp_path / "float")
    return tmp_path / "float"


class Helpers:
    """The helpers above, as a fixture (tests are imported with --import-mode=importlib)."""

    float_model = staticmethod(float_model)
    tokens = staticmethod(tokens)
    logits = staticmethod(logits)
    load = staticmethod(load)
    dtype_argument = staticmethod(dtype_argument)
    read_config = staticmethod(read_config)


@pytest.fixture
def helpers():
    return Helpers
