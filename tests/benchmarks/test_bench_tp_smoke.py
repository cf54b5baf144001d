"""The tensor-parallel benchmark's CPU smoke mode (gloo, two ranks, a tiny model) runs
every section end to end and writes its JSON; TP=2 agrees with TP=1 in float32."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_tp_smoke(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_tp.py"), "--smoke", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["agreement"]["tp2"]["token_agreement"] == 1.0
    for tp in ("1", "2"):
        run = result["runs"][tp]
        assert [row["batch"] for row in run["decode"]] == [1, 4]
        assert all(row["tok_per_s"] > 0 for row in run["decode"])
        assert run["ttft"]["cached_hits"] == [64, 64]
    # One all-reduce per decoder layer (the tiny model has 7 single-block layers).
    for row in result["runs"]["2"]["decode"]:
        assert row["allreduce"]["allreduces_per_step"] == 7
        assert 0 < row["allreduce"]["share_of_timed_step"] < 1
