"""The structured-outputs benchmark's CPU smoke mode runs through the decode-graph path
(static-buffer steps, no capture) and reports constrained decode steps as replayed
graph steps with their mask fills timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_structured_smoke(tmp_path):
    out = tmp_path / "structured.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_structured.py"), "--smoke", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graphs"] and not result["captured"] and not result["capture_errors"]
    rows = result["rows"]
    assert [r["constrained"] for r in rows] == [0, 2, 4]
    free, *constrained = rows
    assert free["masked_graph_steps"] == 0 and free["mask_fill_calls"] == 0
    for r in constrained:
        # Every decode step (all but the prompts' step) replayed with masks.
        assert r["masked_graph_steps"] == r["graph_steps"] == r["steps"] - r["eager_steps"] > 0, r
        assert r["mask_fill_calls"] >= r["masked_graph_steps"] and r["mask_fill_ms_median"] > 0
