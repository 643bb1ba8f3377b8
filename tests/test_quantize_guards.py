"""quantize: refusals leave the model untouched; what it cannot do as asked is said, never silent."""

import gc
import warnings
import weakref

import pytest
import torch
import transformers
from torch import nn

import qfp8
from qfp8 import QLinear
from tests import models


def tiny_llama(tie=False) -> transformers.LlamaForCausalLM:
    return models.tiny_llama(vocab_size=256, num_hidden_layers=1, tie_word_embeddings=tie)


def quantize_quietly(model, **kwargs):
    """quantize, failing the test on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return qfp8.quantize(model, **kwargs)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


# -------------------------------------------------------------- refusals
def test_refused_kv_cache_leaves_the_model_untouched_and_a_retry_works():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    before, types = state(model)
    with pytest.raises(ValueError, match="Llama-family attention") as refused:
        qfp8.quantize(model, kv_cache="float8_e4m3fn")
    after, types_after = state(model)
    assert types_after == types and not hasattr(model, "qfp8_scheme")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert "kv_cache='float8_e4m3fn'" in str(refused.value) and "Sequential has no" in str(refused.value)
    assert "kv_cache=None to quantize its weights only" in str(refused.value)
    _, report = quantize_quietly(model)
    assert len(report.quantized) == 2 and isinstance(model[0], QLinear)


def test_kv_cache_on_an_encoder_decoder_is_refused_before_any_change():
    """BART's attention looks Llama-like (layer_idx, k_proj, v_proj) but its cache is an EncoderDecoderCache."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = BartForConditionalGeneration(config).eval()
    before, types = state(model)
    with pytest.raises(ValueError, match=r"BartForConditionalGeneration is an encoder-decoder model"):
        qfp8.quantize(model, kv_cache="float8_e4m3fn")
    after, types_after = state(model)
    assert types_after == types and all(torch.equal(after[k], before[k]) for k in before)
    _, report = quantize_quietly(model)  # the weights alone quantize, and the model runs
    ids = torch.randint(3, 64, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, decoder_input_ids=ids[:, :3]).logits).all()


# ------------------------------------------------------------ tied weights
def test_tied_lm_head_is_quantized_quietly_and_the_embedding_reads_its_fp8_rows(tmp_path):
    model = tiny_llama(tie=True)
    ids = torch.randint(0, 256, (1, 8))
    _, report = quantize_quietly(model, exclude=())
    assert "8 quantized, 0 skipped" in str(report)
    assert "tied embedding: model.embed_tokens reads its rows from lm_head's FP8 weight" in str(report)
    assert isinstance(model.lm_head, QLinear) and model.get_input_embeddings().head is model.lm_head
    assert model.config.tie_word_embeddings is False  # qfp8 holds the tie; transformers must not redo it
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.get_input_embeddings().head is loaded.lm_head
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_lm_head_tied_to_an_embedding_with_its_own_forward_stays_float_with_one_warning():
    class ScaledEmbedding(nn.Embedding):  # as Gemma's: rows times a factor
        def forward(self, ids):
            return super().forward(ids) * 8.0

    model = tiny_llama(tie=True)
    embedding = ScaledEmbedding(256, 64)
    embedding.weight = model.lm_head.weight
    model.model.embed_tokens = embedding
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = qfp8.quantize(model, exclude=())
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "'lm_head' is kept in float" in messages[0] and "'model.embed_tokens'" in messages[0]
    assert "a ScaledEmbedding, not a plain nn.Embedding" in messages[0]
    entry = {e.name: e for e in report.entries}["lm_head"]
    assert not entry.quantized and entry.reason == "weight tied to model.embed_tokens (kept in float)"
    assert "7 quantized, 1 skipped" in str(report)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is True


def test_a_linear_tied_to_an_excluded_linear_stays_float():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    model[1].weight = model[0].weight
    with pytest.warns(UserWarning, match=r"'1' is kept in float.*same Parameter as that of '0'"):
        _, report = qfp8.quantize(model, exclude=("0",))
    assert [e.name for e in report.quantized] == ["2"] and type(model[1]) is nn.Linear


# ---------------------------------------------------------------- exclude
def test_exclude_pattern_matching_nothing_warns_once_naming_it():
    model = tiny_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = qfp8.quantize(model, exclude=("lm_haed", "*.q_proj"))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "exclude pattern 'lm_haed' matches no nn.Linear of LlamaForCausalLM" in messages[0]
    assert {e.name for e in report.skipped} == {"model.layers.0.self_attn.q_proj"}


def test_default_exclude_does_not_warn_without_lm_head_and_none_excludes_nothing():
    _, report = quantize_quietly(nn.Sequential(nn.Linear(16, 16)))
    assert len(report.quantized) == 1
    _, report = quantize_quietly(tiny_llama(), exclude=None)
    assert not report.skipped and len(report.quantized) == 8


# ------------------------------------------------------------------ hooks
def test_hooks_move_to_the_qlinear_and_their_handles_still_remove_them():
    calls = []
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8))
    handles = [
        model[0].register_forward_pre_hook(lambda m, args: calls.append("pre")),
        model[0].register_forward_pre_hook(lambda m, args, kwargs: calls.append("pre-kw"), with_kwargs=True),
        model[0].register_forward_hook(lambda m, args, out: calls.append(("post", type(m).__name__))),
        model[0].register_forward_hook(
            lambda m, args, kwargs, out: calls.append("post-kw"), with_kwargs=True, always_call=True
        ),
    ]
    x = torch.randn(2, 16)
    quantize_quietly(model)
    assert isinstance(model[0], QLinear)
    for _ in range(2):  # the second call would take the fast path if the hooks were not seen
        calls.clear()
        model(x)
        assert calls == ["pre", "pre-kw", ("post", "QLinear"), "post-kw"]
    for handle in handles:
        handle.remove()
    calls.clear()
    out = model(x)
    assert calls == [] and not model[0]._forward_hooks and not model[0]._forward_hooks_always_called
    assert torch.equal(out, model[1](model[0](x)))


def test_state_dict_hooks_are_dropped_with_a_warning():
    model = nn.Sequential(nn.Linear(16, 8))
    model[0]._register_state_dict_hook(lambda module, state_dict, prefix, local_metadata: None)
    with pytest.warns(UserWarning, match=r"module '0' had 1 state-dict hook"):
        qfp8.quantize(model)


# ------------------------------------------------------- nothing to quantize
def test_nothing_quantized_warns_naming_the_model_class():
    with pytest.warns(UserWarning, match=r"nothing was quantized in Sequential: it has no nn.Linear; Bilinear layers"):
        _, report = qfp8.quantize(nn.Sequential(nn.Bilinear(8, 8, 4)))
    assert not report.quantized and [other.kind for other in report.others] == ["Bilinear"]
    with pytest.warns(UserWarning, match=r"nothing was quantized in Sequential: it has no nn.Linear$"):
        qfp8.quantize(nn.Sequential(nn.ReLU()))


def test_everything_excluded_by_the_user_does_not_warn():
    _, report = quantize_quietly(nn.Sequential(nn.Linear(16, 16)), exclude=("0",))
    assert not report.quantized


# ------------------------------------------------------- arguments, memory
def test_a_bare_linear_is_refused_not_silently_left_float():
    linear = nn.Linear(16, 8)
    with pytest.raises(ValueError, match=r"itself an nn\.Linear \(16 -> 8\).*nn\.Sequential\(linear\)\)\[0\]\[0\]"):
        qfp8.quantize(linear)
    assert isinstance(qfp8.quantize(nn.Sequential(linear))[0][0], QLinear)  # the route the message names
    assert type(linear) is nn.Linear and not list(linear.children())  # nothing attached under an empty name


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(exclude=5), TypeError, r"exclude must be a pattern string or a list of them .*got 5"),
        (dict(exclude=["lm_head", 3]), TypeError, r"exclude must be .*got \['lm_head', 3\]"),
        (dict(weight_scale="block", block_size=None), ValueError, r"block_size must be two positive ints .*None"),
        (dict(weight_scale="block", block_size=(128,)), ValueError, r"block_size must be two positive ints"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    model = nn.Sequential(nn.Linear(16, 8))
    with pytest.raises(error, match=match):
        qfp8.quantize(model, **kwargs)
    assert type(model[0]) is nn.Linear


def test_quantize_frees_each_float_weight_once_its_layer_is_replaced(monkeypatch):
    """Peak memory is the float model plus one layer: already replaced float Linears are not held until the end."""
    layers = 6
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(layers)])
    refs = [weakref.ref(layer.weight) for layer in model]
    original = QLinear.from_linear.__func__
    alive = []

    def counting(cls, linear, *args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in refs))
        return original(cls, linear, *args, **kwargs)

    monkeypatch.setattr(QLinear, "from_linear", classmethod(counting))
    qfp8.quantize(model)
    assert alive == [layers - i for i in range(layers)]  # only the layers not replaced yet
    gc.collect()
    assert all(ref() is None for ref in refs)


# ------------------------------------------------ what is not an nn.Linear
def test_fused_moe_experts_left_in_float_are_reported_and_warned():
    """Fused 3-D experts kept in float (here excluded) are counted with the other float matrix weights, loudly."""
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    experts = {
        name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules() if name.endswith("experts")
    }
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    with pytest.warns(UserWarning, match=r"not nn\.Linear, left in float: MixtralExperts x2 .*% of the matrix weights"):
        _, report = qfp8.quantize(model, exclude=["lm_head", "*.experts.*"])
    kinds = {other.kind for other in report.others}
    assert kinds == {"MixtralExperts", "MixtralTopKRouter"}, kinds
    skipped = {e.name: e.reason for e in report.skipped if e.experts}
    assert skipped == {f"model.layers.{i}.mlp.experts.{p}": "excluded by pattern '*.experts.*'"
                       for i in range(2) for p in ("gate_up_proj", "down_proj")}  # fmt: skip
    assert {o.name: o.numel for o in report.others if o.kind == "MixtralExperts"} == experts
    routers = sum(o.numel for o in report.others if o.kind != "MixtralExperts")
    others = sum(experts.values()) + routers
    assert report.other_fraction == pytest.approx(others / (others + linear)) and report.other_fraction > 0.5
    assert "MixtralExperts x2 (model.layers.0.mlp.experts, model.layers.1.mlp.experts)" in str(report)


def test_a_plain_llama_has_no_other_weights():
    _, report = quantize_quietly(tiny_llama())
    assert report.others == [] and report.other_fraction == 0.0 and "left in float" not in str(report)


def test_falcon_linear_is_quantized():
    """FalconLinear overrides forward with x @ W.T + b, the same function as nn.Linear's: it is replaced too."""
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
    )  # fmt: skip
    model = transformers.FalconForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(ids).logits.double()
    _, report = quantize_quietly(model)
    assert len(report.quantized) == 8 and all(e.kernel for e in report.quantized)
    assert not any(type(m).__name__ == "FalconLinear" for m in model.modules())
    with torch.no_grad():
        assert qfp8.formats.sqnr(reference, model(ids).logits.double()) > 25


@pytest.mark.parametrize(
    "prepare, reason",
    [
        (lambda lin: torch.nn.utils.prune.l1_unstructured(lin, "weight", 0.5), "pruned with torch.nn.utils.prune"),
        (lambda lin: torch.nn.utils.weight_norm(lin), "has torch.nn.utils.weight_norm's hook"),
    ],
    ids=["prune", "weight_norm"],
)
def test_linears_whose_hooks_recompute_the_weight_are_skipped_with_the_fix(prepare, reason):
    """Their forward pre-hook rebuilds `weight` from tensors a QLinear does not have."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        prepare(model[0])
    x = torch.randn(2, 8)
    expected = model[0](x)
    _, report = qfp8.quantize(model, exclude=None)
    (entry,) = [e for e in report.entries if e.name == "0"]
    assert not entry.quantized and entry.reason.startswith(reason)
    assert torch.equal(model[0](x), expected) and torch.isfinite(model(x)).all()


def test_a_parametrized_linear_is_quantized_without_a_left_in_float_warning():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = qfp8.quantize(model, exclude=None)
    assert report.quantized and not report.others and report.other_fraction == 0.0
    assert not [w for w in caught if "left in float" in str(w.message)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(activations=None, activation_scale="group"), "applies to activations='dynamic'"),
        (dict(activations="static", activation_scale="token-mse"), "one calibrated per-tensor scale"),
        (dict(weight_scale="channel", block_size="garbage"), "two positive ints"),
        (dict(weight_scale="block", block_size=(True, 64)), "two positive ints"),
    ],
)
def test_arguments_that_would_be_ignored_are_refused(kwargs, message):
    """Each of these would have no effect, so it is refused (as the CLI refuses the same options).

    A valid block_size with another granularity stays accepted: sweeps pass one to every weight_scale.
    """
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=message):
        qfp8.quantize(model, **kwargs)
    assert all(type(m) is nn.Linear for m in model)  # refused before anything changed
    for ok in (
        dict(activations="static", activation_scale="tensor"),  # static's own scale
        dict(weight_scale="channel", block_size=(64, 64)),  # a block size a sweep passes to every granularity
        dict(weight_scale="channel", block_size=()),  # what a channel scheme holds (model.qfp8_scheme.block_size)
        dict(weight_scale="tensor", block_size=None),
    ):
        qfp8.quantize(nn.Sequential(nn.Linear(16, 16)), **ok)


def test_a_shared_linear_is_excluded_by_any_of_its_names():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder_proj = nn.Linear(16, 16)
            self.decoder_proj = self.encoder_proj
            self.head = nn.Linear(16, 4)

    for pattern in ("encoder_proj", "decoder_proj"):
        model, report = qfp8.quantize(Shared(), exclude=[pattern])
        assert type(model.decoder_proj) is nn.Linear and model.decoder_proj is model.encoder_proj
        assert report.entries[0].reason.startswith(f"excluded by pattern {pattern!r}")
        assert isinstance(model.head, qfp8.QLinear)


def test_linears_sharing_one_weight_are_warned_about():
    """Two modules holding one Parameter (not one module under two names) get two FP8 copies: said, not silent."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model[2].weight = model[0].weight
    with pytest.warns(UserWarning, match=r"'0', '2' hold one weight Parameter; each gets its own FP8 copy"):
        _, report = qfp8.quantize(model)
    assert len(report.quantized) == 2 and isinstance(model[0], QLinear) and isinstance(model[2], QLinear)
    shared = nn.Sequential(nn.Linear(16, 16))
    shared.add_module("again", shared[0])  # one module, two names: quantized once, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qfp8.quantize(shared)
    assert shared[0] is shared.again


# ------------------------------------------------------ found by the stop-28 audit
@pytest.mark.parametrize("key", ["weight_scale", "input_scale"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_freeze_refuses_a_scale_edited_to_a_value_the_kernels_cannot_use(key, bad):
    """freeze refused a NaN FP8 code but packed a NaN, zero or negative scale: NaN, zero or negated outputs."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    qfp8.quantize(model, activations="static")
    with qfp8.calibrate(model):
        model(torch.randn(4, 16))
    getattr(model[1], key)[0] = bad
    with pytest.raises(ValueError, match=rf"freeze: module '1': {key} \[\d+(, 1)?\] holds 1 of \d+ value"):
        qfp8.freeze(model)


def test_freeze_refuses_an_input_scale_edited_below_the_smallest_qfp8_makes():
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model, activations="static")
    with qfp8.calibrate(model):
        model(torch.randn(4, 16))
    model[0].input_scale[0] = 5e-39
    with pytest.raises(ValueError, match=r"freeze: module '0': input_scale \[1\] holds 1 of 1 value\(s\) below"):
        qfp8.freeze(model)


def test_freeze_names_the_weight_shape_not_the_packed_layout():
    model = nn.Sequential(nn.Linear(4, 4))
    qfp8.quantize(model)
    model[0].qweight.view(torch.uint8).view(-1)[0] = 0x7F
    with pytest.raises(ValueError, match=r"FP8 weight \[4, 4\] holds a NaN/Inf code"):
        qfp8.freeze(model)


def test_a_meta_input_gives_a_meta_output_on_every_path():
    """The regular path (first call, a hook) asked torch for meta's autocast state, which raises."""
    model = nn.Sequential(nn.Linear(65, 33))
    qfp8.quantize(model)
    x = torch.randn(2, 65, device="meta")
    assert model(x).shape == (2, 33) and model(x).device.type == "meta"  # the first call: the regular path
    handle = model[0].register_forward_hook(lambda *args: None)
    assert model(x).shape == (2, 33)
    handle.remove()
    model.to("meta")
    assert model(x).shape == (2, 33)


@pytest.mark.parametrize("accuracy", [False, True], ids=["plain", "accuracy-mode"])
def test_a_huge_block_size_quantizes_and_runs(accuracy):
    """qfp8.quantize(block_size=(10**6, 10**6)) allocates nothing of that size (4e12 bytes): a block beyond the
    weight means one block per side. Accuracy mode's scale search pads to the grid too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32))
    x = torch.randn(5, 64)
    reference = model(x).detach().double()
    qfp8.quantize(model, weight_scale="block", block_size=(10**6, 10**6), accuracy="scale" if accuracy else None)
    if accuracy:
        with qfp8.calibrate(model):
            model(torch.randn(16, 64))
    assert model[0].weight_scale.shape == (1, 1)
    assert qfp8.formats.sqnr(reference, model(x)) > 25
