"""bench/load.py --quick runs end to end (CI) and writes a complete JSON report with its provenance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers", reason="bench/load.py loads Hugging Face Llama checkpoints")


def test_load_bench_quick_mode(tmp_path, check_provenance):
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Peak RSS above the imports" in result.stdout and "One-token step" in result.stdout
    report = json.loads(out.read_text())
    provenance = report["provenance"]
    check_provenance(report, "load.py")
    assert provenance["transformers"]
    assert "--quick" in provenance["command"]

    memory = report["memory"]
    fp8, bf16 = memory["qfp8config"], memory["bf16"]
    assert fp8["qlinears"] == 4 * 7 and bf16["qlinears"] == 0
    # FP8 linear weights plus float embeddings, lm_head and norms: well under the bf16 model.
    assert 0.45 * bf16["model_bytes"] < fp8["model_bytes"] < 0.75 * bf16["model_bytes"]
    assert fp8["peak_above_imports"] > 0 and fp8["ratio_to_model"] > 0

    rows = {row["variant"]: row for row in report["speed"]}
    assert set(rows) == {"transformers + Qfp8Config", "qfp8.from_pretrained", "transformers + for_checkpoint"}
    assert all(row["step_ms"] > 0 and row["same_logits_as_qfp8_from_pretrained"] for row in rows.values())
    assert rows["qfp8.from_pretrained"]["ratio_to_qfp8_from_pretrained"] == 1.0
