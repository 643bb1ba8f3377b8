import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def check_provenance():
    """``check_provenance(result)``: the JSON a bench script wrote says where it came from (bench/provenance.py)."""

    def check(result: dict, script: str) -> None:
        record = result["provenance"]
        for field in ("commit", "cpu_model", "isa", "torch", "threads", "date", "command"):
            assert field in record, field
        assert record["cpu_model"], record
        assert record["torch"] == torch.__version__
        assert isinstance(record["threads"], int) and record["threads"] >= 1
        assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None
        assert record["command"].startswith("python ") and f"bench/{script}" in record["command"], record
        assert record["commit"] is None or len(record["commit"].removesuffix("-dirty")) == 40

    return check


@pytest.fixture
def run_bench(tmp_path, check_provenance):
    """``run_bench(script, *args, timeout=...)``: runs ``python bench/<script> *args --json FILE`` from the
    repository root with this checkout first on PYTHONPATH, asserts that it exits 0 (showing the end of its output)
    and returns the JSON it wrote, provenance checked, and the finished process."""

    def run(script: str, *args: str, timeout: int = 300, unset: tuple[str, ...] = ()):
        out = tmp_path / f"{Path(script).stem}.json"
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for name in unset:
            env.pop(name, None)
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        data = json.loads(out.read_text())
        check_provenance(data, script)
        return data, result

    return run
