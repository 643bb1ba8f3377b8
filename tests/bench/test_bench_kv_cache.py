"""bench/kv_cache.py --quick runs end to end and reports cache bytes, decode speed and accuracy."""


def test_kv_cache_bench_quick(tmp_path, run_bench):
    results, proc = run_bench("kv_cache.py", "--quick")
    assert "cache bytes" in proc.stdout and "decode" in proc.stdout and "accuracy" in proc.stdout
    assert results["bytes"]["fp8_data"] * 2 == results["bytes"]["bf16"]
    assert 0 < results["bytes"]["fp8_scales"] < results["bytes"]["fp8_data"] / 100
    assert [row["context"] for row in results["decode"]["rows"]] == [128, 512]
    for row in results["decode"]["rows"]:
        assert row["bf16_tok_s"] > 0 and row["fp8_tok_s"] > 0
        assert row["fp8_cache_bytes"] * 2 == row["bf16_cache_bytes"]
    rows = {row["cache"]: row for row in results["accuracy"]["rows"]}
    assert set(rows) >= {
        "float32",
        "bf16",
        "fp8-e4m3 static tensor, amax scales",
        "fp8-e4m3 static tensor, searched scales",
        "fp8-e4m3 dynamic head",
    }
    assert rows["float32"]["kl_mean"] == 0
    assert rows["float32"]["perplexity_delta_pct_se"] == 0  # its own differences are all 0
    for name, row in rows.items():
        assert 0 <= row["kl_mean"] < 0.05, name
        assert row["windows"] == 2 and row["perplexity_delta_pct_se"] >= 0, name
    # The FP8 caches differ from float32 by a different amount in each window.
    assert rows["fp8-e4m3 dynamic head"]["perplexity_delta_pct_se"] > 0
