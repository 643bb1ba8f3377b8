"""Models whose module names differ from their checkpoint names (transformers 5's Llava: the checkpoint's
``language_model.model.*`` and ``language_model.lm_head`` are the model's ``model.language_model.*`` and
``lm_head``): the quantization config must name a layer so that every loader finds it, and the CLI must read a
checkpoint stored under either set of names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qfp8
from qfp8 import formats

transformers = pytest.importorskip("transformers", reason="these tests build transformers models")


def token_ids():
    return torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(input_ids=token_ids()).logits.float()


def quantization_config(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_a_float_lm_head_is_ignored_under_the_names_of_model_and_checkpoint(tiny_llava, tmp_path):
    """transformers 5 matches ``ignore`` against the model's names: with only the checkpoint's
    ``language_model.lm_head`` it quantized the float head with an uninitialised scale (NaN logits)."""
    pytest.importorskip("compressed_tensors", reason="transformers reads compressed-tensors through it")
    model = tiny_llava()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path)
    ignore = quantization_config(tmp_path)["ignore"]
    assert "language_model.lm_head" in ignore and "lm_head" in ignore
    assert "language_model.lm_head.weight" in load_file(tmp_path / "model.safetensors")  # the checkpoint's names
    theirs = logits(transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path))
    assert torch.isfinite(theirs).all()
    assert formats.sqnr(theirs, logits(model)) > 40
    assert torch.equal(logits(qfp8.from_pretrained(tmp_path)), logits(model))


def test_targets_of_several_schemes_name_model_and_checkpoint_modules(tiny_llava, tmp_path):
    pytest.importorskip("compressed_tensors", reason="transformers reads compressed-tensors through it")
    model = tiny_llava()
    qfp8.quantize(model.model.language_model)
    qfp8.quantize(model.model.vision_tower, weight_scale="tensor")
    qfp8.save_pretrained(model, tmp_path)
    groups = quantization_config(tmp_path)["config_groups"]
    assert len(groups) == 2
    targets = [t for group in groups.values() for t in group["targets"]]
    q_proj = "model.language_model.layers.0.self_attn.q_proj"
    assert q_proj in targets and "language_model.model.layers.0.self_attn.q_proj" in targets
    theirs = logits(transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path))
    assert formats.sqnr(theirs, logits(model)) > 40
    reloaded = qfp8.from_pretrained(tmp_path)
    assert reloaded.model.language_model.layers[0].self_attn.q_proj.scheme.weight_scale == "channel"
    assert reloaded.model.vision_tower.encoder.layers[0].mlp.fc1.scheme.weight_scale == "tensor"
    assert torch.equal(logits(reloaded), logits(model))


def test_the_cli_reads_a_checkpoint_stored_under_the_model_names(tiny_llava, tmp_path):
    """A Llava stored with ``model.language_model.*`` names, which transformers 5 loads too: the CLI had looked
    for the legacy names only and refused it ("nothing to quantize ... not stored in the checkpoint")."""
    legacy, renamed = tmp_path / "legacy", tmp_path / "renamed"
    tiny_llava(dtype=torch.bfloat16).save_pretrained(legacy)
    state = load_file(legacy / "model.safetensors")
    prefixes = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    moved = {}
    for key, value in state.items():
        old = next(p for p in prefixes if key.startswith(p))
        moved[prefixes[old] + key[len(old) :]] = value
    renamed.mkdir()
    (renamed / "config.json").write_text((legacy / "config.json").read_text())
    save_file(moved, renamed / "model.safetensors", metadata={"format": "pt"})
    out = {}
    for name, source in (("legacy", legacy), ("renamed", renamed)):
        out[name] = tmp_path / f"{name}-fp8"
        subprocess.run(
            [sys.executable, "-m", "qfp8", "quantize", str(source), str(out[name]), "--no-progress"],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert quantization_config(out["legacy"])["ignore"] == ["language_model.lm_head", "lm_head"]
    assert quantization_config(out["renamed"])["ignore"] == ["lm_head"]
    written = load_file(out["renamed"] / "model.safetensors")
    assert set(written) == {*moved, *(k + "_scale" for k, v in written.items() if v.dtype == torch.float8_e4m3fn)}
    assert sum(v.dtype == torch.float8_e4m3fn for v in written.values()) == 22  # 2 x 7 text, 6 vision, 2 projector
    ours = logits(qfp8.from_pretrained(out["renamed"]))
    assert torch.equal(ours, logits(qfp8.from_pretrained(out["legacy"])))
    reference = logits(transformers.LlavaForConditionalGeneration.from_pretrained(legacy))
    assert formats.sqnr(ours, reference) > 25
