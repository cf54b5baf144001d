"""bench_host.py measures what a plain decode step's host work calls: with async
scheduling (on by default with decode graphs) the step is scheduled by
``Scheduler.schedule_ahead``, read back by ``ModelRunner.collect``, and its state
postprocess's CPU twin is timed apart from the host's preparation; the twin's wrapper
is taken off again after a measurement."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_async_step_parts_are_timed(tiny_nemotron):
    import bench_host

    from hybridserve.runner import model_runner

    twin = model_runner.state_postprocess_reference
    for final_only in (True, False):
        row = bench_host.measure(tiny_nemotron, batch=4, prompt=8, warmup=2, steps=3,
                                 final_only=final_only)
        m = row["median_s"]
        assert row["graph_counters"]["graph_steps"] > 0
        for part in ("schedule", "graph_plan", "graph_fill", "postprocess_launch",
                     "postprocess_twin", "collect", "postprocess_commit", "append_tokens"):
            assert m[part] > 0, part
        assert ("make_output" in m) == (not final_only)
        parts = [k for k in m if k not in bench_host.TOTALS]
        assert abs(m["parts_sum"] - sum(m[k] for k in parts)) < 1e-12
        assert abs(m["parts_sum_without_twin"] - (m["parts_sum"] - m["postprocess_twin"])) < 1e-12
        assert set(row["gc"]) == {"seconds_per_step", "collections", "full_collections"}
        # The twin is unwrapped again: a second measurement does not time it twice.
        assert model_runner.state_postprocess_reference is twin
