"""bench/unet.py --quick runs and writes its rows and provenance (so the benchmark cannot rot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_unet_quick_writes_rows_and_provenance(tmp_path, check_provenance):
    pytest.importorskip("diffusers", reason="the bench builds a diffusers UNet")
    out = tmp_path / "unet.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "unet.py"), "--quick", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    check_provenance(data, "unet.py")
    assert data["provenance"]["threads"] == 1
    assert len(data["conv"]) == 2
    for row in data["conv"]:
        assert row["bf16_ms"] > 0 and row["qfp8_ms"] > 0
        assert row["ratio"] == pytest.approx(row["bf16_ms"] / row["qfp8_ms"])
    unet = data["unet"]
    assert unet["quantized_convolutions"] > 10 and unet["skipped_layers"] == 0
    assert unet["sqnr_db"] > 15  # FP8 weights through the whole UNet, random weights
    assert unet["ratio"] == pytest.approx(unet["bf16_ms"] / unet["qfp8_ms"])
    assert unet["qfp8_weights_mb"] < 0.7 * unet["bf16_weights_mb"]  # FP8 matrices: about half the bytes
    assert "UNet2DConditionModel (tiny" in result.stdout
