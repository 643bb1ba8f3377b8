"""Streaming quantization (``qfp8 quantize``) and ``qfp8 inspect``."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import save_file

import qfp8
from qfp8.cli import main

CASES = {
    "channel": ["--weight-scale", "channel"],
    "tensor-a-token": ["--weight-scale", "tensor", "--activations", "dynamic"],
    "channel-a-token-mse": ["--activations", "dynamic", "--activation-scale", "token-mse"],
    "block": ["--weight-scale", "block", "--block-size", "32", "32"],
}
KWARGS = {
    "channel": dict(weight_scale="channel"),
    "tensor-a-token": dict(weight_scale="tensor", activations="dynamic"),
    "channel-a-token-mse": dict(weight_scale="channel", activations="dynamic", activation_scale="token-mse"),
    "block": dict(weight_scale="block", block_size=(32, 32)),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_stream_equals_in_memory_bitwise(tiny, tmp_path, case):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source, max_shard_size="100KB")  # sharded source
    assert (source / "model.safetensors.index.json").exists()
    assert (
        main(
            [
                "quantize",
                str(source),
                str(tmp_path / "stream"),
                "--no-progress",
                "--max-shard-size",
                "90KB",
                *CASES[case],
            ]
        )
        == 0
    )
    model = tiny.model(torch.bfloat16)
    qfp8.quantize(model, **KWARGS[case])
    qfp8.save_pretrained(model, tmp_path / "memory")
    streamed, in_memory = tiny.tensors(tmp_path / "stream"), tiny.tensors(tmp_path / "memory")
    assert streamed.keys() == in_memory.keys()
    for key, value in in_memory.items():
        assert streamed[key].dtype == value.dtype, key
        assert torch.equal(streamed[key].view(torch.uint8), value.view(torch.uint8)), key
    streamed_qc = json.loads((tmp_path / "stream" / "config.json").read_text())["quantization_config"]
    memory_qc = json.loads((tmp_path / "memory" / "config.json").read_text())["quantization_config"]
    assert streamed_qc == memory_qc
    assert len(list((tmp_path / "stream").glob("model-*.safetensors"))) > 1
    x = tiny.tokens()
    with torch.no_grad():
        assert torch.equal(qfp8.from_pretrained(tmp_path / "stream")(x).logits, model(x).logits)


def test_stream_refuses_quantized_sources(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model().save_pretrained(source)
    main(["quantize", str(source), str(tmp_path / "q"), "--no-progress"])
    with pytest.raises(ValueError, match="already quantized"):
        main(["quantize", str(tmp_path / "q"), str(tmp_path / "q2"), "--no-progress"])


def test_stream_refuses_to_write_into_its_source(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model().save_pretrained(source)
    (tmp_path / "link").symlink_to(source)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    for dst in (source, tmp_path / "float" / ".." / "float", tmp_path / "link"):
        with pytest.raises(ValueError, match=r"^DST .* is the source folder .*float; writing there"):
            main(["quantize", str(source), str(dst), "--no-progress"])
    with pytest.raises(ValueError, match=r"^DST: .*config\.json is a file, not a folder"):
        main(["quantize", str(source), str(source / "config.json"), "--no-progress"])
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # nothing written
    # A folder inside it is another folder.
    assert main(["quantize", str(source), str(source / "fp8"), "--no-progress"]) == 0
    assert qfp8.from_pretrained(source / "fp8") is not None


def test_stream_exclude_pattern_matching_nothing_warns(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model().save_pretrained(source)
    with pytest.warns(UserWarning, match=r"qfp8 quantize: exclude pattern 'lm_haed' matches no nn.Linear"):
        main(["quantize", str(source), str(tmp_path / "q"), "--no-progress", "--exclude", "lm_haed"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default, and a pattern that matches, stay quiet
        warnings.filterwarnings("ignore", "vLLM's CPU engine")  # W8A16: no kernel there (tests/vllm)
        main(["quantize", str(source), str(tmp_path / "q2"), "--no-progress"])
        # (lm_head too: a quantized one is a checkpoint vLLM refuses, with its own warning)
        main(["quantize", str(source), str(tmp_path / "q3"), "--no-progress", "--exclude", "lm_head", "*.down_proj"])
    excluded = qfp8.from_pretrained(tmp_path / "q3").model.layers[0].mlp.down_proj
    assert type(excluded) is torch.nn.Linear


def test_stream_peak_rss_is_bounded_by_largest_tensor(tiny, tmp_path, rss_reader):
    source = tmp_path / "float"
    model = tiny.model(torch.float32, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, vocab_size=2048)
    model.save_pretrained(source)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    largest = max(p.numel() * 4 for p in model.parameters())
    del model
    script = rss_reader + textwrap.dedent(
        f"""
        import json, resource, sys
        from qfp8.checkpoint import stream, readers
        import transformers, torch  # imported before the baseline
        stream._linear_names(readers.resolve({str(source)!r}), set())
        open("/proc/self/clear_refs", "w").write("5")
        base = rss("VmRSS:")
        stream.stream_quantize({str(source)!r}, {str(tmp_path / "out")!r}, progress=False)
        print(json.dumps({{"peak": rss("VmHWM:") - base}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    print(f"float checkpoint {size / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB, peak RSS +{peak / 1e6:.1f} MB")
    assert peak < 4 * largest + 16e6
    assert peak < 0.5 * size


def test_inspect(tiny, tmp_path, capsys):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="block", block_size=(32, 32), activations="dynamic", activation_scale="group")
    qfp8.save_pretrained(model, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "format: compressed-tensors" in text
    assert "model.layers.*.self_attn.q_proj" in text and "w-e4m3fn-block32x32 a-dynamic-group" in text
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantized_modules"] == 14 and sum(g["count"] for g in info["groups"]) == 14
    assert info["kv_cache"]["dtype"] is None


def test_leftover_temporary_files_of_a_killed_write_are_removed(tiny, tmp_path):
    """SIGKILL while writing leaves hidden partial shards; the next write into the folder removes them (only them)."""
    source, dst = tmp_path / "float", tmp_path / "fp8"
    tiny.model().save_pretrained(source)
    dst.mkdir()
    leftovers = [
        ".model-00002-of-00003.safetensors.qfp8-k2_x9ab0.tmp",  # named as AtomicDirectoryWrite names them
        ".config.json.qfp8-abcdefgh.tmp",
        ".tokenizer.json.qfp8-00000000.tmp",
        ".model.safetensors.q1w2e3r4.tmp",  # as earlier qfp8 versions named them
        ".model.safetensors.index.json.zz_9yy8x.tmp",
    ]
    users = [
        ".notes.abcdefgh.tmp",  # the earlier pattern, but not a checkpoint file's name
        "model.safetensors.qfp8-abcdefgh.tmp",  # not hidden
        ".model.safetensors.qfp8-abc.tmp",  # not 8 random characters
        ".model.safetensors.qfp8-ABCDEFGH.tmp",
        ".model.safetensors.qfp8-abcdefgh.tmp.bak",
        "scratch.tmp",
    ]
    for name in leftovers + users:
        (dst / name).write_bytes(b"partial")
    (dst / ".config.json.qfp8-fedcba98.tmp").mkdir()  # a folder is never removed
    main(["quantize", str(source), str(dst), "--no-progress"])
    assert sorted(p.name for p in dst.iterdir() if "tmp" in p.name) == sorted(
        users + [".config.json.qfp8-fedcba98.tmp"]
    )
    assert all((dst / name).read_bytes() == b"partial" for name in users)
    assert qfp8.from_pretrained(dst) is not None


def test_sigterm_while_writing_removes_the_temporary_files(tiny, tmp_path, monkeypatch):
    """SIGTERM (``timeout``, schedulers, ``docker stop``) stops ``qfp8 quantize`` as Ctrl-C does: no partial shard."""
    from qfp8.checkpoint import stream

    source, dst = tmp_path / "float", tmp_path / "fp8"
    tiny.model().save_pretrained(source)
    dst.mkdir()
    (dst / "mine.txt").write_text("kept")
    quantize_rows, seen = stream.quantize_rows, []

    def terminated_while_writing(*args):
        seen.append(sorted(p.name for p in tmp_path.glob(".fp8.qfp8-stage-*/*")))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        return quantize_rows(*args)

    def not_ours(signum, frame):
        raise AssertionError("SIGTERM reached the test's own handler, not qfp8 quantize's")

    monkeypatch.setattr(stream, "quantize_rows", terminated_while_writing)
    previous = signal.signal(signal.SIGTERM, not_ours)  # without qfp8's handler, the default would end pytest
    try:
        with pytest.raises(SystemExit) as stopped:
            main(["quantize", str(source), str(dst), "--no-progress"])
        assert signal.getsignal(signal.SIGTERM) is not_ours  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "model.safetensors" in seen[0]  # it was writing a shard, in the staging folder beside dst
    assert sorted(p.name for p in dst.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float", "fp8"]  # no staging folder, no lock file


@pytest.mark.parametrize("case", ["channel", "block"])
def test_stream_quantizes_a_tied_head_as_quantize_does(tiny, tmp_path, case, capsys):
    """A tied table (stored once, under lm_head.weight by transformers 5) with nothing excluded: the FP8 head and
    the embedding as its dequantized rows, as qfp8.quantize + save_pretrained write them, bit for bit."""
    source = tmp_path / "float"
    tiny.model(torch.bfloat16, tie_word_embeddings=True).save_pretrained(source)
    stored = tiny.tensors(source)
    assert ("lm_head.weight" in stored) != ("model.embed_tokens.weight" in stored)  # one copy of the table
    assert main(["quantize", str(source), str(tmp_path / "stream"), "--no-progress", *CASES[case], "--exclude"]) == 0
    model = tiny.model(torch.bfloat16, tie_word_embeddings=True)
    qfp8.quantize(model, exclude=(), **KWARGS[case])
    qfp8.save_pretrained(model, tmp_path / "memory")
    streamed, in_memory = tiny.tensors(tmp_path / "stream"), tiny.tensors(tmp_path / "memory")
    assert streamed.keys() == in_memory.keys() and "lm_head.weight_scale" in streamed
    for key, value in in_memory.items():
        assert streamed[key].dtype == value.dtype, key
        assert torch.equal(streamed[key].view(torch.uint8), value.view(torch.uint8)), key
    streamed_config = json.loads((tmp_path / "stream" / "config.json").read_text())
    memory_config = json.loads((tmp_path / "memory" / "config.json").read_text())
    assert streamed_config["quantization_config"] == memory_config["quantization_config"]
    for config in (streamed_config, memory_config):
        assert config["tie_word_embeddings"] is False
        assert config["qfp8_tied_embeddings"] == {"model.embed_tokens": "lm_head"}
    loaded = qfp8.from_pretrained(tmp_path / "stream")
    assert loaded.get_input_embeddings().head is loaded.lm_head
    assert main(["inspect", str(tmp_path / "stream")]) == 0
    assert "tied: model.embed_tokens holds lm_head's FP8 weight dequantized" in capsys.readouterr().out
    x = tiny.tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def tied_source(tiny, directory, names):
    """A float tied checkpoint storing its table under ``names`` (lm_head.weight, as transformers 5 writes
    it, and/or model.embed_tokens.weight)."""
    tiny.model(torch.bfloat16, tie_word_embeddings=True).save_pretrained(directory)
    tensors = tiny.tensors(directory)
    table = tensors.pop("model.embed_tokens.weight", None)
    table = tensors.pop("lm_head.weight", table)
    tensors.update({name: table.clone() for name in names})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return table


@pytest.mark.parametrize(
    "stored", [["lm_head.weight"], ["model.embed_tokens.weight"], ["lm_head.weight", "model.embed_tokens.weight"]]
)
def test_stream_keeps_a_tied_head_float_by_default_and_when_its_embedding_is_excluded(tiny, tmp_path, stored):
    source = tmp_path / "float"
    tied_source(tiny, source, stored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # '*embed_tokens' acts on the tied head: no "matches nothing" warning
        warnings.filterwarnings("ignore", "vLLM's CPU engine")  # W8A16: no kernel there (tests/vllm)
        assert main(["quantize", str(source), str(tmp_path / "default"), "--no-progress"]) == 0
        code = main(
            ["quantize", str(source), str(tmp_path / "excluded"), "--no-progress", "--exclude", "*embed_tokens"]
        )
    assert code == 0
    model = tiny.model(torch.bfloat16, tie_word_embeddings=True)
    x = tiny.tokens()
    for folder in ("default", "excluded"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["tie_word_embeddings"] is True and "qfp8_tied_embeddings" not in config
        assert "lm_head" in config["quantization_config"]["ignore"]
        tensors = tiny.tensors(tmp_path / folder)
        assert not any(k.endswith("weight_scale") and ("lm_head" in k or "embed" in k) for k in tensors)
        loaded = qfp8.from_pretrained(tmp_path / folder)  # whichever name holds the table
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
        with torch.no_grad():
            assert torch.isfinite(loaded(x).logits).all()


@pytest.mark.parametrize("stored", [["lm_head.weight"], ["lm_head.weight", "model.embed_tokens.weight"]])
def test_stream_ties_a_table_stored_under_either_or_both_names(tiny, tmp_path, stored):
    source = tmp_path / "float"
    tied_source(tiny, source, stored)
    assert main(["quantize", str(source), str(tmp_path / "stream"), "--no-progress", "--exclude"]) == 0
    model = tiny.model(torch.bfloat16, tie_word_embeddings=True)
    qfp8.quantize(model, exclude=())
    qfp8.save_pretrained(model, tmp_path / "memory")
    streamed, in_memory = tiny.tensors(tmp_path / "stream"), tiny.tensors(tmp_path / "memory")
    assert streamed.keys() == in_memory.keys()
    assert all(torch.equal(streamed[k].view(torch.uint8), v.view(torch.uint8)) for k, v in in_memory.items())


def test_stream_warns_when_your_patterns_leave_a_tied_head_in(tiny, tmp_path):
    tied_source(tiny, tmp_path / "float", ["model.embed_tokens.weight"])
    with pytest.warns(UserWarning, match=r"'lm_head' and its tied embedding 'model.embed_tokens' are quantized"):
        code = main(
            ["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--no-progress", "--exclude", "*.down_proj"]
        )
    assert code == 0 and "qfp8_tied_embeddings" in json.loads((tmp_path / "q" / "config.json").read_text())


def test_stream_of_two_different_tables_under_the_tied_names_unties_them(tiny, tmp_path):
    """transformers does not tie a checkpoint's two different tables either: the head is quantized from its own."""
    source = tmp_path / "float"
    table = tied_source(tiny, source, ["lm_head.weight"])
    tensors = tiny.tensors(source)
    tensors["model.embed_tokens.weight"] = table * 2
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert main(["quantize", str(source), str(tmp_path / "stream"), "--no-progress", "--exclude"]) == 0
    config = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "qfp8_tied_embeddings" not in config
    written = tiny.tensors(tmp_path / "stream")
    assert written["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(written["model.embed_tokens.weight"], table * 2)
    loaded = qfp8.from_pretrained(tmp_path / "stream")
    assert type(loaded.get_input_embeddings()) is torch.nn.Embedding


def test_stream_keeps_a_head_float_where_quantize_does_and_writes_a_tied_bias(tiny, tmp_path):
    """T5's table has three holders (shared, encoder and decoder embed_tokens): quantize keeps lm_head float,
    and so does the CLI. BERT's decoder.bias is stored as cls.predictions.bias only: the CLI writes it under the
    quantized decoder's name too, as save_pretrained does."""
    import transformers

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=300, d_model=64, d_kv=16, d_ff=96, num_layers=1, num_decoder_layers=1, num_heads=4,
            tie_word_embeddings=True, decoder_start_token_id=0,
        )
    ).eval()  # fmt: skip
    t5.save_pretrained(tmp_path / "t5")
    assert main(["quantize", str(tmp_path / "t5"), str(tmp_path / "t5q"), "--no-progress", "--exclude"]) == 0
    config = json.loads((tmp_path / "t5q" / "config.json").read_text())
    assert "lm_head" in config["quantization_config"]["ignore"] and "qfp8_tied_embeddings" not in config
    ids = torch.randint(3, 300, (1, 8))
    in_memory = qfp8.quantize(copy.deepcopy(t5), exclude=()).model
    with torch.no_grad():
        loaded = qfp8.from_pretrained(tmp_path / "t5q")
        assert torch.equal(
            loaded(input_ids=ids, decoder_input_ids=ids[:, :5]).logits,
            in_memory(input_ids=ids, decoder_input_ids=ids[:, :5]).logits,
        )
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=96)
    ).eval()  # fmt: skip
    bert.save_pretrained(tmp_path / "bert")
    assert "cls.predictions.decoder.bias" not in tiny.tensors(tmp_path / "bert")
    assert main(["quantize", str(tmp_path / "bert"), str(tmp_path / "bertq"), "--no-progress", "--exclude"]) == 0
    in_memory = qfp8.quantize(copy.deepcopy(bert), exclude=()).model
    qfp8.save_pretrained(in_memory, tmp_path / "bertm")
    streamed, saved = tiny.tensors(tmp_path / "bertq"), tiny.tensors(tmp_path / "bertm")
    assert streamed.keys() == saved.keys()
    assert all(torch.equal(streamed[k].view(torch.uint8), v.view(torch.uint8)) for k, v in saved.items())
    with torch.no_grad():
        assert torch.equal(
            qfp8.from_pretrained(tmp_path / "bertq")(input_ids=ids).logits, in_memory(input_ids=ids).logits
        )


def test_a_table_the_model_computes_and_transformers_does_not_save_is_computed_on_load(tiny, tmp_path):
    """Marian's sinusoidal position tables are left out by transformers' save_pretrained (and so by the CLI's
    output): from_pretrained computes them as transformers does, where it had refused the folder."""
    import transformers

    config = transformers.MarianConfig(
        vocab_size=200, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=48,
        pad_token_id=199, decoder_start_token_id=199,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    model.save_pretrained(tmp_path / "float")
    assert not any("embed_positions" in key for key in tiny.tensors(tmp_path / "float"))
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "fp8"), "--no-progress"]) == 0
    loaded = qfp8.from_pretrained(tmp_path / "fp8")
    for part in ("encoder", "decoder"):
        table = getattr(loaded.model, part).embed_positions.weight
        assert torch.equal(table, getattr(model.model, part).embed_positions.weight)
    qfp8.quantize(model)
    ids = torch.randint(0, 199, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, decoder_input_ids=ids).logits, model(input_ids=ids, decoder_input_ids=ids).logits
        )


def test_a_missing_stored_tensor_is_still_refused(tiny, tmp_path):
    source = tmp_path / "float"
    tiny.model(torch.bfloat16).save_pretrained(source)
    assert main(["quantize", str(source), str(tmp_path / "fp8"), "--no-progress"]) == 0
    state = tiny.tensors(tmp_path / "fp8")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the model needs: model.norm.weight"):
        qfp8.from_pretrained(tmp_path / "fp8")


def test_stream_writes_the_config_keys_save_pretrained_writes(tiny, tmp_path):
    """The CLI writes config.json as qfp8.save_pretrained does, not a copy of the source's: transformers 5 writes
    rope_parameters only, so vLLM on transformers 4 would run this Llama-3-style model with RoPE base 10000. A
    folder without architectures (converted from GGUF) gets the class built, as qfp8.save_pretrained writes."""
    model = tiny.model(torch.bfloat16, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    model.save_pretrained(tmp_path / "float")
    source = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "rope_theta" not in source
    del source["architectures"]
    (tmp_path / "float" / "config.json").write_text(json.dumps(source))
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "fp8"), "--no-progress"]) == 0
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "memory")
    in_memory = json.loads((tmp_path / "memory" / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "architectures", "quantization_config"):
        assert written[key] == in_memory[key], key
    assert written["rope_theta"] == 500000.0 and written["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("case", ["wrong-shape", "missing-weight", "config-hidden-size", "config-layers"])
def test_stream_refuses_a_checkpoint_its_config_does_not_describe(tiny, tmp_path, case):
    """Each is refused with nothing written: otherwise the missing Linear would be kept float as "tied to another
    tensor" and the wrong shapes quantized as stored, an output qfp8.from_pretrained refuses."""
    source = tmp_path / "float"
    tiny.model().save_pretrained(source)
    state = tiny.tensors(source)
    key = next(k for k in sorted(state) if k.endswith("layers.1.mlp.down_proj.weight"))
    config = json.loads((source / "config.json").read_text())
    if case == "wrong-shape":
        state[key] = state[key][:, :10].contiguous()
        match = rf"model\.safetensors: {key} has shape \[\d+, 10\], but the model config.json describes .* expects"
    elif case == "missing-weight":
        del state[key]
        match = rf"{key} is not stored in the checkpoint, but the model config.json describes .* has that Linear"
    elif case == "config-hidden-size":
        config["hidden_size"] += 32
        match = r"has shape .* expects .*; the checkpoint and its config.json do not match"
    else:
        config["num_hidden_layers"] += 1
        match = r"layers\.\d+\.\S+\.weight is not stored in the checkpoint"
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        main(["quantize", str(source), str(tmp_path / "fp8"), "--no-progress"])
    assert not (tmp_path / "fp8").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_stream_refuses_a_nonfinite_weight_before_writing(tiny, tmp_path, bad):
    # As quantize refuses it: the FP8 codes and scale would be NaN, a checkpoint that loads nowhere.
    source = tmp_path / "float"
    tiny.model().save_pretrained(source)
    state = tiny.tensors(source)
    key = next(k for k in sorted(state) if k.endswith("down_proj.weight"))
    state[key][1, 2] = bad
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    module = key.removesuffix(".weight")
    with pytest.raises(ValueError, match=rf"model\.safetensors: {key} \[\d+, \d+\] holds NaN/Inf.*--exclude {module}"):
        main(["quantize", str(source), str(tmp_path / "fp8"), "--no-progress"])
    assert not (tmp_path / "fp8").exists()
    # Excluded, the layer stays float and the rest is quantized.
    assert main(["quantize", str(source), str(tmp_path / "fp8"), "--no-progress", "--exclude", module]) == 0
