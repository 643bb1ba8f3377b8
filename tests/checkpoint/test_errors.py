"""Bad input: every error names the file, the tensor and the sizes involved; pickle is never loaded."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import qfp8
from qfp8.cli import main


@pytest.fixture
def saved(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="channel")
    qfp8.save_pretrained(model, tmp_path)
    return tmp_path


def _rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_pickle_files_are_refused(saved, monkeypatch):
    (saved / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, saved / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: refusing to load a pickle"):
        qfp8.from_pretrained(saved)
    with pytest.raises(ValueError, match="refusing to load a pickle"):
        qfp8.from_pretrained(saved / "pytorch_model.bin")


def test_a_gguf_file_is_refused_with_the_way_to_quantize_it(saved):
    """It had said "no *.safetensors file", as if the folder were empty."""
    (saved / "model.safetensors").unlink()
    (saved / "model-Q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(
        ValueError, match=r"holds a GGUF file \(model-Q8_0\.gguf\) and no \*\.safetensors file; .*gguf_file"
    ):
        qfp8.from_pretrained(saved)
    with pytest.raises(ValueError, match=r"model-Q8_0\.gguf is a GGUF file; qfp8 reads safetensors"):
        main(["quantize", str(saved / "model-Q8_0.gguf"), str(saved / "out"), "--no-progress"])


def test_truncated_file(saved):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor '.*' .* ends at byte \d+, past the end of the file \(\d+ bytes\)"
    ):
        qfp8.from_pretrained(saved)


def test_corrupt_header(saved):
    path = saved / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json at!"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt safetensors header"):
        qfp8.from_pretrained(saved)
    path.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file \(2 bytes"):
        qfp8.from_pretrained(saved)


def test_missing_scale(saved):
    _rewrite(saved, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.mlp\.up_proj\.weight is a torch\.float8_e4m3fn \[128, 64\] weight with no scale",
    ):
        qfp8.from_pretrained(saved)


def test_scale_shape_mismatch(saved):
    _rewrite(saved, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(64, 1)}))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale has shape \[64, 1\].*\[128, 64\]"
    ):
        qfp8.from_pretrained(saved)


def test_weight_shape_mismatch(saved):
    def change(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64).to(torch.float8_e4m3fn)
        t["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(96, 1)

    _rewrite(saved, change)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[96, 64\], the model expects \[128, 64\]",
    ):
        qfp8.from_pretrained(saved)


def test_dtype_mismatch(saved):
    _rewrite(saved, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight is torch\.float32 \[128, 64\].*expected an FP8 weight",
    ):
        qfp8.from_pretrained(saved)
    _rewrite(saved, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32),
                                         "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64).to(torch.float8_e4m3fn)}))  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' is torch\.int32, the model expects"):
        qfp8.from_pretrained(saved)


def test_unknown_quant_method(saved):
    config = json.loads((saved / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: unknown quant_method 'gptq'"):
        qfp8.from_pretrained(saved)


def test_unknown_kv_cache_dtype(saved):
    from qfp8.checkpoint import config as qconfig

    config = json.loads((saved / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = qconfig.kv_cache_scheme(torch.float8_e4m3fn)
    config["quantization_config"]["qfp8_kv_cache_dtype"] = "int8"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: qfp8_kv_cache_dtype 'int8' is not an FP8 dtype"):
        qfp8.from_pretrained(saved)


def test_float_checkpoint_and_missing_tensor(tiny, saved, tmp_path_factory):
    _rewrite(saved, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the model needs: model\.norm\.weight"):
        qfp8.from_pretrained(saved)
    float_dir = tmp_path_factory.mktemp("float")
    tiny.model().save_pretrained(float_dir)
    with pytest.raises(ValueError, match="has no quantization_config"):
        qfp8.from_pretrained(float_dir)


def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(ValueError, match="has no QLinear"):
        qfp8.save_pretrained(tiny.model(), tmp_path)
    with pytest.raises(TypeError, match="takes an nn.Module"):
        qfp8.save_pretrained({"a": 1}, tmp_path)
    model = tiny.model()
    qfp8.quantize(model)
    with pytest.raises(ValueError, match="max_shard_size"):
        qfp8.save_pretrained(model, tmp_path, max_shard_size="lots")
    with pytest.raises(ValueError, match=r"max_shard_size '50' without a unit is 50 bytes; give a unit, like '50GB'"):
        qfp8.save_pretrained(model, tmp_path, max_shard_size="50")  # a command line's --max-shard-size 50
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        qfp8.from_pretrained(tmp_path / "nowhere")


@pytest.fixture
def saved_static(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="channel", activations="static", kv_cache="float8_e4m3fn")
    with qfp8.calibrate(model):
        model(tiny.tokens())
    qfp8.save_pretrained(model, tmp_path)
    return tmp_path


BAD_SCALES = {
    "weight-scale-nan": ("model.layers.0.mlp.up_proj.weight_scale", float("nan")),
    "weight-scale-inf": ("model.layers.1.self_attn.o_proj.weight_scale", float("inf")),
    "weight-scale-negative": ("model.layers.0.mlp.up_proj.weight_scale", -1.0),
    "input-scale-zero": ("model.layers.0.mlp.down_proj.input_scale", 0.0),
    "k-scale-nan": ("model.layers.1.self_attn.k_scale", float("nan")),
    "v-scale-zero": ("model.layers.0.self_attn.v_scale", 0.0),
}


@pytest.mark.parametrize("key, value", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_non_finite_zero_or_negative_scales_are_refused(saved_static, key, value):
    def change(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][0] = value  # one bad value is enough

    _rewrite(saved_static, change)
    with pytest.raises(
        ValueError,
        match=rf"model\.safetensors: {re.escape(key)} holds 1 of \d+ value\(s\) that are NaN/Inf, zero or "
        r"negative \(first: .*\); scales must be finite and > 0",
    ):
        qfp8.from_pretrained(saved_static)


def test_load_state_dict_refuses_bad_scales(tiny):
    model = tiny.model()
    qfp8.quantize(model)
    state = model.state_dict()
    state["model.layers.0.mlp.up_proj.weight_scale"] = torch.full_like(
        state["model.layers.0.mlp.up_proj.weight_scale"], float("nan")
    )
    with pytest.raises(
        ValueError, match=r"state dict tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale' holds 128 of 128"
    ):
        qfp8.load_state_dict(model, state)


@pytest.mark.parametrize("key", [0, ("model", "norm"), None], ids=["int", "tuple", "none"])
def test_load_state_dict_refuses_a_key_that_is_not_a_name(tiny, key):
    """A non-str key raised AttributeError ('int' object has no attribute 'endswith'); the model is left as it was."""
    model = tiny.model()
    qfp8.quantize(model)
    state = model.state_dict()
    before = {name: t.clone() for name, t in state.items()}
    doubled = {name: t * 2 if t.dtype in (torch.float32, torch.bfloat16) else t for name, t in state.items()}
    bad = {**doubled, key: torch.ones(1)}  # the bad key last: nothing before it is loaded either
    with pytest.raises(TypeError, match=rf"state dict key {re.escape(repr(key))} is {type(key).__name__}; keys are"):
        qfp8.load_state_dict(model, bad)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def test_a_tokenizer_that_is_not_one_is_refused_before_writing(tiny, tmp_path):
    """save_pretrained(tokenizer="x") raised AttributeError ('str' object has no attribute 'save_pretrained')."""
    model = tiny.model()
    qfp8.quantize(model)
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizer or processor .*got str"):
        qfp8.save_pretrained(model, tmp_path / "out", tokenizer="x")
    assert not (tmp_path / "out").exists()


def test_save_onto_a_file_path(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model)
    path = tmp_path / "model.bin"
    path.write_bytes(b"a file")
    for target in (path, path / "sub"):
        with pytest.raises(ValueError, match=rf"save_pretrained: {re.escape(str(path))} is a file, not a folder"):
            qfp8.save_pretrained(model, target)
    assert path.read_bytes() == b"a file"


def test_an_unusable_device_is_refused_before_the_load(saved):
    """torch's AssertionError ("Torch not compiled with CUDA enabled") or RuntimeError came after the whole load."""
    bad = ["tpu9", 7] if torch.cuda.is_available() else ["cuda", "tpu9", 7]
    for device in bad:
        with pytest.raises(ValueError, match=rf"from_pretrained: device='{device}' cannot be used here: "):
            qfp8.from_pretrained(saved, device=device)
    with pytest.raises(TypeError, match=r"device must be a str, torch.device or int, got float"):
        qfp8.from_pretrained(saved, device=1.5)
    assert next(qfp8.from_pretrained(saved, device=None).parameters()).device.type == "cpu"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "generation_config.json"])
def test_a_folder_where_a_checkpoint_file_goes_is_refused_before_writing(tiny, tmp_path, name):
    """With config.json a folder, nothing is moved in (no half-written checkpoint): refused before writing."""
    model = tiny.model()
    qfp8.quantize(model)
    (tmp_path / "out" / name).mkdir(parents=True)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(tmp_path / 'out' / name))} is a folder .*Nothing was written"
    ):
        qfp8.save_pretrained(model, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == [name]


def test_a_destination_behind_a_dangling_link_is_refused_before_any_work(tmp_path):
    from qfp8.checkpoint.writer import check_output_directory

    link = tmp_path / "out"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"DST .*out/sub: .*out is a symbolic link to .*missing, which does not exist"):
        check_output_directory(link / "sub", "DST")
    check_output_directory(tmp_path / "new" / "folder", "DST")  # a plain missing folder is fine: it would be created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the check leaves nothing behind


@pytest.mark.parametrize(
    "dtype, error, match",
    [
        ("bf16", TypeError, r"dtype must be a torch.dtype or its name .* got 'bf16'"),
        (3, TypeError, r"dtype must be a torch.dtype or its name .* got 3"),
        (torch.float8_e4m3fn, ValueError, r"dtype torch.float8_e4m3fn is not a dtype to compute in"),
        ("int8", ValueError, r"dtype 'int8' is not a dtype to compute in"),
    ],
)
def test_from_pretrained_refuses_a_bad_dtype(saved, dtype, error, match):
    with pytest.raises(error, match=match):
        qfp8.from_pretrained(saved, dtype=dtype)


@pytest.mark.parametrize("dtype", ["auto", None, "bfloat16", torch.float16])
def test_from_pretrained_dtype_names_and_auto(saved, dtype):
    model = qfp8.from_pretrained(saved, dtype=dtype)
    expected = {"bfloat16": torch.bfloat16, torch.float16: torch.float16}.get(dtype, torch.float32)
    assert model.model.norm.weight.dtype == expected  # the tiny model's config says float32


def test_nan_weight_codes_in_a_checkpoint_are_refused(saved):
    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"].view(torch.uint8)[3, 7] = 0x7F

    _rewrite(saved, poison)
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: module 'model.layers.1.mlp.down_proj': weight: .*"
        r"NaN/Inf code \(0x7F\) at \[3, 7\]",
    ):
        qfp8.from_pretrained(saved)


def test_fp8_weights_without_a_config_name_the_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"is a torch.float8_e4m3fn \[\d+, \d+\] weight, but the folder has no "
        r"config.json: qfp8 cannot tell how it is quantized",
    ):
        qfp8.from_pretrained(saved)


def test_block_strategy_without_block_structure_names_the_config_key(saved):
    config = json.loads((saved / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"config.json: config_groups.group_0.weights: strategy 'block' needs "
        r"block_structure \[block_n, block_k\] .*got None",
    ):
        qfp8.from_pretrained(saved)


def test_a_config_tying_a_quantized_lm_head_loads_it_untied(tiny, tmp_path, x):
    """The checkpoint holds two different tensors under the tied names (an FP8 head, a float table): they load
    as they are, as transformers loads two different tables."""
    model = tiny.model()  # untied, so quantize takes lm_head too
    qfp8.quantize(model, exclude=())
    qfp8.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = qfp8.from_pretrained(tmp_path)
    assert loaded.config.tie_word_embeddings is False
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def _group(config):
    return next(iter(config["quantization_config"]["config_groups"].values()))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.__setitem__("quantization_config", "fp8"), r"quantization_config must be a JSON object, got str"),
        (lambda c: c["quantization_config"].__setitem__("config_groups", ["g"]), r"config_groups must be a JSON obj"),
        (lambda c: c["quantization_config"]["config_groups"].__setitem__("group_0", "x"), r"group_0 must be a JSON"),
        (lambda c: _group(c).__setitem__("weights", "fp8"), r"\.weights must be a JSON object or null"),
        (lambda c: _group(c).__setitem__("input_activations", 1), r"\.input_activations must be a JSON object"),
        (lambda c: _group(c).__setitem__("targets", "Linear"), r"\.targets must be a list of module names"),
        (lambda c: _group(c).__setitem__("targets", [3]), r"\.targets must be a list of module names"),
        (lambda c: _group(c).__setitem__("targets", ["re:("]), r"\.targets pattern 're:\(' is not a regex"),
        (lambda c: c["quantization_config"].__setitem__("ignore", [1]), r"quantization_config\.ignore must be a list"),
        (lambda c: c.__setitem__("torch_dtype", "float9"), r"torch_dtype 'float9' is not a torch dtype name"),
    ],
    ids=["qc", "groups", "group", "weights", "inputs", "targets-str", "targets-int", "targets-re", "ignore", "dtype"],
)
def test_config_json_of_the_wrong_type_names_the_file_and_key(saved, edit, match):
    """Each had raised AttributeError, TypeError or re.error from deep in the reader."""
    config = json.loads((saved / "config.json").read_text())
    edit(config)
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: .*{match}"):
        qfp8.from_pretrained(saved)


@pytest.mark.parametrize("case", ["map-str", "map-int", "outside"])
def test_a_shard_index_of_the_wrong_type_or_outside_the_folder_is_refused(tiny, tmp_path, case):
    """An index naming ../other/model.safetensors is not followed out of the checkpoint's folder."""
    model = tiny.model()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "other")
    qfp8.save_pretrained(model, tmp_path / "ck", max_shard_size="100KB")
    index_path = tmp_path / "ck" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if case == "map-str":
        index["weight_map"] = "model.safetensors"
    elif case == "map-int":
        index["weight_map"] = dict.fromkeys(index["weight_map"], 1)
    else:
        index["weight_map"] = dict.fromkeys(index["weight_map"], "../other/model.safetensors")
    index_path.write_text(json.dumps(index))
    match = r"which is not a file name in .*ck; shards sit beside" if case == "outside" else r"weight_map must map"
    with pytest.raises(ValueError, match=match):
        qfp8.from_pretrained(tmp_path / "ck")
