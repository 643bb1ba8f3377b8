"""A tiny random Llama, quantized per scheme, and a greedy decode step with a static cache.

The decode step is what ``torch.compile`` sees in these tests: one token in,
the logits out, the ``StaticCache`` updated in place. The prompt is run
eagerly first (that allocates the cache), then every step feeds the same
fixed tokens to the eager and the compiled model, so their logits can be
compared step by step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

import qfp8
from tests import models

transformers = pytest.importorskip("transformers", reason="the compile tests run a Hugging Face Llama")

PROMPT_LEN = 8
DECODE_STEPS = 3
MAX_CACHE_LEN = 16

# One entry per scheme qfp8.quantize offers: weight format/scale, then activations.
SCHEMES = {
    "w-e4m3-channel": {},
    "w-e4m3-tensor": {"weight_scale": "tensor"},
    "w-e4m3-block": {"weight_scale": "block", "block_size": (32, 32)},
    "w-e5m2-channel": {"weights": "float8_e5m2"},
    "w-e4m3fnuz-channel": {"weights": "float8_e4m3fnuz"},
    "a-dynamic-token": {"activations": "dynamic", "activation_scale": "token"},
    "a-dynamic-tensor": {"activations": "dynamic", "activation_scale": "tensor"},
    "a-dynamic-group": {"activations": "dynamic", "activation_scale": "group"},
    "a-dynamic-token-mse": {"activations": "dynamic", "activation_scale": "token-mse"},
    "a-static": {"activations": "static"},
}


def pytest_generate_tests(metafunc):
    # A test taking ``scheme`` runs once per scheme, with the readable id.
    if "scheme" in metafunc.fixturenames:
        metafunc.parametrize("scheme", list(SCHEMES.values()), ids=list(SCHEMES))


@pytest.fixture
def schemes():
    return SCHEMES


def tiny_llama_config():
    return models.tiny_llama_config(vocab_size=256, max_position_embeddings=64)


@pytest.fixture(scope="session")
def tiny_llama():
    return models.tiny_llama(dtype=torch.bfloat16, vocab_size=256, max_position_embeddings=64)


@pytest.fixture(scope="session")
def tokens():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, PROMPT_LEN + DECODE_STEPS), generator=generator)


def _quantized(model, scheme: dict, tokens: torch.Tensor):
    """A quantized deep copy of ``model`` (calibrated on ``tokens`` for static scales), frozen."""
    model = copy.deepcopy(model)
    qfp8.quantize(model, **scheme)
    if scheme.get("activations") == "static":
        with qfp8.calibrate(model):
            model(tokens)
    return qfp8.freeze(model)


def _decode_step(model, token, position, cache):
    return model(token, cache=cache, position_ids=position, use_cache=True).logits


def _decode(model, tokens: torch.Tensor, step=_decode_step) -> torch.Tensor:
    """Logits of ``DECODE_STEPS`` single-token steps after an eager prompt, ``[steps, vocab]``."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    logits = []
    with torch.no_grad():
        model(tokens[:, :PROMPT_LEN], cache=cache, use_cache=True)
        for i in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
            position = torch.tensor([[i]])
            logits.append(step(model, tokens[:, i : i + 1], position, cache)[0, -1].float())
    return torch.stack(logits)


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the logits: rtol of bf16, atol 2 % of the largest logit."""
    torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=0.02 * float(expected.abs().max()))


@pytest.fixture
def quantized():
    return _quantized


@pytest.fixture
def decode_step():
    return _decode_step


@pytest.fixture
def decode():
    return _decode


@pytest.fixture
def assert_bf16_close():
    return _assert_bf16_close


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
