"""bench/moe.py in quick mode, as CI runs it (subprocess)."""

from __future__ import annotations


def test_quick_mode_times_every_method_and_fp8_stays_accurate(tmp_path, run_bench):
    data, result = run_bench("moe.py", "--quick", timeout=600)
    rows = data["rows"]
    methods = {"bf16_grouped_mm", "bf16_eager", "qfp8_w8a16_eager_loop", "qfp8_w8a16", "qfp8_w8a8"}
    for tokens in (1, 16):
        mine = {row["method"]: row for row in rows if row["tokens"] == tokens}
        assert set(mine) == methods
        assert all(row["ms"] > 0 for row in mine.values())
        assert mine["bf16_eager"]["sqnr_db"] > 40  # bf16 rounding only
        assert mine["qfp8_w8a16"]["sqnr_db"] > 24 and mine["qfp8_w8a8"]["sqnr_db"] > 22  # e4m3: ~31 dB per weight
        # Same FP8 products through either implementation; W8A8 rounds the inputs too.
        assert abs(mine["qfp8_w8a16_eager_loop"]["sqnr_db"] - mine["qfp8_w8a16"]["sqnr_db"]) < 0.5
        assert mine["qfp8_w8a8"]["sqnr_db"] < mine["qfp8_w8a16"]["sqnr_db"]
    assert "vs bf16 grouped_mm" in result.stdout
