"""The GPU benchmark's CPU smoke mode runs every section end to end and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_smoke(tmp_path):
    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--smoke", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert not result["skipped"]
    for key in ("copy_bandwidth", "matmul", "kernels", "ttft", "agreement", "ratios", "prefill"):
        assert result[key], key
    assert [r["batch"] for r in result["decode"]["ours"]] == [1, 4]
    # The smoke run takes the decode-graph path (its static-buffer step, no capture on the
    # CPU) on alternate steps, the eager fast path on the others.
    for r in result["decode"]["ours"]:
        assert r["mode"] == "graph" and set(r["modes"]) == {"graph", "eager"}
        assert r["graphs"]["timed_graph_steps_replayed"] == r["steps_timed"]
        assert not r["graphs"]["capture_errors"]
    assert [r["batch"] for r in result["decode"]["ours_eager"]] == [1, 4]
    assert result["prefill"]["prompts_run"] == 2
    assert result["agreement"]["graphs_vs_eager"]["positional_agreement"] == 1.0
    assert result["agreement"]["graph_counters"]["graph_steps"] > 0
    assert result["ttft"]["cached_runs"][0][1] == result["ttft"]["cached_len"]
    assert result["agreement"]["positional_agreement"] == 1.0
    for k in ("device", "torch", "triton", "commit"):
        assert result["env"][k]
