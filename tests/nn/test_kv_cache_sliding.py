"""FP8 KV cache on sliding-window attention (Mistral): transformers' sliding-window cache layers in FP8."""

import copy

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

import qfp8
from qfp8 import formats
from qfp8.nn import kv_cache as kvc
from tests.models import TINY_LLAMA

WINDOW = 8


def tiny_mistral(sliding_window=WINDOW) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(**TINY_LLAMA, max_position_embeddings=256, sliding_window=sliding_window)
    config._attn_implementation = "sdpa"
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def base_model():
    return tiny_mistral()


PROMPT = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


def _make_cache(model, static):
    return StaticCache(config=model.config, max_cache_len=40) if static else DynamicCache(config=model.config)


def _chunked_then_greedy(model, cache, chunks=(6, 14, 17), steps=6):
    """Prefill in chunks (filling the window, running past it, adding to a full one), then greedy decode steps."""
    out, start = [], 0
    with torch.no_grad():
        for end in chunks:
            position = torch.arange(start, end).expand(PROMPT.shape[0], -1)
            logits = model(PROMPT[:, start:end], cache=cache, position_ids=position, use_cache=True).logits
            out.append(logits)
            start = end
        token = logits[:, -1:].argmax(-1)
        for i in range(steps):
            position = torch.full((PROMPT.shape[0], 1), start + i)
            logits = model(token, cache=cache, position_ids=position, use_cache=True).logits
            out.append(logits)
            token = logits[:, -1:].argmax(-1)
    return torch.cat(out, 1)


# ------------------------------------------------------------------ cache layers


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_layer_matches_transformers_sliding_layer(base_model, static):
    """Fed the same states, the FP8 layer returns what transformers' layer returns (to FP8 precision), with the
    same lengths, mask sizes and sequence length, through filling, overflowing and decoding past the window."""
    model = copy.deepcopy(base_model)
    kvc.enable_fp8_kv_cache(model, fused_attention=False)
    attention = model.model.layers[0].self_attn
    if static:
        reference, layer = (
            StaticSlidingWindowLayer(40, WINDOW),
            kvc.Float8StaticSlidingWindowLayer(WINDOW, WINDOW, attention),
        )
    else:
        reference, layer = DynamicSlidingWindowLayer(WINDOW), kvc.Float8DynamicSlidingWindowLayer(WINDOW, attention)
    torch.manual_seed(0)
    for length in (3, 2, 1, 1, 4, 1, 1, 5, 1):
        keys, values = torch.randn(2, 2, length, 16), torch.randn(2, 2, length, 16)
        assert layer.get_mask_sizes(length) == reference.get_mask_sizes(length)
        expected_keys, expected_values = reference.update(keys, values)
        got_keys, got_values = layer.update(keys, values)
        assert got_keys.shape == expected_keys.shape and got_values.shape == expected_values.shape
        assert formats.sqnr(expected_keys, got_keys) > 25 and formats.sqnr(expected_values, got_values) > 25
        assert layer.keys.dtype == torch.float8_e4m3fn and layer.keys.shape == reference.keys.shape
        assert layer.get_seq_length() == reference.get_seq_length()
    assert layer.get_seq_length() == 19 and layer.keys.shape[2] == (WINDOW if static else WINDOW - 1)


def test_dynamic_layer_crop_with_past_recording(base_model):
    model = copy.deepcopy(base_model)
    kvc.enable_fp8_kv_cache(model, fused_attention=False)
    layer = kvc.Float8DynamicSlidingWindowLayer(WINDOW, model.model.layers[0].self_attn)
    reference = DynamicSlidingWindowLayer(WINDOW)
    layer.activate_past_recording()
    reference.activate_past_recording()
    torch.manual_seed(0)
    for length in (6, 5):
        states = torch.randn(1, 2, length, 16)
        expected, got = reference.update(states, states)[0], layer.update(states, states)[0]
        assert got.shape == expected.shape
    layer.crop(-2)
    reference.crop(-2)
    assert layer.keys.shape == reference.keys.shape and layer.get_seq_length() == reference.get_seq_length() == 9
    assert formats.sqnr(reference.keys, layer.dequantized(layer.keys, layer.values)[0]) > 25


# ------------------------------------------------------------------ through the model


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_mistral_sliding_window_generation(base_model, static):
    """Chunked prefill and decode past the window: FP8 logits close to the unquantized sliding-window cache's,
    fused decode attention equal to the dequantizing path, dynamic and static caches agreeing."""
    reference = _chunked_then_greedy(base_model, _make_cache(base_model, static))
    # The window matters here: the same model without it gives other logits.
    unwindowed = tiny_mistral(sliding_window=None)
    assert formats.sqnr(reference, _chunked_then_greedy(unwindowed, _make_cache(unwindowed, static))) < 20
    results = {}
    for fused in (True, False):
        model = copy.deepcopy(base_model)
        kvc.enable_fp8_kv_cache(model, fused_attention=fused)
        cache = _make_cache(model, static)
        results[fused] = _chunked_then_greedy(model, cache)
        expected = kvc.Float8StaticSlidingWindowLayer if static else kvc.Float8DynamicSlidingWindowLayer
        assert all(type(layer) is expected for layer in cache.layers)
        assert cache.layers[0].keys.dtype == torch.float8_e4m3fn
    assert formats.sqnr(reference, results[True]) > 25
    assert formats.sqnr(results[False], results[True]) > 80
    other = copy.deepcopy(base_model)
    kvc.enable_fp8_kv_cache(other)
    other_static = _chunked_then_greedy(other, _make_cache(other, not static))
    assert formats.sqnr(results[True], other_static) > 60


def test_generate_calibrate_and_default_window(base_model):
    """MistralConfig's default window (4096): quantize(kv_cache=...), calibrate and generate, as the audit ran it."""
    model = tiny_mistral(sliding_window=4096)
    qfp8.quantize(model, kv_cache="float8_e4m3fn")
    with qfp8.calibrate(model):
        model(PROMPT)
    assert model.model.layers[0].self_attn.k_scale.shape == (1,)
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert type(out.past_key_values.layers[0]) is kvc.Float8DynamicSlidingWindowLayer
    assert out.sequences.shape == (2, PROMPT.shape[1] + 3)
    static = model.generate(PROMPT, max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)
    assert torch.equal(out.sequences, static)


def test_compiled_decode_step_past_the_window(base_model):
    """A full static window's decode step (shift in place, write last) compiles with fullgraph, as eager runs it."""
    model = copy.deepcopy(base_model)
    kvc.enable_fp8_kv_cache(model)
    prompt = PROMPT[:, :12]
    position = torch.full((prompt.shape[0], 1), prompt.shape[1])

    def prefill():
        cache = StaticCache(config=model.config, max_cache_len=40)
        with torch.no_grad():
            token = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return cache, token

    cache, token = prefill()
    with torch.no_grad():
        eager = model(token, cache=cache, position_ids=position, use_cache=True).logits
    eager_keys = cache.layers[1].keys.clone()
    cache, token = prefill()
    torch.compiler.reset()
    step = torch.compile(
        lambda token, position: model(token, cache=cache, position_ids=position, use_cache=True).logits,
        fullgraph=True,
    )
    with torch.no_grad():
        compiled = step(token, position)
    assert torch.equal(cache.layers[1].keys.view(torch.uint8), eager_keys.view(torch.uint8))
    assert formats.sqnr(eager, compiled) > 60
