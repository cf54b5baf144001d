"""The MoE benchmark's CPU smoke mode runs end to end (both shapes, the load section) and
writes its JSON with grouped and loop outputs in agreement."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_moe_smoke(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_moe.py"), "--smoke", "--tokens", "3",
         "--variants", "1", "--load", "--load-layers", "2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert set(result["shapes"]) == {"nemotron-3-nano", "granite-4.0-h-small"}
    for shape in result["shapes"].values():
        (case,) = shape["cases"]
        assert case["tokens"] == 3 and case["grouped_vs_loop_rel_err"] < 1e-5
        assert case["grouped_s"] > 0 and case["loop_s"] > 0 and case["bytes_touched"] > 0
        # the first version and the current path timed side by side, the same outputs
        assert set(case["compare"]) == {"old", "new"}
        for row in case["compare"].values():
            assert row["grouped_s"] > 0 and row["block_vs_module_rel_err"] < 1e-5
    load = result["load"]
    assert load["shards"] == 2 and load["bytes"] > 0 and load["gb_per_s"] > 0
    assert load["stacked_up_proj_shape"] == [8, 32, 64]
    for k in ("device", "torch", "triton", "commit"):
        assert result["env"][k]
