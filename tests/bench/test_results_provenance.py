"""Every result under bench/results says where it came from, and the index lists exactly the files there."""

import datetime
import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
FILES = sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_result_has_provenance(path):
    record = json.loads(path.read_text())["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", record["commit"]), record["commit"]
    assert record["cpu_model"] and record["torch"] and record["command"].startswith("python ")
    assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None


def test_index_lists_every_result():
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"\[([\w.-]+\.json)\]\(\1\)", index))
    assert listed == {p.name for p in FILES}
