"""Hub repo ids: ``qfp8.from_pretrained("org/name")`` and ``qfp8 quantize org/name DST`` through a local cache.

The cache is built by hand in ``tmp_path`` with huggingface_hub's layout
(``models--ORG--NAME/refs/main`` holding a commit hash, the files under
``snapshots/<hash>/``); ``HF_HUB_OFFLINE`` is on and sockets refuse to
connect, so nothing can reach the network.
"""

from __future__ import annotations

import pytest
import torch

import qfp8
from qfp8.cli import main
from qfp8.nn import QLinear
from tests.hub import MAIN as COMMIT
from tests.hub import add_to_cache

huggingface_hub = pytest.importorskip("huggingface_hub", reason="Hub repo ids resolve through huggingface_hub")


def test_from_pretrained_repo_id_matches_folder(tiny, tmp_path, hub_cache, x):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="tensor", activations="dynamic", kv_cache="float8_e4m3fn")
    with qfp8.calibrate(model):
        model(tiny.tokens(seed=5))
    qfp8.save_pretrained(model, tmp_path / "folder")
    add_to_cache(hub_cache, "qfp8-test/tiny-fp8", tmp_path / "folder")

    from_hub = qfp8.from_pretrained("qfp8-test/tiny-fp8")
    from_folder = qfp8.from_pretrained(tmp_path / "folder")
    assert from_hub.qfp8_source == str(hub_cache / "models--qfp8-test--tiny-fp8" / "snapshots" / COMMIT)
    hub_state, folder_state = from_hub.state_dict(), from_folder.state_dict()
    assert hub_state.keys() == folder_state.keys()
    for key, value in folder_state.items():
        assert torch.equal(hub_state[key].view(torch.uint8), value.view(torch.uint8)), key
    assert sum(isinstance(m, QLinear) for m in from_hub.modules()) == 14
    with torch.no_grad():
        assert torch.equal(from_hub(x).logits, from_folder(x).logits)
        assert torch.equal(from_hub(x).logits, model(x).logits)


def test_quantize_cli_takes_a_repo_id(tiny, tmp_path, hub_cache):
    tiny.model().save_pretrained(tmp_path / "float")
    add_to_cache(hub_cache, "qfp8-test/tiny-float", tmp_path / "float")
    argv = ["quantize", "--no-progress", "--weight-scale", "tensor"]
    assert main([*argv, "qfp8-test/tiny-float", str(tmp_path / "from-hub")]) == 0
    assert main([*argv, str(tmp_path / "float"), str(tmp_path / "from-folder")]) == 0
    assert (tmp_path / "from-hub" / "model.safetensors").read_bytes() == (
        tmp_path / "from-folder" / "model.safetensors"
    ).read_bytes()


def test_unknown_repo_id_raises_naming_it(hub_cache):
    with pytest.raises(FileNotFoundError, match="qfp8-test/not-in-cache: not a folder, and the Hub repo") as error:
        qfp8.from_pretrained("qfp8-test/not-in-cache")
    assert "outgoing traffic has been disabled" in str(error.value)  # huggingface_hub's offline answer
    with pytest.raises(FileNotFoundError, match="qfp8-test/not-in-cache"):
        main(["quantize", "qfp8-test/not-in-cache", str(hub_cache / "out"), "--no-progress"])


def test_hub_download_includes_the_kv_rounding_file(monkeypatch):
    # A calibrated FP8 KV cache's query moments travel beside the weights (qfp8_kv_rounding.st): a Hub
    # download must fetch that file too, or the model rounds its keys to nearest without a word.
    import fnmatch

    from qfp8.checkpoint.naming import KV_ROUNDING_FILE
    from qfp8.checkpoint.readers import resolve

    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked["patterns"] = allow_patterns
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FileNotFoundError, match="could not be resolved"):
        resolve("qfp8-test/tiny-fp8")
    assert any(fnmatch.fnmatch(KV_ROUNDING_FILE, pattern) for pattern in asked["patterns"])
    assert any(fnmatch.fnmatch("model.safetensors", pattern) for pattern in asked["patterns"])
