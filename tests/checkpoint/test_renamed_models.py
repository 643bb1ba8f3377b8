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


def hub_named(folder, out):
    """``folder``'s Llava checkpoint with its vision tower under ``vision_tower.vision_model.*``, as the Hub's
    llava-hf checkpoints store it (transformers 5 drops ``vision_model.`` when it loads them)."""
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    prefix = "vision_tower."
    moved = {(prefix + "vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state.items()}
    save_file(moved, out / "model.safetensors", metadata={"format": "pt"})
    return moved


def quantized_names(model):
    return sorted(name for name, module in model.named_modules() if isinstance(module, qfp8.QLinear))


def test_a_model_loaded_from_the_hubs_llava_layout_saves_a_checkpoint_qfp8_reads_back(tiny_llava, tmp_path):
    """Saved under vision_tower.vision_model.* (as transformers saves a model it loaded so), the checkpoint was
    refused by qfp8.from_pretrained: "quantizes module 'model.vision_tower.vision_model...', which the model does
    not have" (the reader dropped transformers' prefix change)."""
    tiny_llava().save_pretrained(tmp_path / "plain")
    hub_named(tmp_path / "plain", tmp_path / "hub")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hub").eval()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "fp8")
    assert any(k.startswith("vision_tower.vision_model.") for k in load_file(tmp_path / "fp8" / "model.safetensors"))
    reloaded = qfp8.from_pretrained(tmp_path / "fp8")
    assert quantized_names(reloaded) == quantized_names(model)
    assert torch.equal(logits(reloaded), logits(model))
    theirs = logits(transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "fp8"))
    assert formats.sqnr(theirs, logits(model)) > 40


def test_the_cli_quantizes_the_vision_tower_of_the_hubs_llava_layout(tiny_llava, tmp_path):
    """It had found no stored weight for the tower's Linears and left them float, silently."""
    model = tiny_llava()
    model.save_pretrained(tmp_path / "plain")
    hub_named(tmp_path / "plain", tmp_path / "hub")
    subprocess.run(
        [sys.executable, "-m", "qfp8", "quantize", str(tmp_path / "hub"), str(tmp_path / "fp8"), "--no-progress"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    loaded = qfp8.from_pretrained(tmp_path / "fp8")
    qfp8.quantize(model)
    assert quantized_names(loaded) == quantized_names(model)
    assert len([n for n in quantized_names(loaded) if "vision_tower" in n]) == 6
    assert torch.equal(logits(loaded), logits(model))


def test_the_cli_keeps_a_multihead_attention_projection_float_as_quantize_does(tmp_path):
    """SigLIP's head (PaliGemma, Gemma 3) runs nn.MultiheadAttention, which reads out_proj's weight itself."""
    text = transformers.GemmaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8,
        projection_dim=64,
    )  # fmt: skip
    config = transformers.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=255, projection_dim=64
    )
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "float")
    subprocess.run(
        [sys.executable, "-m", "qfp8", "quantize", str(tmp_path / "float"), str(tmp_path / "fp8"), "--no-progress"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    loaded = qfp8.from_pretrained(tmp_path / "fp8")
    _, report = qfp8.quantize(model)
    assert any("MultiheadAttention" in entry.reason for entry in report.skipped)
    assert quantized_names(loaded) == quantized_names(model)


def test_the_cli_says_why_experts_stored_fused_under_the_model_names_stay_float(tmp_path):
    """transformers 5 loads a Mixtral whose experts are stored fused (mlp.experts.gate_up_proj); the CLI reads
    experts stored one by one, and had said only "missing or not 2-D"."""
    from safetensors.torch import save_model

    from qfp8.checkpoint.stream import stream_quantize

    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "float")
    (tmp_path / "float" / "model.safetensors").unlink()
    save_model(model, str(tmp_path / "float" / "model.safetensors"))  # the model's own names
    with pytest.warns(UserWarning, match=r"stores them fused, as model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        stream_quantize(tmp_path / "float", tmp_path / "fp8", progress=False)
    loaded = qfp8.from_pretrained(tmp_path / "fp8")
    assert sum(isinstance(m, qfp8.QLinear) for m in loaded.modules()) == 4  # q, k, v, o: the experts stay float


@pytest.mark.parametrize(
    "pattern", ["model.language_model.layers.0.*", "language_model.model.layers.0.*"], ids=["model-name", "stored-name"]
)
def test_the_cli_excludes_what_quantize_excludes_by_the_model_or_the_checkpoint_name(tiny_llava, tmp_path, pattern):
    """qfp8 quantize plans with quantize's planner on the model's names: a pattern written with the model's names
    (as for qfp8.quantize) or the checkpoint's acts alike, and the checkpoint equals quantize + save_pretrained's."""
    from qfp8.checkpoint.stream import stream_quantize

    tiny_llava(dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    summary = stream_quantize(tmp_path / "float", tmp_path / "stream", exclude=["lm_head", pattern], progress=False)
    skipped = {entry.name for entry in summary["report"].skipped}
    assert skipped == {"language_model.lm_head", *(f"language_model.model.layers.0.{n}" for n in SEVEN_PROJECTIONS)}
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "float")
    qfp8.quantize(model, exclude=["lm_head", "model.language_model.layers.0.*"])
    qfp8.save_pretrained(model, tmp_path / "memory")
    streamed, saved = (
        load_file(tmp_path / "stream" / "model.safetensors"),
        load_file(tmp_path / "memory" / "model.safetensors"),
    )
    assert streamed.keys() == saved.keys()
    assert all(torch.equal(streamed[k].view(torch.uint8), saved[k].view(torch.uint8)) for k in saved)
    assert quantization_config(tmp_path / "stream") == quantization_config(tmp_path / "memory")


SEVEN_PROJECTIONS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
