"""benchmarks/bench_prefix_cache.py on a small trace: it runs, and the prefix cache hits."""

import importlib.util
from pathlib import Path


def test_prefix_cache_benchmark_runs(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_prefix_cache.py"
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--out", str(tmp_path / "r.json"), "--requests", "8", "--chats", "2", "--turns", "2"])
    shared = report["results"]["shared_prefix"]
    assert shared["hybridserve"]["hit_rate"] > shared["block_grid_528"]["hit_rate"] == 0.0
    assert shared["no_cache"]["prefix_hit_tokens"] == 0
