"""qfp8.nn.attention: one-token grouped-query steps with the query heads packed, eager and compiled."""

import copy
import pickle

import pytest
import torch
from transformers import StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import qfp8
from qfp8.nn import attention
from tests import models


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def _reference(query, key, value, mask, scaling):
    """Float64 attention with K/V repeated per query head; mask boolean (True = attend) or additive."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _inputs(seed, batch=2, heads=8, kv_heads=2, length=11, dim=16, q_len=1):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    return query, key, value


def _masks(batch, length):
    padded = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    padded[1, ..., :4] = False  # the second sequence left-padded
    additive = torch.randn(batch, 1, 1, length, generator=torch.Generator().manual_seed(9))
    return {"none": None, "bool": padded, "additive": additive}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_packed_step_matches_float64(mask_kind, kv_heads):
    query, key, value = _inputs(seed=kv_heads, kv_heads=kv_heads)
    mask = _masks(2, key.shape[2])[mask_kind]
    module = _Module(query.shape[1] // kv_heads)
    assert attention.packable(module, query, key, mask, {})
    out, weights = attention.packed_sdpa(module, query, key, value, mask, scaling=0.3)
    assert weights is None
    expected = _reference(query, key, value, mask, 0.3)
    assert out.shape == expected.shape == (2, 1, 8, 16)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-6
    # and it is what transformers' own SDPA function gives (which repeats K/V under compile)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert torch.allclose(out, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    ["prefill", "no groups", "per-head mask", "softcap", "position bias"],
)
def test_other_steps_go_to_transformers_sdpa(case):
    query, key, value = _inputs(seed=3, q_len=5 if case == "prefill" else 1, kv_heads=8 if case == "no groups" else 2)
    module = _Module(query.shape[1] // key.shape[1])
    mask = torch.zeros(2, 8, 1, key.shape[2]) if case == "per-head mask" else None
    kwargs = {"softcap": 30.0} if case == "softcap" else {}
    if case == "position bias":
        kwargs = {"position_bias": torch.zeros(1, 8, 1, key.shape[2])}
    assert not attention.packable(module, query, key, mask, kwargs)
    calls = []

    def recording(*args, **kw):
        calls.append(args)
        return sdpa_attention_forward(*args, **kw)

    original = attention.sdpa_attention_forward
    attention.sdpa_attention_forward = recording
    try:
        if case == "softcap":  # transformers' SDPA refuses it, and so the packed function does not hide that
            with pytest.raises(ValueError, match="softcap"):
                attention.packed_sdpa(module, query, key, value, mask, **kwargs)
        else:
            out, _ = attention.packed_sdpa(module, query, key, value, mask, **kwargs)
            expected, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
            assert torch.equal(out, expected)
    finally:
        attention.sdpa_attention_forward = original
    assert len(calls) == 1


def _llama(attn="sdpa", seed=0, kv_heads=2):
    return models.tiny_llama(
        seed, num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=128, attn_implementation=attn
    )


def test_turning_the_fused_kv_attention_off_restores_the_packed_sdpa():
    from qfp8.nn import kv_cache as kvc

    model, _ = qfp8.quantize(_llama())
    kvc.enable_fp8_kv_cache(model)
    assert model.config._attn_implementation == kvc.FUSED_ATTENTION
    kvc.enable_fp8_kv_cache(model, fused_attention=False)
    assert model.config._attn_implementation == attention.PACKED_SDPA
    plain = _llama()
    kvc.enable_fp8_kv_cache(plain)
    kvc.enable_fp8_kv_cache(plain, fused_attention=False)
    assert plain.config._attn_implementation == "sdpa"


def test_quantize_switches_sdpa_models_and_says_so():
    model, report = qfp8.quantize(_llama())
    assert model.config._attn_implementation == attention.PACKED_SDPA
    assert attention.PACKED_SDPA in report.attention and attention.PACKED_SDPA in str(report)
    eager_model, eager_report = qfp8.quantize(_llama("eager"))
    assert eager_model.config._attn_implementation == "eager"
    assert eager_report.attention == "" and "attention:" not in str(eager_report)
    # one K/V head per query head: nothing to pack, transformers' sdpa stays
    mha_model, mha_report = qfp8.quantize(_llama(kv_heads=8))
    assert mha_model.config._attn_implementation == "sdpa" and mha_report.attention == ""


def test_from_pretrained_switches_too(tmp_path):
    model, _ = qfp8.quantize(_llama())
    qfp8.save_pretrained(model, tmp_path)
    assert qfp8.from_pretrained(tmp_path).config._attn_implementation == attention.PACKED_SDPA


def test_a_pickled_model_still_finds_the_attention_function():
    model, _ = qfp8.quantize(_llama())
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(attention.PACKED_SDPA, None)  # as in a new process
    with pytest.raises(KeyError, match=attention.PACKED_SDPA), torch.no_grad():
        model(ids)  # the registry is what the model looks its attention up in
    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, model(ids).logits)


def _sdpa_key_heads(step, model, cache, token, position) -> list[int]:
    with torch.profiler.profile(record_shapes=True) as profile:
        step(model, token, position, cache)
    return [event.input_shapes[1][1] for event in profile.events() if "scaled_dot_product" in event.name]


def test_compiled_decode_packs_heads_and_matches_eager():
    """Under torch.compile the step keeps K/V at their 2 heads (transformers' sdpa expands them to 8)."""
    torch._dynamo.reset()
    quantized, _ = qfp8.quantize(_llama())
    plain = copy.deepcopy(quantized)
    plain.config._attn_implementation = "sdpa"
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))

    def step(model, token, position, cache):
        return model(token, cache=cache, position_ids=position, use_cache=True).logits

    results = {}
    for name, model in (("packed", quantized), ("plain", plain)):
        for mode in ("eager", "compiled"):
            cache = StaticCache(config=model.config, max_cache_len=16)
            run = torch.compile(step, fullgraph=True, dynamic=False) if mode == "compiled" else step
            with torch.no_grad():
                logits = model(prompt, cache=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                steps = []
                for i in range(3):
                    position = torch.tensor([[prompt.shape[1] + i]])
                    steps.append(run(model, token, position, cache))
                    token = steps[-1][:, -1:].argmax(-1)
                heads = _sdpa_key_heads(run, model, cache, token, torch.tensor([[prompt.shape[1] + 3]]))
            results[name, mode] = torch.cat(steps, 1), heads
    assert results["packed", "compiled"][1] == [2, 2]  # one SDPA per layer, on the 2 K/V heads
    assert results["plain", "compiled"][1] == [8, 8]  # transformers' own: K/V repeated to every query head
    reference = results["plain", "eager"][0]
    for key, (logits, _) in results.items():
        assert torch.allclose(logits, reference, rtol=1e-4, atol=1e-4), key
    torch._dynamo.reset()


def test_quantize_reports_the_fp8_kv_cache_and_its_attention():
    from qfp8.nn import kv_cache as kvc

    model, report = qfp8.quantize(_llama(), kv_cache="float8_e4m3fn")
    assert model.config._attn_implementation == kvc.FUSED_ATTENTION
    assert report.attention.startswith(f"sdpa -> {kvc.FUSED_ATTENTION}")  # not the packed SDPA it passed through
    assert report.kv_cache.startswith("float8_e4m3fn in 2 attention modules") and "KV cache:" in str(report)
    only_cache, report = qfp8.quantize(_llama(), weights=None, kv_cache="float8_e5m2")
    assert not report.entries and report.kv_cache.startswith("float8_e5m2 in 2")
    assert report.attention.startswith(f"sdpa -> {kvc.FUSED_ATTENTION}")
    _, report = qfp8.quantize(_llama())
    assert report.kv_cache == "" and "KV cache:" not in str(report)
