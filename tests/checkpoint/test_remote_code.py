"""No code from a checkpoint runs unless asked, and nothing prompts: a config whose ``auto_map`` names the
checkpoint's own Python files is refused clearly (stdin attached, "y" waiting on it), and runs with the opt-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import qfp8

CONFIGURATION = """
import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "qfp8_custom_llama"
"""
MODELING = """
from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def _with_custom_code(folder, marker):
    """``folder``'s config.json now names a model type only the folder's own code defines (which, imported,
    writes ``marker``)."""
    (folder / "configuration_custom.py").write_text(CONFIGURATION.format(marker=str(marker)))
    (folder / "modeling_custom.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "qfp8_custom_llama"
    config["architectures"] = ["CustomForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))


def _cli(args, tmp_path):
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run(
        [sys.executable, "-m", "qfp8", *args], input="y\ny\n", capture_output=True, text=True, env=env, timeout=300
    )


def test_quantize_with_stdin_attached_does_not_prompt_and_fails_clearly(tiny, tmp_path):
    source, marker = tmp_path / "float", tmp_path / "ran"
    tiny.model().save_pretrained(source)
    _with_custom_code(source, marker)
    run = _cli(["quantize", str(source), str(tmp_path / "out"), "--no-progress"], tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "qfp8 quantize: error:" in run.stderr and "runs no code from a checkpoint unless asked" in run.stderr
    assert "--trust-remote-code" in run.stderr and str(source / "config.json") in run.stderr
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_quantize_runs_the_code_when_asked(tiny, tmp_path):
    source, marker = tmp_path / "float", tmp_path / "ran"
    tiny.model().save_pretrained(source)
    _with_custom_code(source, marker)
    run = _cli(["quantize", str(source), str(tmp_path / "out"), "--no-progress", "--trust-remote-code"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert marker.exists()


def test_from_pretrained_refuses_custom_code_by_default(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "fp8")
    marker = tmp_path / "ran"
    _with_custom_code(tmp_path / "fp8", marker)
    with pytest.raises(ValueError, match=r"config\.json: the checkpoint needs its own Python code \(auto_map\)"):
        qfp8.from_pretrained(tmp_path / "fp8")
    assert not marker.exists()
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        qfp8.from_pretrained(tmp_path / "fp8", trust_remote_code="yes")


def test_a_known_model_type_with_an_auto_map_loads_with_transformers_own_code(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model)
    qfp8.save_pretrained(model, tmp_path / "fp8")
    marker = tmp_path / "ran"
    _with_custom_code(tmp_path / "fp8", marker)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    assert type(qfp8.from_pretrained(tmp_path / "fp8")).__name__ == "LlamaForCausalLM"
    assert not marker.exists()
