"""``python -m qfp8``: user errors as one line (status 2), mistyped local paths, sliding-window KV cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import qfp8
from qfp8 import cli
from tests import models


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    """A tiny float Llama checkpoint without a tokenizer."""
    folder = tmp_path_factory.mktemp("float")
    models.tiny_llama(num_hidden_layers=1).save_pretrained(folder)
    return folder


@pytest.fixture
def no_hub(monkeypatch):
    """Records every Hub lookup (resolve() would turn a refusal into FileNotFoundError, hiding it)."""
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="Hub lookups go through huggingface_hub")
    lookups = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: lookups.append(args))
    return lookups


def command_line(monkeypatch, capsys, *args) -> tuple[int, str]:
    """Runs ``main()`` as the installed script does (arguments from sys.argv); returns its status and stderr."""
    monkeypatch.setattr(sys, "argv", ["qfp8", *map(str, args)])
    status = cli.main()
    return status, capsys.readouterr().err


@pytest.mark.parametrize("case", ["block-size", "no-tokenizer"])
def test_user_errors_are_one_line_and_status_2(float_folder, tmp_path, monkeypatch, capsys, case):
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    dst = tmp_path / "out"
    if case == "block-size":
        args = ["quantize", float_folder, dst, "--weight-scale", "block", "--block-size", "0", "0", "--no-progress"]
        expected = "qfp8 quantize: error: block_size must be two positive ints (bn, bk), got (0, 0)\n"
    else:
        args = ["quantize", float_folder, dst, "--activations", "static", "--no-progress"]
        expected = f"qfp8 quantize: error: {float_folder}: no tokenizer ("
    status, err = command_line(monkeypatch, capsys, *args)
    assert status == 2
    assert err.startswith(expected) and err.count("\n") == 1 and "Traceback" not in err
    assert not dst.exists()
    # From Python (an argv list) the exception itself comes out; QFP8_TRACEBACK=1 lets it through on the command line.
    with pytest.raises(ValueError):
        cli.main([str(a) for a in args])
    monkeypatch.setenv("QFP8_TRACEBACK", "1")
    with pytest.raises(ValueError):
        command_line(monkeypatch, capsys, *args)


@pytest.mark.parametrize("path", ["ck/no_such_folder", "./no_such_folder", "ck/a/b", "no_such_folder", "ABSOLUTE"])
@pytest.mark.parametrize("command", ["inspect", "quantize"])
def test_mistyped_local_path_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys, no_hub, path, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()  # "ck/no_such_folder" could be a repo id, but ck is a local folder
    path = str(tmp_path / "missing") if path == "ABSOLUTE" else path
    args = [command, path] + ([str(tmp_path / "out")] if command == "quantize" else [])
    status, err = command_line(monkeypatch, capsys, *args)
    assert status == 2
    assert err == f"qfp8 {command}: error: {path}: no such file or folder (taken as a local path, not a Hub repo id)\n"
    assert no_hub == []
    assert not (tmp_path / "out").exists()


def test_repo_id_shaped_path_still_goes_to_the_hub(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)  # no local folder "someone"
    cli.check_source_path("someone/model-1.5B")  # may be a Hub repo id: not refused here
    with pytest.raises(FileNotFoundError):
        cli.main(["inspect", "someone/model-1.5B"])  # the stub returns nothing: not a folder
    assert no_hub == [("someone/model-1.5B",)]


def test_installed_entry_point_prints_no_traceback(tmp_path):
    (tmp_path / "ck").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "qfp8", "inspect", "ck/no_such_folder"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "qfp8 inspect: error: ck/no_such_folder: no such file or folder (taken as a local path, not a Hub repo id)"
    ]


def test_quantize_kv_cache_of_a_sliding_window_mistral(tmp_path):
    """MistralConfig's default sliding window (4096): ``--kv-cache`` calibrates, writes and the result generates."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    assert config.sliding_window == 4096
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path / "float")
    (tmp_path / "ids.txt").write_text(" ".join(str(i % 100) for i in range(64)) + "\n")
    args = ["quantize", tmp_path / "float", tmp_path / "fp8", "--kv-cache", "float8_e4m3fn"]
    assert cli.main([str(a) for a in args] + ["--calibration-ids", str(tmp_path / "ids.txt"), "--no-progress"]) == 0
    model = qfp8.from_pretrained(tmp_path / "fp8")
    assert model.model.layers[0].self_attn.k_scale.shape == (1,)
    with torch.no_grad():
        out = model.generate(torch.randint(0, 100, (1, 8)), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)


@pytest.mark.parametrize(
    "build",
    [
        lambda c: transformers.LlamaForSequenceClassification(c),  # a "score" head
        lambda c: transformers.LlamaModel(c),  # no head: names without the "model." prefix
    ],
    ids=["classifier", "headless"],
)
def test_quantize_models_that_are_not_causal_lms(tmp_path, build):
    """The CLI finds the linears of the class config.json names, as in-memory quantize does, and writes the
    same tensors."""
    torch.manual_seed(0)
    config = models.tiny_llama_config(vocab_size=100, num_hidden_layers=1, num_labels=3, pad_token_id=0)
    float_model = build(config).eval()
    float_model.save_pretrained(tmp_path / "float")
    assert cli.main(["quantize", str(tmp_path / "float"), str(tmp_path / "cli"), "--no-progress"]) == 0
    reference, _ = qfp8.quantize(type(float_model).from_pretrained(tmp_path / "float").eval())
    qfp8.save_pretrained(reference, tmp_path / "memory")
    from safetensors.torch import load_file

    written = load_file(tmp_path / "cli" / "model.safetensors")
    expected = load_file(tmp_path / "memory" / "model.safetensors")
    assert written.keys() == expected.keys()
    for key, value in written.items():
        assert value.dtype == expected[key].dtype and torch.equal(
            value.view(torch.uint8), expected[key].view(torch.uint8)
        ), key
    ids = torch.randint(1, 100, (1, 7))
    loaded = type(float_model).from_pretrained(tmp_path / "cli").eval()  # transformers reads it
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids)[0], reference(ids)[0], rtol=1e-4, atol=1e-4)


class CalibrationStarted(Exception):
    pass


@pytest.mark.parametrize("case", ["max-shard-size", "dst-cannot-be-created", "valid"])
def test_quantize_checks_shard_size_and_dst_before_calibrating(float_folder, tmp_path, monkeypatch, capsys, case):
    """A typo in --max-shard-size, or a DST that cannot be written, fails before the (long) calibration starts."""
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    from qfp8.checkpoint import stream

    def calibration(*args, **kwargs):  # stands for the calibration / GPTQ pass: hours on a large model
        raise CalibrationStarted

    monkeypatch.setattr(stream.layerwise, "calibrate_layerwise", calibration)
    (tmp_path / "ids.txt").write_text(" ".join(str(i % 128) for i in range(64)) + "\n")
    dst, options = tmp_path / "out", ["--max-shard-size", "2GiBB"]
    expected = "qfp8 quantize: error: max_shard_size must be a positive size like '5GB' or an int of bytes, got '2GiBB'"
    if case == "dst-cannot-be-created":
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs Linux's /proc, where no folder can be created")
        dst, options = Path("/proc/qfp8_test_out/fp8"), []
        expected = f"qfp8 quantize: error: DST {dst}: cannot write there (it would be created in /proc): "
    elif case == "valid":
        options = ["--max-shard-size", "2GiB"]
    args = ["quantize", float_folder, dst, "--accuracy", "gptq", "--calibration-ids", tmp_path / "ids.txt"]
    if case == "valid":  # the same command with good options gets as far as calibrating
        with pytest.raises(CalibrationStarted):
            command_line(monkeypatch, capsys, *args, *options, "--no-progress")
        return
    status, err = command_line(monkeypatch, capsys, *args, *options, "--no-progress")
    assert status == 2
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not dst.exists()


@pytest.mark.parametrize("case", ["text-folder", "ids-folder", "text-not-utf8", "text-missing"])
def test_unreadable_calibration_file_is_one_line_naming_it(float_folder, tmp_path, monkeypatch, capsys, case):
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00text")
    path, option, expected = {
        "text-folder": (tmp_path, "--calibration", f"calibration text file {tmp_path} is a folder, not a file"),
        "ids-folder": (tmp_path, "--calibration-ids", f"--calibration-ids file {tmp_path} is a folder, not a file"),
        "text-not-utf8": (
            tmp_path / "binary.txt",
            "--calibration",
            f"calibration text file {tmp_path / 'binary.txt'} is not UTF-8 text (byte 0: invalid start byte)",
        ),
        "text-missing": (
            tmp_path / "none.txt",
            "--calibration",
            f"calibration text file {tmp_path / 'none.txt'}: no such",
        ),
    }[case]
    dst = tmp_path / "out"
    args = ["quantize", float_folder, dst, "--activations", "static", option, path, "--no-progress"]
    status, err = command_line(monkeypatch, capsys, *args)
    assert status == 2
    assert err.startswith(f"qfp8 quantize: error: {expected}") and err.count("\n") == 1, err
    assert not dst.exists()


@pytest.fixture(scope="module")
def folder_with_tokenizer(float_folder, tmp_path_factory):
    """``float_folder`` with a word-level tokenizer and no chat template."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("with_tokenizer") / "model"
    shutil.copytree(float_folder, folder)
    words = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("the a of to and in is it".split())}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny float GPT-2 checkpoint (its linear layers are transformers' Conv1D) without a tokenizer."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "case",
    ["json-is-a-folder", "json-folder-missing", "no-schemes", "empty-prompt", "no-tokenizer", "gpt2-no-tokenizer"],
)
def test_demo_argument_errors_come_before_the_work(
    folder_with_tokenizer, float_folder, gpt2_folder, tmp_path, monkeypatch, capsys, case
):
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    model = {"no-tokenizer": float_folder, "gpt2-no-tokenizer": gpt2_folder}.get(case, folder_with_tokenizer)
    args = ["demo", "--model", model, "--quick", "--schemes", "bf16"]
    expected = {
        "json-is-a-folder": f"--json {tmp_path} is a folder",
        "json-folder-missing": f"the folder {tmp_path / 'nowhere'} does not exist",
        "no-schemes": "--schemes names no scheme",
        "empty-prompt": "--prompt gives no tokens",
        # transformers builds GPT-2's tokenizer from config.json alone: it gave no token for the prompt
        "no-tokenizer": f"--model {model}: the folder has no tokenizer (none of tokenizer.json, ",
        "gpt2-no-tokenizer": f"--model {model}: the folder has no tokenizer (none of tokenizer.json, ",
    }[case]
    if case == "json-is-a-folder":
        args += ["--json", tmp_path]
    elif case == "json-folder-missing":
        args += ["--json", tmp_path / "nowhere" / "out.json"]
    elif case == "no-schemes":
        args[-1] = ","
    elif case == "empty-prompt":
        args += ["--prompt", ""]
    loaded = []
    if case != "empty-prompt":  # these are refused before the model is loaded
        monkeypatch.setattr("qfp8.evaluate.load_model", lambda *a, **k: loaded.append(1))
    status, err = command_line(monkeypatch, capsys, *args)
    assert status == 2 and not loaded
    last = err.splitlines()[-1]  # transformers' loading progress bar may come first
    assert last.startswith("qfp8 demo: error: demo: ") and expected in last and "Traceback" not in err, err


@pytest.mark.parametrize(
    "options, message",
    [
        (["--block-size", "64", "64"], "--block-size applies to --weight-scale block, not channel"),
        (["--activation-scale", "group"], "--activation-scale applies to --activations dynamic"),
        (["--activations", "static", "--activation-scale", "token"], "(static input scales are per tensor)"),
        (["--calibration-tokens", "64"], "--calibration-tokens: nothing to calibrate"),
        (["--kv-cache", "float8_e4m3fn", "--calibration", "a.txt", "--calibration-ids", "b.txt"], "not both"),
        # --calibration-ids are used whole: a token count would be silently ignored
        *(
            (
                ["--activations", "static", "--calibration-ids", "ids.txt", "--calibration-tokens", n],
                "--calibration-tokens applies to calibration text, not --calibration-ids",
            )
            for n in ("64", "100000")
        ),
        # a count below 2 is refused whatever else is given (--calibration-ids included)
        *(
            (options, f"--calibration-tokens must be at least 2 (tokens of calibration text), got {n}")
            for n in ("0", "-5", "1")
            for options in (
                ["--activations", "static", "--calibration-tokens", n],
                ["--kv-cache", "float8_e4m3fn", "--calibration", "a.txt", "--calibration-tokens", n],
                ["--activations", "static", "--calibration-ids", "ids.txt", "--calibration-tokens", n],
                ["--calibration-tokens", n],
            )
        ),
        (["--accuracy", "gptq", "--calibration-batch-size", "0"], "--calibration-batch-size must be at least 1, got 0"),
    ],
)
def test_quantize_refuses_options_it_would_ignore(float_folder, tmp_path, monkeypatch, capsys, options, message):
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    status, err = command_line(monkeypatch, capsys, "quantize", float_folder, tmp_path / "out", *options)
    assert status == 2 and err.startswith("qfp8 quantize: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["gpt2-all-excluded", "all-excluded", "head-only"])
def test_quantize_refuses_a_model_with_nothing_to_quantize(
    float_folder, gpt2_folder, tmp_path, monkeypatch, capsys, case
):
    """Nothing left to quantize: no float checkpoint labelled compressed-tensors (empty config_groups) is written,
    saying only "0 linear layers quantized"; it is refused before anything is written. GPT-2's Conv1D layers
    count as linear layers."""
    monkeypatch.delenv("QFP8_TRACEBACK", raising=False)
    dst = tmp_path / "out"
    if case == "gpt2-all-excluded":
        args, expected = (
            [gpt2_folder, dst, "--exclude", "lm_head", "c_*"],
            (
                f"qfp8 quantize: error: {gpt2_folder}: nothing to quantize in GPT2LMHeadModel: every nn.Linear of it "
                "is kept in float (4 excluded by --exclude c_*; 1 excluded by --exclude lm_head); give --exclude "
                "patterns that leave some to quantize; no checkpoint written\n"
            ),
        )
    elif case == "all-excluded":
        args, expected = (
            [float_folder, dst, "--exclude", "lm_head", "*_proj"],
            (
                f"qfp8 quantize: error: {float_folder}: nothing to quantize in LlamaForCausalLM: every nn.Linear of it "
                "is kept in float (7 excluded by --exclude *_proj; 1 excluded by --exclude lm_head); give --exclude "
                "patterns that leave some to quantize; no checkpoint written\n"
            ),
        )
    else:  # the head alone, at the default exclusion
        args, expected = [float_folder, dst, "--exclude", "*_proj"], None
    status, err = command_line(monkeypatch, capsys, "quantize", *args, "--no-progress")
    if expected is None:
        assert status == 0 and (dst / "model.safetensors").is_file()
        return
    assert (status, err) == (2, expected)
    assert not dst.exists()  # no half-written folder
    with pytest.raises(ValueError, match="nothing to quantize"):
        cli.main(["quantize", *map(str, args)])  # from Python: the exception itself


def test_quantize_exclude_before_src_dst_says_what_it_took(float_folder, tmp_path, monkeypatch, capsys):
    """``--exclude`` takes any number of patterns: before SRC DST it took them too, and argparse said only
    "the following arguments are required: src, dst"."""
    dst = tmp_path / "out"
    with pytest.raises(SystemExit) as raised:
        command_line(monkeypatch, capsys, "quantize", "--exclude", "lm_head", float_folder, dst)
    assert raised.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "qfp8 quantize: error: the following arguments are required: src, dst (--exclude took 'lm_head', "
        f"'{float_folder}', '{dst}' as its values: write src dst before --exclude, or end its values with -- and put src dst last)"
    )
    with pytest.raises(SystemExit):  # SRC before, DST after: it took DST
        command_line(monkeypatch, capsys, "quantize", float_folder, "--exclude", "lm_head", dst)
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "required: dst (--exclude took 'lm_head', "
            f"'{dst}' as its values: write src dst before --exclude, or end its values with -- and put src dst last)"
        )
    )
    assert not dst.exists()
    # The forms the message gives work: patterns after SRC DST, or ended by --.
    for i, form in enumerate(
        (
            [float_folder, dst / "0", "--exclude", "lm_head", "*.down_proj"],
            ["--exclude", "lm_head", "*.down_proj", "--", float_folder, dst / "1"],
        )
    ):
        assert cli.main(["quantize", "--no-progress", *map(str, form)]) == 0
        ignored = json.loads((dst / str(i) / "config.json").read_text())["quantization_config"]["ignore"]
        assert sorted(ignored) == ["lm_head", "model.layers.0.mlp.down_proj"]


def test_every_option_of_many_values_says_when_it_took_the_positionals(monkeypatch, capsys):
    """Each subcommand's options taking any number of values (nargs "*" or "+"), now and to come."""
    import argparse
    import importlib

    checked = []
    for command, (module, _) in cli.SUBCOMMANDS.items():
        parser = cli.SubcommandParser(prog=f"qfp8 {command}")
        importlib.import_module(module).add_arguments(parser)
        positionals = [
            a.dest for a in parser._actions if not a.option_strings and a.nargs in (None, argparse.ONE_OR_MORE)
        ]
        for action in parser._actions:
            if not positionals or not action.option_strings or action.nargs not in ("*", "+"):
                continue
            option = action.option_strings[-1]
            values = ["x", *(f"{name}-value" for name in positionals)]
            with pytest.raises(SystemExit):
                command_line(monkeypatch, capsys, command, option, *values)
            hint = f"({option} took {', '.join(map(repr, values))} as its values: write {' '.join(positionals)} before"
            assert hint in capsys.readouterr().err
            checked.append((command, option))
    assert ("quantize", "--exclude") in checked
