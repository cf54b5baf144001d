"""bench_graph_launch.py, bench_ttft_timeline.py and bench_cached_step.py --host-only run end
to end in their smoke modes
(on the CPU: no graphs are captured, so only the plumbing and the files' shape are
checked here; their figures come from the GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_graph_launch_smoke_writes_every_piece_count(tmp_path):
    got = _run("bench_graph_launch.py", tmp_path / "gl.json")
    assert got["benchmark"] == "graph_launch" and got["env"]["commit"]
    pieces = [r["pieces"] for r in got["results"]]
    assert pieces == [1, 2]
    for r in got["results"]:
        assert r["wall_s"] > 0 and r["busy_s"] > 0 and r["wall_range_s"][0] <= r["wall_s"]


def test_ttft_timeline_smoke_times_the_cached_step_by_phase(tmp_path):
    got = _run("bench_ttft_timeline.py", tmp_path / "tl.json")
    (row,) = got["results"]
    m = row["median_s"]
    for phase in ("add_request", "schedule", "process", "rest", "total", "cold"):
        assert m[phase] >= 0, phase
    assert m["total"] > m["add_request"] + m["schedule"]
    assert all(r["total"] > 0 for r in row["runs"]) and len(row["runs"]) == 2
    assert row["cprofile"]["by_own"] and row["cprofile"]["by_cum"]


def test_cached_step_host_only_mode_leaves_host_work_and_the_same_token(tmp_path):
    """bench_cached_step.py --host-only: the layers pass their input through, so the
    forward phase is the embedding and the norm only; the eager and graph paths still
    agree on the first token (the script raises otherwise) and report a minimum."""
    out = tmp_path / "hc.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cached_step.py"),
                    "--prompt", "512", "--cached", "448", "--reps", "2", "--host-only",
                    "--graphs", "--label", "smoke", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    run = json.loads(out.read_text())["runs"]["smoke"]
    assert run["config"]["host_only"] is True
    for row in run["results"]:
        assert 0 < row["min_s"] <= row["median_s"]["total"]
        assert row["aten_ops_per_layer"] < 100  # no layer's arithmetic ran
