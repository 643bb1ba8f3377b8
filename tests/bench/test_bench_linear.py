"""bench/linear.py --quick runs and writes every column (so the benchmark cannot rot)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "extra", [[], ["--weight-scale", "block", "--shapes", "576x1536"]], ids=["channel", "block-one-shape"]
)
def test_bench_linear_quick_writes_every_column(tmp_path, extra, run_bench):
    from qfp8.library import cpu

    if cpu.cpu_kernel_isa() is None:
        pytest.skip("the qfp8 CPU extension is not built")
    data, _ = run_bench("linear.py", "--quick", *extra)
    columns = ["bf16", "fp32", "qfp8_w8a16", "qfp8_w8a8", "dequant_bf16", "scaled_mm", "int8pack_mm"]
    assert data["columns"] == columns
    assert data["rows"], "no rows measured"
    assert {row["weight_scale"] for row in data["rows"]} == {"block" if extra else "channel"}
    timed_once = set()  # (shape, column) slower than SLOW_CALL_S: timed by one call, then not run at larger M
    for row in data["rows"]:
        shape = (row["K"], row["N"])
        for column in columns:
            if row[f"{column}_ms"] is None:
                assert (shape, column) in timed_once, (row, column)
                continue
            assert row[f"{column}_ms"] > 0 and row[f"{column}_vs_bf16"] > 0, (row, column)
            if row.get(f"{column}_single_call"):
                assert column != "bf16" and row[f"{column}_ms"] > 1e3 * 3.0, (row, column)
                timed_once.add((shape, column))
        if row["M"] == 1:
            assert row["w8a16_gbps"] > 0 and row["stream_gbps"] > 0 and row["stream_vs_bf16"] > 0


def test_measure_gives_listed_methods_their_own_rounds():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_linear", ROOT / "bench" / "linear.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = {"fast": 0, "slow": 0}

    def counter(name):
        def call(x):
            calls[name] += 1

        return [call]

    medians = bench.measure(
        {name: counter(name) for name in calls}, None, 3, budget_s=60.0, burst=2, rounds_of={"fast": 15}
    )
    assert calls == {"fast": 30, "slow": 6}
    assert set(medians) == {"fast", "slow"} and all(m >= 0 for m in medians.values())
