"""``qfp8.from_pretrained`` takes transformers' loading arguments (revision, subfolder, token, cache_dir, device_map
with accelerate offload, dtype, trust_remote_code), and qfp8 models go to the Hub with transformers' ``push_to_hub``.

The Hub is a local cache built by hand (huggingface_hub's layout: ``models--ORG--NAME/refs/<ref>`` holding a commit
hash, files under ``snapshots/<hash>/``) with ``HF_HUB_OFFLINE`` on and sockets refusing to connect; pushing is
caught at ``HfApi.create_commit`` and written into that cache.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import qfp8
from qfp8.nn import QLinear
from tests.hub import MAIN, add_to_cache

huggingface_hub = pytest.importorskip("huggingface_hub", reason="Hub repo ids resolve through huggingface_hub")
transformers = pytest.importorskip("transformers", reason="the integration tests load transformers models")

OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def quantized(helpers, tmp_path):
    """A qfp8 checkpoint folder and the logits of the model it was written from."""
    model = helpers.float_model()
    qfp8.quantize(model, weight_scale="tensor")
    qfp8.save_pretrained(model, tmp_path / "fp8")
    return tmp_path / "fp8", helpers.logits(model)


def test_revision_subfolder_and_cache_dir_reach_the_hub_cache(helpers, hub_cache, quantized, tmp_path):
    folder, expected = quantized
    add_to_cache(hub_cache, "qfp8-test/tiny", folder, subfolder="fp8")
    other = helpers.float_model(seed=7)
    qfp8.quantize(other, weight_scale="tensor")
    qfp8.save_pretrained(other, tmp_path / "other")
    add_to_cache(hub_cache, "qfp8-test/tiny", tmp_path / "other", commit=OTHER, ref=None, subfolder="fp8")

    at_main = qfp8.from_pretrained("qfp8-test/tiny", subfolder="fp8", token="hf_unused", cache_dir=hub_cache)
    at_other = qfp8.from_pretrained("qfp8-test/tiny", subfolder="fp8", revision=OTHER, cache_dir=hub_cache)
    assert torch.equal(helpers.logits(at_main), expected)
    assert torch.equal(helpers.logits(at_other), helpers.logits(other))
    assert at_other.qfp8_source.endswith(f"{OTHER}/fp8")
    with pytest.raises(FileNotFoundError, match=r"qfp8-test/tiny at revision 'v9'"):
        qfp8.from_pretrained("qfp8-test/tiny", subfolder="fp8", revision="v9")
    with pytest.raises(FileNotFoundError, match=r"has no subfolder 'nope'"):
        qfp8.from_pretrained(folder.parent, subfolder="nope")
    assert torch.equal(helpers.logits(qfp8.from_pretrained(folder.parent, subfolder="fp8")), expected)


def test_dtype_torch_dtype_and_trust_remote_code(helpers, quantized):
    folder, expected = quantized
    as_float32 = qfp8.from_pretrained(folder, torch_dtype="float32", trust_remote_code=False)
    assert as_float32.model.embed_tokens.weight.dtype == torch.float32
    assert qfp8.from_pretrained(folder, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        qfp8.from_pretrained(folder, trust_remote_code="yes")
    with pytest.raises(TypeError, match="revision must be a str"):
        qfp8.from_pretrained(folder, revision=3)
    with pytest.raises(TypeError, match="give device or device_map, not both"):
        qfp8.from_pretrained(folder, device="cpu", device_map="cpu")


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}], ids=["cpu", "auto", "dict"])
def test_a_device_map_on_one_device(helpers, quantized, device_map):
    folder, expected = quantized
    model = qfp8.from_pretrained(folder, device_map=device_map)
    assert torch.equal(helpers.logits(model), expected)


def test_disk_offload_takes_the_fp8_weights_out_of_memory(helpers, quantized, tmp_path):
    folder, expected = quantized
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.raises(ValueError, match="offload_folder"):
        qfp8.from_pretrained(folder, device_map=device_map)
    model = qfp8.from_pretrained(folder, device_map=device_map, offload_folder=tmp_path / "offload")
    offloaded = [m for n, m in model.named_modules() if isinstance(m, QLinear) and n.startswith("model.layers.1.")]
    kept = [m for n, m in model.named_modules() if isinstance(m, QLinear) and n.startswith("model.layers.0.")]
    assert len(offloaded) == len(kept) == 7
    assert all(m.qweight.device.type == "meta" for m in offloaded)  # in the offload folder, not in memory
    assert all(m.qweight.device.type == "cpu" for m in kept)
    assert any((tmp_path / "offload").iterdir())
    assert torch.equal(helpers.logits(model), expected)


def push_into(cache, monkeypatch):
    """Makes ``HfApi.create_commit`` write the pushed files into the local Hub cache (and ``create_repo`` a no-op)."""

    def create_repo(self, repo_id, *args, **kwargs):
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, *args, **kwargs):
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / MAIN
        snapshot.mkdir(parents=True, exist_ok=True)
        for operation in operations:
            shutil.copy(operation.path_or_fileobj, snapshot / operation.path_in_repo)
        (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
        (snapshot.parent.parent / "refs" / "main").write_text(MAIN)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    hub_module = transformers.utils.hub
    for name, replacement in (("create_repo", create_repo), ("create_commit", create_commit)):
        if hasattr(hub_module, name):  # transformers 4 calls huggingface_hub's module-level functions
            monkeypatch.setattr(hub_module, name, lambda *a, _f=replacement, **k: _f(None, *a, **k))


def test_push_to_hub_of_a_qfp8_model_loads_back_from_the_hub(helpers, hub_cache, monkeypatch):
    push_into(hub_cache, monkeypatch)
    model = helpers.float_model()
    qfp8.quantize(model, activations="dynamic")
    model.push_to_hub("qfp8-test/pushed")
    snapshot = hub_cache / "models--qfp8-test--pushed" / "snapshots" / MAIN
    assert helpers.read_config(snapshot)["quantization_config"]["format"] == "float-quantized"
    assert torch.equal(helpers.logits(qfp8.from_pretrained("qfp8-test/pushed")), helpers.logits(model))
    bf16 = helpers.dtype_argument(torch.bfloat16)
    # cache_dir named: transformers 4 reads the cache location once, when it is imported.
    config = qfp8.Qfp8Config().for_checkpoint("qfp8-test/pushed", cache_dir=hub_cache)
    through_transformers = helpers.load("qfp8-test/pushed", config=config, cache_dir=hub_cache, **bf16)
    assert torch.equal(helpers.logits(through_transformers), helpers.logits(model))
