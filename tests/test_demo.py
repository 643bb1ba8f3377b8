"""``python -m qfp8 demo`` end to end on a tiny local Llama (the --model PATH route), quick mode."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from qfp8 import demo
from tests.models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick_prints_every_scheme(tmp_path):
    folder = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "qfp8", "demo", "--model", str(folder), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["scheme"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(demo.SCHEMES)
    bf16 = rows["bf16"]["weight_bytes"]
    for name, row in rows.items():
        # None: decoding took no longer than the prefill alone (timing noise on this tiny model; decode_rate)
        assert row["perplexity"] > 1 and (row["decode_tokens_per_s"] is None or row["decode_tokens_per_s"] > 0), row
        assert name in result.stdout
        if name != "bf16":
            # Linear weights halve (bf16 -> FP8); the bf16 embedding stays.
            assert row["weight_bytes"] < bf16
    assert "decode tok/s" in result.stdout and "perplexity" in result.stdout


def test_demo_refuses_an_unknown_scheme():
    import argparse

    import pytest

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    with pytest.raises(ValueError, match="unknown scheme"):
        demo.run(parser.parse_args(["--schemes", "int4"]))


def test_options_given_with_quick_win_over_its_defaults(tmp_path, monkeypatch, capsys):
    folder = save_tiny_llama(tmp_path / "tiny")
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--quick", "--schemes", "bf16", "--window-length", "32"])
    assert demo.run(args) == 0
    assert (args.window_length, args.max_new_tokens, args.ppl_windows, args.calibration_windows) == (32, 4, 1, 1)
    assert "perplexity on 1 x 32 tokens" in capsys.readouterr().out


def test_decode_rate_says_nothing_when_there_is_nothing_to_time():
    # Two new tokens generated within the prefill's time had printed "decode tok/s 1000000000.0".
    assert demo.decode_rate(1, elapsed=0.50, prefill=0.52) is None
    assert demo.decode_rate(0, elapsed=1.0, prefill=0.5) is None
    assert demo.decode_rate(3, elapsed=2.0, prefill=0.5) == 2.0
