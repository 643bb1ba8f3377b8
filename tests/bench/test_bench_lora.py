"""bench/lora.py --quick runs end to end and writes every row with its provenance (so the benchmark cannot rot)."""

import math

import pytest


def test_bench_lora_quick_writes_layer_and_training_rows(tmp_path, run_bench):
    from qfp8.library import cpu

    if cpu.cpu_kernel_isa() is None:
        pytest.skip("the qfp8 CPU extension is not built")
    pytest.importorskip("peft", reason="the LoRA rows train peft adapters")
    data, _ = run_bench("lora.py", "--quick", "--rounds", "2")
    source = data["provenance"]
    assert source["threads"] == 1 and "--quick" in source["command"] and source["isa"] == cpu.cpu_kernel_isa()
    assert {row["scheme"] for row in data["layer"]} == {"w8a16", "w8a8"}
    for row in data["layer"]:
        assert row["M"] == 64 and row["kernel"].startswith("cpu-")
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in ("bf16_ms", "fp8_ms", "fp8_over_bf16"))
    (lora,) = data["lora"]
    assert lora["model"] == "tiny" and lora["tokens"] == 64
    assert all(math.isfinite(lora[key]) and lora[key] > 0 for key in ("bf16_step_ms", "fp8_step_ms", "fp8_over_bf16"))
