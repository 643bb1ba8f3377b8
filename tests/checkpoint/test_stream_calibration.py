"""``qfp8 quantize`` with static activation scales and an FP8 KV cache: layer-by-layer calibration.

The reference is in-memory quantization of the whole model: ``qfp8.quantize``,
``with qfp8.calibrate(model): model(ids)``, ``qfp8.save_pretrained``. Streaming
runs the same operations on the same shapes in the same order, one layer at a
time, so every tensor it writes, scales included, is expected bit for bit.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import qfp8
from qfp8.checkpoint import layerwise
from qfp8.checkpoint.stream import stream_quantize
from qfp8.cli import main

transformers = pytest.importorskip("transformers", reason="calibration runs transformers models")

CASES = {
    "llama-w-tensor-a-static": ("llama", dict(weight_scale="tensor", activations="static", activation_scale="tensor")),
    "llama-w-channel-a-static-kv-e4m3": (
        "llama",
        dict(weight_scale="channel", activations="static", kv_cache="float8_e4m3fn"),
    ),
    "llama-w-channel-kv-e5m2": ("llama", dict(weight_scale="channel", kv_cache="float8_e5m2")),
    "llama-w-block-a-static-lm_head": (
        "llama",
        dict(weight_scale="block", block_size=(32, 32), activations="static", exclude=()),
    ),
    "mistral-sliding-a-static": ("mistral", dict(activations="static")),  # FP8 KV: full attention only
    "qwen3-a-static-kv": ("qwen3", dict(activations="static", kv_cache="float8_e4m3fn")),
    # Accuracy mode: the weights themselves come from the layer-by-layer calibration.
    "llama-w-channel-gptq": ("llama", dict(weight_scale="channel", accuracy="gptq")),
    "llama-a-token-mse-gptq": (
        "llama",
        dict(weight_scale="channel", activations="dynamic", activation_scale="token-mse", accuracy="gptq"),
    ),
    "llama-w-block-a-static-gptq-lm_head": (
        "llama",
        dict(weight_scale="block", block_size=(32, 32), activations="static", accuracy="gptq", exclude=()),
    ),
    "qwen3-w-tensor-scale-kv": ("qwen3", dict(weight_scale="tensor", accuracy="scale", kv_cache="float8_e4m3fn")),
    # A tied lm_head quantized with its embedding (the first hidden states are the FP8 rows), stored as one table.
    "llama-tied-a-static-lm_head": ("llama-tied", dict(activations="static", exclude=())),
    "llama-tied-w-block-gptq-lm_head": (
        "llama-tied",
        dict(weight_scale="block", block_size=(32, 32), activations="static", accuracy="gptq", exclude=()),
    ),
    "llama-tied-a-static-kv": ("llama-tied", dict(activations="static", kv_cache="float8_e4m3fn")),  # head float
}


def float_model(tiny, arch: str, dtype=torch.bfloat16, seed=0, **overrides):
    settings = {**tiny.sizes, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**settings)
    elif arch == "llama-tied":
        config = transformers.LlamaConfig(**{**settings, "tie_word_embeddings": True})
    elif arch == "mistral":
        config = transformers.MistralConfig(sliding_window=8, **settings)  # shorter than the rows: a real window
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **settings)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def quantization_config(path):
    return json.loads((path / "config.json").read_text())["quantization_config"]


def in_memory(model, ids, kwargs, directory):
    qfp8.quantize(model, **kwargs)
    with qfp8.calibrate(model):
        model(ids)
    qfp8.save_pretrained(model, directory)
    return model


def assert_same_checkpoint(tiny, streamed_dir, memory_dir):
    streamed, memory = tiny.tensors(streamed_dir), tiny.tensors(memory_dir)
    assert streamed.keys() == memory.keys()
    for key, value in memory.items():
        assert streamed[key].dtype == value.dtype and streamed[key].shape == value.shape, key
        # Bitwise, scales included: the same ops on the same inputs in the same order (see the module docstring).
        assert torch.equal(streamed[key].view(torch.uint8), value.view(torch.uint8)), key
    assert quantization_config(streamed_dir) == quantization_config(memory_dir)
    return memory


@pytest.mark.parametrize("arch, kwargs", CASES.values(), ids=CASES.keys())
def test_streamed_calibration_equals_in_memory(tiny, tmp_path, arch, kwargs):
    source = tmp_path / "float"
    float_model(tiny, arch).save_pretrained(source, max_shard_size="100KB")
    ids = tiny.tokens(seed=5)
    stream_kwargs = {("weight_scale_granularity" if k == "weight_scale" else k): v for k, v in kwargs.items()}
    summary = stream_quantize(
        source, tmp_path / "stream", calibration_ids=ids, progress=False, max_shard_size="90KB", **stream_kwargs
    )
    model = in_memory(float_model(tiny, arch), ids, kwargs, tmp_path / "memory")
    memory = assert_same_checkpoint(tiny, tmp_path / "stream", tmp_path / "memory")

    static, kv = kwargs.get("activations") == "static", kwargs.get("kv_cache")
    quantized = 14 + (kwargs.get("exclude") == ())  # lm_head too when nothing is excluded
    input_scales = [k for k in memory if k.endswith(".input_scale")]
    kv_scales = [k for k in memory if k.endswith((".k_scale", ".v_scale"))]
    assert len(input_scales) == (quantized if static else 0)
    assert sorted(kv_scales) == (
        sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in range(2) for s in "kv") if kv else []
    )
    assert summary["calibrated"] == len(input_scales) + len(kv_scales)
    if kwargs.get("accuracy"):
        assert summary["accuracy_weights"] == quantized
        # The accuracy mode changed the weights: they are not round to nearest with amax / fmax scales.
        plain_kwargs = {k: v for k, v in stream_kwargs.items() if k != "accuracy"}
        stream_quantize(source, tmp_path / "plain", calibration_ids=ids, progress=False, **plain_kwargs)
        plain = tiny.tensors(tmp_path / "plain")
        changed = [
            k
            for k in memory
            if k.endswith(".weight") and not torch.equal(plain[k].float(), memory[k].float())
            and k != "model.embed_tokens.weight"  # a tied head's table: the head's rows, counted with it
        ]  # fmt: skip
        # gptq moves every row; "scale" may keep c = 1 where amax / fmax is already the best per-tensor choice.
        assert len(changed) == quantized if kwargs["accuracy"] == "gptq" else len(changed) >= quantized // 2, changed
    assert all(memory[k].dtype == torch.float32 and memory[k].shape == (1,) for k in input_scales + kv_scales)
    qc = quantization_config(tmp_path / "stream")
    assert (qc["kv_cache_scheme"] is not None) == bool(kv)
    assert (qc["config_groups"]["group_0"]["input_activations"] or {}).get("dynamic", True) is not static
    loaded = qfp8.from_pretrained(tmp_path / "stream")
    if kv:
        assert torch.equal(loaded.model.layers[1].self_attn.k_scale, model.model.layers[1].self_attn.k_scale)
        # and the query moments of compensated key rounding, written beside the checkpoint
        for ours, theirs in zip(model.model.layers, loaded.model.layers, strict=True):
            assert torch.equal(ours.self_attn.k_rounding_hessian, theirs.self_attn.k_rounding_hessian)
    if kv:
        # kv_cache_scheme cannot say e5m2: qfp8 names a non-e4m3fn cache in qfp8_kv_cache_dtype.
        assert qc.get("qfp8_kv_cache_dtype") == (None if kv == "float8_e4m3fn" else kv)
        assert loaded.qfp8_kv_cache_dtype == getattr(torch, kv)
    x = tiny.tokens(seed=9)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def float_checkpoint_and_ids_file(tiny, tmp_path):
    """A bf16 tiny-Llama checkpoint folder, 4 x 10 token ids and those ids as a ``--calibration-ids`` file."""
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source)
    ids = tiny.tokens(seed=5, batch=4, length=10)
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("\n".join(" ".join(str(int(t)) for t in row) for row in ids) + "\n")
    return source, ids, ids_file


def test_cli_calibration_ids_file_and_batches(tiny, tmp_path):
    """``--calibration-ids FILE`` run two rows at a time equals in-memory calibration over the same two batches."""
    source, ids, ids_file = float_checkpoint_and_ids_file(tiny, tmp_path)
    argv = ["quantize", str(source), str(tmp_path / "stream"), "--no-progress", "--activations", "static"]
    argv += ["--kv-cache", "float8_e4m3fn", "--calibration-ids", str(ids_file), "--calibration-batch-size", "2"]
    assert main(argv) == 0
    model = tiny.model(torch.bfloat16)
    qfp8.quantize(model, activations="static", kv_cache="float8_e4m3fn")
    with qfp8.calibrate(model):
        for batch in ids.split(2):
            model(batch)
    qfp8.save_pretrained(model, tmp_path / "memory")
    assert_same_checkpoint(tiny, tmp_path / "stream", tmp_path / "memory")


def test_cli_accuracy_mode(tiny, tmp_path, capsys):
    """``qfp8 quantize --accuracy gptq`` writes the weights in-memory ``accuracy="gptq"`` calibration chooses."""
    source, ids, ids_file = float_checkpoint_and_ids_file(tiny, tmp_path)
    argv = ["quantize", str(source), str(tmp_path / "stream"), "--no-progress", "--accuracy", "gptq"]
    assert main([*argv, "--calibration-ids", str(ids_file)]) == 0
    assert "0 static scales and 14 accuracy-mode weights calibrated on 40 tokens" in capsys.readouterr().out
    in_memory(tiny.model(torch.bfloat16), ids, dict(accuracy="gptq"), tmp_path / "memory")
    assert_same_checkpoint(tiny, tmp_path / "stream", tmp_path / "memory")
    with pytest.raises(SystemExit):
        main([*argv, "--accuracy", "best"])  # argparse names the choices
    with pytest.raises(ValueError, match="unknown accuracy mode 'best'"):
        stream_quantize(source, tmp_path / "bad", accuracy="best", progress=False)
    assert not (tmp_path / "bad").exists()


def save_word_tokenizer(directory, words=120):
    """A whitespace word-level tokenizer over the most frequent words of the default calibration text."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    counts = Counter(layerwise.default_text().split())
    vocab = {"[UNK]": 0} | {word: i + 1 for i, (word, _) in enumerate(counts.most_common(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)


def test_calibration_text_is_tokenized_with_the_source_tokenizer(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source)
    with pytest.raises(ValueError, match="no tokenizer.*--calibration-ids"):
        stream_quantize(source, tmp_path / "none", activations="static", progress=False)
    save_word_tokenizer(source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    text_file = tmp_path / "calibration.txt"
    text_file.write_text("the value of a list is returned by the function " * 8)
    for name, extra, text in [
        ("default", [], layerwise.default_text()),
        ("file", ["--calibration", str(text_file)], None),
    ]:
        argv = ["quantize", str(source), str(tmp_path / name), "--no-progress", "--activations", "static"]
        assert main([*argv, "--calibration-tokens", "40", *extra]) == 0
        text = text_file.read_text() if text is None else text
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:40])
        assert ids.numel() == 40 and len(set(ids.tolist())) > 5  # words, not only [UNK]
        in_memory(tiny.model(torch.bfloat16), ids[None], dict(activations="static"), tmp_path / f"{name}-memory")
        assert_same_checkpoint(tiny, tmp_path / name, tmp_path / f"{name}-memory")
    assert not torch.equal(
        tiny.tensors(tmp_path / "default")["model.layers.0.mlp.up_proj.input_scale"],
        tiny.tensors(tmp_path / "file")["model.layers.0.mlp.up_proj.input_scale"],
    )


def test_accuracy_mode_calibrates_on_more_text_by_default(tiny, tmp_path, monkeypatch):
    """Without --calibration-tokens: 512 tokens for scales, ACCURACY_TOKENS when --accuracy fits the weights."""
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source)
    save_word_tokenizer(source)
    asked = []
    real = layerwise.text_token_ids

    def recording(tokenizer, text=None, tokens=layerwise.DEFAULT_TOKENS):
        asked.append(tokens)
        return real(tokenizer, text, 40)  # the tiny model has 64 positions

    monkeypatch.setattr(layerwise, "text_token_ids", recording)
    for extra in (
        ["--activations", "static"],
        ["--accuracy", "gptq"],
        ["--accuracy", "gptq", "--calibration-tokens", "99"],
    ):
        assert main(["quantize", str(source), str(tmp_path / str(len(asked))), "--no-progress", *extra]) == 0
    assert asked == [layerwise.DEFAULT_TOKENS, layerwise.ACCURACY_TOKENS, 99]


def test_unsupported_architecture_and_bad_ids(tiny, tmp_path):
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    for kwargs in (dict(activations="static"), dict(kv_cache="float8_e4m3fn")):
        with pytest.raises(ValueError, match=r"Llama family.*GPT2LMHeadModel \(model_type 'gpt2'\)"):
            stream_quantize(tmp_path / "gpt2", tmp_path / "out", calibration_ids=tiny.tokens(seed=5), **kwargs)
    assert not (tmp_path / "out").exists()
    tiny.model().save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"span \[0, 200\].*\[0, 128\)"):
        stream_quantize(
            tmp_path / "llama", tmp_path / "out", activations="static", calibration_ids=torch.tensor([0, 200])
        )
    with pytest.raises(ValueError, match="unknown kv_cache 'int8'"):
        stream_quantize(tmp_path / "llama", tmp_path / "out", kv_cache="int8")


def test_one_decoder_layer_is_materialized_at_a_time(tiny, tmp_path):
    """Counts, at every decoder-layer call, the decoder layers alive whose tensors are real (not meta)."""
    layers = 6
    tiny.model(num_hidden_layers=layers).save_pretrained(tmp_path / "float")
    gc.collect()

    def materialized():
        return {
            id(obj)
            for obj in gc.get_objects()
            if type(obj).__name__ == "LlamaDecoderLayer"
            and any(t.device.type != "meta" for t in [*obj.parameters(), *obj.buffers()])
        }

    # Layers other tests left alive (a compiled model's caches, say) are not the stream's.
    before = materialized()

    def materialized_layers():
        return len(materialized() - before)

    seen = []

    def count(module, args):
        if type(module).__name__ == "LlamaDecoderLayer":
            seen.append(materialized_layers())

    handle = nn.modules.module.register_module_forward_pre_hook(count)
    try:
        stream_quantize(
            tmp_path / "float", tmp_path / "out", activations="static", kv_cache="float8_e4m3fn",
            calibration_ids=tiny.tokens(seed=5), progress=False,
        )  # fmt: skip
    finally:
        handle.remove()
    assert seen == [1] * layers


def test_calibrated_stream_peak_rss_is_one_layer(tiny, tmp_path, rss_reader):
    source = tmp_path / "float"
    layers = 8
    model = tiny.model(hidden_size=512, intermediate_size=1536, num_hidden_layers=layers, vocab_size=2048)
    model.save_pretrained(source)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    del model
    script = rss_reader + textwrap.dedent(
        f"""
        import json, torch
        from qfp8.checkpoint import layerwise, stream, readers
        torch.set_num_threads(1)  # the machine is shared: two threads contend, one is faster here
        source = readers.resolve({str(source)!r})
        stream._linear_names(source, set())
        layerwise._meta_model(source, torch.float32)  # imports done before the baseline
        open("/proc/self/clear_refs", "w").write("5")
        base = rss("VmRSS:")
        ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
        stream.stream_quantize(source, {str(tmp_path / "out")!r}, activations="static", kv_cache="float8_e4m3fn",
                               calibration_ids=ids, progress=False)
        print(json.dumps({{"peak": rss("VmHWM:") - base}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True)
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    print(
        f"float checkpoint {size / 1e6:.1f} MB, {layers} layers of {layer_bytes / 1e6:.1f} MB: peak +{peak / 1e6:.1f} MB"
    )
    # One layer's float weights, its FP8 copy and the temporaries of quantizing its largest weight;
    # holding every layer would need more than 8 x layer_bytes.
    assert peak < 3 * layer_bytes
    assert peak < 0.4 * size
