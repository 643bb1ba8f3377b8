"""bench/decode.py --quick runs end to end (CI) and writes a complete JSON report."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="bench/decode.py runs a Hugging Face Llama")


def test_decode_bench_quick_mode(tmp_path, run_bench):
    report, result = run_bench("decode.py", "--quick", timeout=600)
    assert "Greedy decode" in result.stdout and "Fast path" in result.stdout

    rows = report["decode"]
    assert sorted((r["scheme"], r["attention"], r["mode"]) for r in rows) == sorted(
        (scheme, attention, mode)
        for scheme in ("bf16", "w8a16-channel")
        for attention in ("qfp8_sdpa", "sdpa")
        for mode in ("eager", "compiled")
    )
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["ttft_s"] > 0 and row["peak_rss_bytes"] > 0
        if row["scheme"] == "bf16":
            assert row["tokens_per_s_ratio"] == 1.0 and row["weight_ratio"] == 1.0
        else:
            # FP8 Linear weights, lm_head included (the tiny model's is untied), plus float32
            # per-channel scales: just over half of bf16.
            assert 0.5 < row["linear_weight_ratio"] < 0.56
            assert row["weight_ratio"] < 1.0
            assert row["kernels"] and all(k != "torch bf16" for k in row["kernels"])

    fast_path = report["fast_path"]
    assert [r["layer"] for r in fast_path] == ["q/o", "k/v", "gate/up", "down", "decoder layer (sum)"]
    assert all(r["qlinear_us"] > 0 and r["op_us"] > 0 for r in fast_path)
