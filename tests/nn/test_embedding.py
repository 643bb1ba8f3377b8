"""A tied lm_head quantized with its embedding: QEmbedding reads the head's FP8 rows (one table, in FP8)."""

import copy
import io
import json
import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import qfp8
from qfp8 import QLinear, formats
from qfp8.library import cpu, routing
from qfp8.nn.embedding import QEmbedding
from qfp8.tensor import Float8WeightTensor
from tests import models

# Every layout's rows are read in torch from its packed bytes, so the CUDA layouts are checked here too
# (packed on the CPU).
LAYOUTS = ["reference", "cuda-fp8-marlin", "cuda-scaled-mm"] + (
    [f"cpu-{cpu.cpu_kernel_isa()}"] if cpu.KERNEL_VERIFIED else []
)


def tied_llama(seed=0, dtype=torch.float32) -> transformers.LlamaForCausalLM:
    model = models.tiny_llama(
        seed,
        dtype,
        vocab_size=300,  # not a multiple of the CPU layout's 32-row tiles
        intermediate_size=96,
        num_hidden_layers=1,
        tie_word_embeddings=True,
    )
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # its inv_freq in float32, as loaded
    return model


def tokens(seed=1, length=10):
    return torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(seed))


def quantized(model=None, **kwargs):
    model = tied_llama() if model is None else model
    qfp8.quantize(model, exclude=(), **kwargs)
    qfp8.freeze(model)
    return model


# ------------------------------------------------------------------ rows
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(1, 1), (33, 7), (70, 577), (64, 64)])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block", "huge-block"])
def test_rows_from_the_layout_are_the_dequantized_weight_rows_bit_for_bit(layout, fp8, shape, granularity):
    """huge-block: (10^6, 10^6), one block for the whole weight (the row scales are not 10^6 columns wide)."""
    n, k = shape
    weight = torch.randn(n, k) * torch.logspace(-3, 3, n).unsqueeze(1)  # rows of very different sizes
    block = {"block": (16, 8), "huge-block": (10**6, 10**6)}.get(granularity)
    granularity = granularity.removeprefix("huge-")
    q, scale = formats.quantize_weight(weight, fp8, granularity, block)
    packed = routing.kernel_by_name(layout).pack(q)
    ids = torch.randint(0, n, (3, 5))
    expected = formats.dequantize_weight(q, scale, block, torch.bfloat16)[ids]
    rows = routing.dequantized_rows(layout, packed, scale, block or (), ids, n, k, torch.bfloat16)
    assert rows.shape == (3, 5, k) and torch.equal(rows, expected)
    assert routing.kernel_by_name(layout).rows is not None  # read from the layout, not unpacked whole


def test_rows_against_the_float64_weight():
    weight = torch.randn(300, 64, dtype=torch.float64)
    fp8_weight = Float8WeightTensor.from_float(weight.float())
    ids = torch.randint(0, 300, (50,))
    rows = fp8_weight.rows(ids, torch.float32).double()
    reference = weight[ids]
    sqnr = 10 * math.log10(float(reference.square().sum() / (rows - reference).square().sum()))
    assert sqnr > 28  # e4m3 with a scale per row: about 31 dB


def test_f_embedding_of_an_fp8_weight_and_its_refusals():
    fp8_weight = Float8WeightTensor.from_float(torch.randn(40, 24))
    ids = torch.tensor([[3, 39], [0, 5]])
    assert torch.equal(F.embedding(ids, fp8_weight), fp8_weight.dequantize()[ids])
    assert torch.equal(F.embedding(ids.int(), fp8_weight), fp8_weight.dequantize()[ids])
    with pytest.raises(
        ValueError, match=r"embedding of the FP8 weight \[40, 24\]: index 40 is out of range for 40 rows"
    ):
        F.embedding(torch.tensor([40]), fp8_weight)
    with pytest.raises(ValueError, match=r"index -1 is out of range"):
        F.embedding(torch.tensor([-1]), fp8_weight)
    with pytest.raises(TypeError, match="the indices are torch.float32; they must be int64 or int32"):
        F.embedding(torch.tensor([1.0]), fp8_weight)
    with pytest.raises(NotImplementedError, match="max_norm renormalizes"):
        F.embedding(ids, fp8_weight, max_norm=1.0)


# ------------------------------------------------------------ quantize
@pytest.mark.parametrize("scheme", [{}, {"weight_scale": "block", "block_size": (32, 16)}, {"activations": "dynamic"}])
def test_quantize_ties_the_embedding_to_the_fp8_head(scheme):
    float_model = tied_llama()
    model = quantized(copy.deepcopy(float_model), **scheme)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QEmbedding) and embedding.head is model.lm_head
    assert not any(p.shape == (300, 64) for p in model.parameters())  # the float table is gone
    ids = tokens()
    with torch.no_grad():
        rows = embedding(ids)
        assert torch.equal(rows, model.lm_head.weight.dequantize()[ids])
        reference = float_model.model.embed_tokens.weight.double()[ids]
        assert 10 * math.log10(float(reference.square().sum() / (rows.double() - reference).square().sum())) > 25
        logits, float_logits = model(ids).logits.double(), float_model(ids).logits.double()
    assert float((logits - float_logits).norm() / float_logits.norm()) < 0.1


def test_the_default_exclude_and_an_excluded_embedding_keep_the_tie_in_float():
    model = tied_llama()
    qfp8.quantize(model)  # lm_head excluded by default
    assert type(model.model.embed_tokens) is nn.Embedding and model.config.tie_word_embeddings
    model = tied_llama()
    with pytest.warns(UserWarning, match=r"'lm_head' is kept in float.*excluded by pattern 'embed_tokens'"):
        qfp8.quantize(model, exclude=("embed_tokens",))
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight


def test_embedding_errors_name_the_module():
    model = quantized()
    embedding = model.get_input_embeddings()
    with pytest.raises(ValueError, match=r"module 'model.embed_tokens': index 300 is out of range for 300 rows"):
        embedding(torch.tensor([[1, 300]]))
    with pytest.raises(TypeError, match=r"module 'model.embed_tokens': the indices are torch.float32"):
        embedding(torch.tensor([1.0]))


def test_dtype_moves_deepcopy_and_pickle_keep_the_tie():
    model = quantized()
    ids = tokens()
    with torch.no_grad():
        expected = model(ids).logits
    clone = copy.deepcopy(model)
    assert clone.get_input_embeddings().head is clone.lm_head
    pickled = pickle.loads(pickle.dumps(model))
    assert pickled.get_input_embeddings().head is pickled.lm_head
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, expected) and torch.equal(saved(ids).logits, expected)
        clone.to(torch.bfloat16)
        assert clone.get_input_embeddings()(ids).dtype == torch.bfloat16
        assert clone(ids).logits.dtype == torch.bfloat16


def test_compiled_fullgraph_matches_eager():
    model = quantized()
    embedding = model.get_input_embeddings()
    ids = tokens()
    compiled = torch.compile(embedding, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids), embedding(ids))


# ---------------------------------------------------------- checkpoints
def test_checkpoint_stores_the_table_untied_and_from_pretrained_ties_it_again(tmp_path):
    model = quantized(tied_llama(dtype=torch.bfloat16))
    ids = tokens()
    with pytest.warns(UserWarning, match="a quantized lm_head"):  # vLLM's limit, said at save
        qfp8.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["qfp8_tied_embeddings"] == {"model.embed_tokens": "lm_head"}
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(stored["model.embed_tokens.weight"], model.lm_head.weight.dequantize())
    assert stored["lm_head.weight"].dtype == torch.float8_e4m3fn
    loaded = qfp8.from_pretrained(tmp_path)
    assert isinstance(loaded.get_input_embeddings(), QEmbedding)
    assert loaded.get_input_embeddings().head is loaded.lm_head
    assert not any(p.shape == (300, 64) for p in loaded.parameters())
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # Without the key (another writer's untied copy), the embedding loads as the float table it is.
    del config["qfp8_tied_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    untied = qfp8.from_pretrained(tmp_path)
    assert type(untied.get_input_embeddings()) is nn.Embedding
    with torch.no_grad():
        assert torch.equal(untied(ids).logits, model(ids).logits)


def test_from_pretrained_refuses_a_table_that_is_not_the_heads(tmp_path):
    model = quantized()
    qfp8.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["qfp8_tied_embeddings"] = {"model.embed_tokens": "model.layers.0.mlp.up_proj"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: qfp8_tied_embeddings: .*does not match the weight of 'model"):
        qfp8.from_pretrained(tmp_path)
    config["qfp8_tied_embeddings"] = {"model.embed_tokens": "model.norm"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model.embed_tokens' \(Embedding\) can only be tied to 'model.norm'"):
        qfp8.from_pretrained(tmp_path)
    config["qfp8_tied_embeddings"] = {"model.embed_tokens": "lm_head"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    stored = load_file(tmp_path / "model.safetensors")
    stored["model.embed_tokens.weight"] = stored["model.embed_tokens.weight"] * 1.01
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"config.json: .*the loaded embedding table is not the FP8 weight"):
        qfp8.from_pretrained(tmp_path)
    config["qfp8_tied_embeddings"] = ["model.embed_tokens"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: qfp8_tied_embeddings must map embedding names"):
        qfp8.from_pretrained(tmp_path)


def test_state_dict_round_trip_and_a_foreign_table_is_refused():
    float_model = tied_llama()
    model = quantized(copy.deepcopy(float_model))
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], model.lm_head.weight.dequantize())
    ids = tokens()
    target = quantized(tied_llama(seed=5))
    qfp8.load_state_dict(target, state)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, model(ids).logits)
    # The float table the head was quantized from is not the head's: refused, naming the module.
    state["model.embed_tokens.weight"] = float_model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match=r"module 'model.embed_tokens': the loaded embedding table is not the FP8"):
        qfp8.load_state_dict(quantized(tied_llama(seed=5)), state)
    # torch's own load_state_dict: the next forward checks, and keeps refusing.
    other = quantized(tied_llama(seed=5))
    other.load_state_dict(state)
    for _ in range(2):
        with pytest.raises(ValueError, match="is not the FP8 weight of 'lm_head'"):
            other(ids)


def test_a_bf16_checkpoint_of_the_table_loads_into_a_float32_model(tmp_path):
    model = quantized(tied_llama(dtype=torch.bfloat16))
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path, dtype=torch.float32)  # the table's bf16 rounding is accepted
    assert isinstance(loaded.get_input_embeddings(), QEmbedding)
    ids = tokens()
    with torch.no_grad():
        assert loaded(ids).logits.dtype == torch.float32
        rows = loaded.get_input_embeddings()(ids)
        assert torch.equal(rows.bfloat16(), model.get_input_embeddings()(ids))


def test_reference_layout_ties_too(monkeypatch):
    monkeypatch.setenv("QFP8_KERNEL", "reference")
    model = quantized()
    assert model.lm_head.packing == "reference"
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model.get_input_embeddings()(ids), model.lm_head.weight.dequantize()[ids])


def test_qembedding_is_not_a_second_name_of_the_head():
    model = quantized()
    names = [name for name, module in model.named_modules() if isinstance(module, QLinear)]
    assert names.count("lm_head") == 1 and not any(name.startswith("model.embed_tokens") for name in names)
    assert "model.embed_tokens.weight" in model.state_dict() and "lm_head.weight" in model.state_dict()


def test_a_forward_hook_on_the_embedding_moves_to_the_qembedding():
    model = tied_llama()
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append((module, tuple(out.shape))))
    quantized(model)
    with torch.no_grad():
        model(tokens())
    assert seen == [(model.get_input_embeddings(), (2, 10, 64))]


# ------------------------------------------------------ found by the audit
def test_a_vlm_keeps_the_tie_in_its_text_config_too(tiny_llava, tmp_path):
    """Llava over a tied Llama: the flag its language model reads is text_config's."""
    model = tiny_llava(tie=True, layers=1)
    quantized(model)
    assert isinstance(model.get_input_embeddings(), QEmbedding)
    assert model.config.text_config.tie_word_embeddings is False
    qfp8.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["text_config"]["tie_word_embeddings"] is False
    loaded = qfp8.from_pretrained(tmp_path)
    assert isinstance(loaded.get_input_embeddings(), QEmbedding)
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_accelerate_offload_of_the_head_buffers(tmp_path, offload):
    accelerate = pytest.importorskip("accelerate", reason="accelerate's offload hooks")
    model = quantized()
    ids = tokens()
    with torch.no_grad():
        expected = model(ids).logits
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, torch.device("cpu"), offload_buffers=True)
    else:
        accelerate.disk_offload(model, tmp_path, torch.device("cpu"), offload_buffers=True)
    assert model.lm_head.weight_scale.is_meta  # the head's buffers wait on meta outside its own calls
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_a_bf16_checkpoint_loads_as_float16_despite_fp16_subnormals(tmp_path):
    model = quantized(tied_llama(dtype=torch.bfloat16))
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path, dtype=torch.float16)
    assert isinstance(loaded.get_input_embeddings(), QEmbedding)


def test_saving_the_base_model_writes_the_table_as_a_plain_embedding(tmp_path):
    model = quantized()
    qfp8.save_pretrained(model.model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "qfp8_tied_embeddings" not in config  # its head is not in the folder
    loaded = qfp8.from_pretrained(tmp_path)
    assert type(loaded.get_input_embeddings()) is nn.Embedding
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, model.model(ids).last_hidden_state)


def test_an_unchecked_loaded_table_is_not_saved_and_nan_is_refused():
    model, state = quantized(), quantized().state_dict()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 1.5
    model.load_state_dict(state)  # torch's: the check waits
    with pytest.raises(ValueError, match="is not the FP8 weight of 'lm_head'"):
        model.state_dict()
    state = quantized().state_dict()
    state["model.embed_tokens.weight"][7, 3] = float("nan")
    with pytest.raises(ValueError, match=r"row 7, column 3: nan"):
        qfp8.load_state_dict(quantized(), state)


def test_an_excluded_embedding_warns_once_with_the_remedy():
    import warnings

    model = tied_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qfp8.quantize(model, exclude=("model.embed_tokens",))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "to quantize both, leave it out of exclude" in messages[0], messages


def test_the_embedding_follows_its_own_cast():
    model = quantized()
    model.model.to(torch.bfloat16)  # the head (outside model.model) stays float32
    with torch.no_grad():
        assert model.get_input_embeddings()(tokens()).dtype == torch.bfloat16
        assert model.lm_head(torch.randn(2, 64)).dtype == torch.float32


def test_an_embedding_subclass_keeps_the_head_float():
    class Tagged(nn.Embedding):  # keeps nn.Embedding.forward, adds what a QEmbedding would not have
        def tag(self):
            return "mine"

    model = tied_llama()
    tagged = Tagged(300, 64)
    tagged.weight = model.lm_head.weight
    model.model.embed_tokens = tagged
    with pytest.warns(UserWarning, match="a Tagged, not a plain nn.Embedding"):
        qfp8.quantize(model, exclude=())
    assert model.model.embed_tokens.tag() == "mine" and type(model.lm_head) is nn.Linear


# ---------------------------------------------------- found by the re-audit
def test_a_partly_cast_model_saves_and_reloads_its_table_dtype(tmp_path):
    model = quantized()
    model.model.to(torch.bfloat16)  # the embedding (and its table) bf16, the head float32
    qfp8.save_pretrained(model, tmp_path)
    assert load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.get_input_embeddings()(tokens()).dtype == torch.bfloat16


def test_a_config_that_ties_but_a_model_that_does_not_is_loaded_untied():
    """Two different tables under the tied names: transformers leaves them untied, and so does qfp8 (it had
    tied them, silently, or failed on a quantized head). The flag, which says otherwise, is cleared."""
    for exclude in (("lm_head",), ()):
        model = tied_llama()
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach() * 1.5)  # the flag still says tied
        qfp8.quantize(model, exclude=exclude)
        state = {key: value.clone() for key, value in model.state_dict().items()}
        target = tied_llama(seed=3)
        target.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().clone())
        qfp8.quantize(target, exclude=exclude)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # as transformers, silently
            qfp8.load_state_dict(target, state)
        assert target.lm_head.weight is not target.model.embed_tokens.weight
        assert target.config.tie_word_embeddings is False
        with torch.no_grad():
            assert torch.equal(target(tokens()).logits, model(tokens()).logits), exclude


def test_a_flag_without_a_tie_is_not_filled():
    """BigBirdPegasusForCausalLM sets tie_word_embeddings and ties nothing: loading its head alone leaves the
    embedding as it was."""
    config = transformers.BigBirdPegasusConfig(
        vocab_size=300, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
        attention_type="original_full",
    )  # fmt: skip
    model = transformers.BigBirdPegasusForCausalLM(config).eval()
    assert config.tie_word_embeddings and model.lm_head.weight is not model.get_input_embeddings().weight
    qfp8.quantize(model, exclude=("lm_head",))
    embedding = model.get_input_embeddings().weight.detach().clone()
    head = torch.randn(300, 64)
    qfp8.load_state_dict(model, {"lm_head.weight": head}, strict=False)
    assert torch.equal(model.get_input_embeddings().weight, embedding) and torch.equal(model.lm_head.weight, head)


def test_a_tied_output_layer_not_named_lm_head_stays_float_by_default():
    """BERT's cls.predictions.decoder: the default exclude keeps a tied output layer float, as it keeps lm_head."""
    config = transformers.BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96
    )
    model = transformers.BertForMaskedLM(config).eval()
    with pytest.warns(UserWarning, match=r"default exclude keeps a tied output layer float.*pass exclude=\(\)"):
        qfp8.quantize(copy.deepcopy(model))
    qfp8.quantize(model, exclude=())
    assert isinstance(model.get_input_embeddings(), QEmbedding)


# ------------------------------------------------- found by the last audit
def test_your_patterns_that_leave_a_tied_head_in_warn_once():
    model = tied_llama()
    with pytest.warns(UserWarning, match=r"'lm_head' and its tied embedding 'model.embed_tokens' are quantized"):
        qfp8.quantize(model, exclude=("*.mlp.down_proj",))
    assert isinstance(model.get_input_embeddings(), QEmbedding)


def test_a_partial_load_keeps_an_untied_model_untied_whatever_its_flag_says():
    """T5 v1.1 (flan-t5) has its own lm_head while transformers 5 sets its tie flag: a partial non-strict load
    keeps both tensors (it had tied them, one overwriting the other)."""
    model = tied_llama()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach() * 0.5)
    qfp8.quantize(model)
    embedding, head = model.model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    state = {key: value for key, value in model.state_dict().items() if key != "model.embed_tokens.weight"}
    qfp8.load_state_dict(model, state, strict=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, embedding) and torch.equal(model.lm_head.weight, head)
