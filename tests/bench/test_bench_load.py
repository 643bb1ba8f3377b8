"""bench/load.py --quick runs end to end (CI) and writes a complete JSON report with its provenance."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="bench/load.py loads Hugging Face Llama checkpoints")


def test_load_bench_quick_mode(tmp_path, run_bench):
    report, result = run_bench("load.py", "--quick", timeout=900)
    assert "Peak RSS above the imports" in result.stdout and "One-token step" in result.stdout
    provenance = report["provenance"]
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
