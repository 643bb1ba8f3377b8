"""Quantized diffusers models (built tiny from configs) saved with qfp8.save_pretrained and loaded back."""

import json

import pytest
import torch

import qfp8
from qfp8.nn.conv import QConv2d
from tests.conftest import sqnr

diffusers = pytest.importorskip("diffusers", reason="builds diffusers models")


def _unet(dtype=torch.float32):
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16,
    )  # fmt: skip
    inputs = {
        "sample": torch.randn(1, 4, 16, 16, dtype=dtype),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 6, 32, dtype=dtype),
    }
    torch.nn.Module.to(model, dtype)  # not ModelMixin.to, which warns about modules this UNet lacks
    return model.eval(), inputs


def _flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(1, 16, 4),
        "encoder_hidden_states": torch.randn(1, 5, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(5, 3),
    }
    return model.eval(), inputs


def _sd3():
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        caption_projection_dim=16, joint_attention_dim=32, pooled_projection_dim=32, out_channels=4,
    )  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(1, 4, 8, 8),
        "encoder_hidden_states": torch.randn(1, 5, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([3]),
    }
    return model.eval(), inputs


MODELS = {"unet": _unet, "flux": _flux, "sd3": _sd3}


@torch.no_grad()
@pytest.mark.parametrize("kind", list(MODELS))
def test_round_trip_is_bit_identical(kind, tmp_path):
    model, inputs = MODELS[kind]()
    expected = model(**inputs).sample
    qfp8.quantize(model)
    out = model(**inputs).sample
    assert sqnr(expected.double(), out.double()) > 20  # FP8 weights through the whole network
    qfp8.save_pretrained(model, tmp_path / kind)
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["_class_name"] == type(model).__name__ and config["_diffusers_version"] == diffusers.__version__
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    loaded = qfp8.from_pretrained(tmp_path / kind)
    assert type(loaded) is type(model)
    assert torch.equal(loaded(**inputs).sample, out)


@torch.no_grad()
def test_per_tensor_convolutions_are_stored_per_row_and_read_back(tmp_path):
    """Per-tensor scales of linears and convolutions alike are written as [N, 1] rows (docs/checkpoints.md)."""
    model, inputs = _unet()
    qfp8.quantize(model, weight_scale="tensor")
    out = model(**inputs).sample
    qfp8.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["qfp8_tensor_weight_groups"]
    loaded = qfp8.from_pretrained(tmp_path)
    convs = [m for m in loaded.modules() if isinstance(m, QConv2d)]
    assert convs and all(m.scheme.weight_scale == "tensor" and m.weight_scale.shape == (1,) for m in convs)
    assert torch.equal(loaded(**inputs).sample, out)


@torch.no_grad()
def test_unet_convolutions_are_quantized_and_reloaded_from_a_pipeline_subfolder(tmp_path):
    model, inputs = _unet(torch.bfloat16)
    _, report = qfp8.quantize(model)
    convolutions = [name for name, module in model.named_modules() if isinstance(module, QConv2d)]
    assert "conv_in" in convolutions and "down_blocks.0.resnets.0.conv1" in convolutions and len(convolutions) > 10
    assert all(entry.quantized for entry in report.entries) and not report.others
    out = model(**inputs).sample
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    qfp8.save_pretrained(model, tmp_path / "unet")
    loaded = qfp8.from_pretrained(tmp_path, subfolder="unet")
    assert loaded.dtype == torch.bfloat16 and isinstance(loaded.conv_in, QConv2d)
    assert torch.equal(loaded(**inputs).sample, out)
    with pytest.raises(ValueError, match=r"pipeline folder.*subfolder=.*unet"):
        qfp8.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no subfolder .transformer."):
        qfp8.from_pretrained(tmp_path, subfolder="transformer")
    with pytest.raises(ValueError, match="relative path"):
        qfp8.from_pretrained(tmp_path, subfolder="../unet")


def test_missing_config_names_the_file(tmp_path):
    model, _ = _sd3()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "transformer")
    (tmp_path / "transformer" / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        qfp8.from_pretrained(tmp_path / "transformer")


def test_unknown_class_name_is_refused(tmp_path):
    model, _ = _sd3()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["_class_name"] = "NoSuchModel"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'NoSuchModel' is not a diffusers model class"):
        qfp8.from_pretrained(tmp_path)


def test_diffusers_loader_has_no_registration_for_qfp8(tmp_path):
    """diffusers reads only the quantization methods it lists (no public registration): its loader refuses the
    folder, and qfp8.from_pretrained is the way back (docs/diffusers.md)."""
    model, _ = _sd3()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path)
    with pytest.raises((ValueError, OSError, EnvironmentError)):
        diffusers.SD3Transformer2DModel.from_pretrained(tmp_path)


@torch.no_grad()
def test_calibrated_static_activations_round_trip(tmp_path):
    model, inputs = _unet()
    qfp8.quantize(model, activations="static")
    with qfp8.calibrate(model):
        model(**inputs)
    qfp8.freeze(model)
    assert model.conv_in.input_scale is not None
    out = model(**inputs).sample
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path)
    assert torch.equal(loaded.conv_in.input_scale, model.conv_in.input_scale)
    assert torch.equal(loaded(**inputs).sample, out)


@torch.no_grad()
def test_diffusers_own_save_pretrained_writes_the_qfp8_checkpoint(tmp_path):
    model, inputs = _unet()
    qfp8.quantize(model)
    out = model(**inputs).sample
    model.save_pretrained(tmp_path / "unet")  # diffusers' call, as a pipeline's save_pretrained makes it
    config = json.loads((tmp_path / "unet" / "config.json").read_text())
    assert config["_class_name"] == "UNet2DConditionModel"
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert torch.equal(qfp8.from_pretrained(tmp_path / "unet")(**inputs).sample, out)
    loaded = qfp8.from_pretrained(tmp_path / "unet")
    loaded.save_pretrained(tmp_path / "again")  # a loaded model saves the same way
    assert torch.equal(qfp8.from_pretrained(tmp_path / "again")(**inputs).sample, out)
    with pytest.raises(TypeError, match=r"not \['push_to_hub'\]"):
        model.save_pretrained(tmp_path / "x", push_to_hub=True)
    with pytest.raises(ValueError, match="safetensors only"):
        model.save_pretrained(tmp_path / "x", safe_serialization=False)
