"""bench/unet.py --quick runs and writes its rows and provenance (so the benchmark cannot rot)."""

import pytest


def test_bench_unet_quick_writes_rows_and_provenance(tmp_path, run_bench):
    pytest.importorskip("diffusers", reason="the bench builds a diffusers UNet")
    data, result = run_bench("unet.py", "--quick")
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
