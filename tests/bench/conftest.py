import datetime

import pytest
import torch


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
