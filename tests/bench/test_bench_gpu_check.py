"""bench/gpu_check.py: the CPU dry run passes and the GPU plan covers the shapes and routes it must."""

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_plan_covers_the_required_shapes():
    gpu_check = load_script()
    assert gpu_check.TIMING_MS == (1, 16, 64, 256, 4096)
    assert set(gpu_check.TIMING_SHAPES) == {(8192, 8192), (8192, 28672), (28672, 8192)}
    shapes = gpu_check.WEIGHT_ONLY_SHAPES
    assert any(k % 2 for _, _, k in shapes) and any(n % 2 for _, n, _ in shapes)  # odd K and N
    assert any(28672 in (n, k) for _, n, k in shapes) and any(8192 in (n, k) for _, n, k in shapes)
    ms = {m for m, _, _ in shapes}
    # every tile configuration (M <= 16, <= 32, > 32 in 64-row blocks) and the large-M path
    assert {1, 17, 33, 256} <= ms and max(ms) >= gpu_check.cuda_routes.LARGE_M
    cases = list(gpu_check.weight_only_cases(shapes))
    assert {c[3] for c in cases} == set(gpu_check.formats.FP8_DTYPES.values())
    assert {c[4] for c in cases} == {"tensor", "channel", "block"}
    assert {c[6] for c in cases} == {torch.float16, torch.bfloat16}
    assert any(n % 16 or k % 16 for _, n, k in gpu_check.SCALED_MM_SHAPES)  # the padded _scaled_mm route


def test_arguments():
    gpu_check = load_script()
    args = gpu_check.parse_args(["--quick", "--json", "x.json", "--budget-s", "60"])
    assert args.cpu_dry_run and args.json == Path("x.json") and args.budget_s == 60
    assert not gpu_check.parse_args([]).cpu_dry_run


def test_cpu_dry_run_passes(run_bench):
    data, _ = run_bench("gpu_check.py", "--cpu-dry-run", unset=("QFP8_KERNEL",))
    assert data["mode"] == "cpu-dry-run" and data["passed"] is True
    routes = {row["route"].split("[")[0] for row in data["checks"]}
    assert {"pack", "weight-only(emulated)", "scaled-mm", "qlinear"} <= routes
    assert all(row["passed"] for row in data["checks"])
    assert all(row["error"] <= row["limit"] for row in data["checks"])
    assert "timings" not in data  # no GPU, no timings
