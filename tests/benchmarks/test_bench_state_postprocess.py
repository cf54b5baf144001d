"""benchmarks/bench_state_postprocess.py in its smoke mode (the real run needs a GPU)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402


def _load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_state_postprocess.py"
    spec = importlib.util.spec_from_file_location("bench_state_postprocess", path)
    module = importlib.util.module_from_spec(spec)
    # Dataclasses resolve their module through sys.modules while the class is built.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_smoke(tmp_path):
    bench = _load_benchmark()
    committed = bench.DEFAULT_OUT.read_bytes() if bench.DEFAULT_OUT.exists() else None
    out = tmp_path / "smoke.json"
    record = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert record["smoke"] and record["torch"] == torch.__version__
    assert record["triton"] == triton.__version__ and record["git_commit"]
    assert not record["external_reference"]["measured_here"]
    results = record["results"]
    rows = record["config"]["rows"]
    assert {k: v["num_crossing"] for k, v in results.items()} == {
        "one_crossing": 1, "all_crossing": rows, "none_crossing": 0}
    page_bytes = record["config"]["page_bytes"]
    for row in results.values():
        assert row["ownership"]["state_bytes_moved"] == 0
        assert row["copy"]["state_bytes_moved"] == 2 * row["num_crossing"] * page_bytes
        assert row["ownership"]["median_us"] > 0 and row["copy"]["median_us"] > 0
    assert results["none_crossing"]["d2d"] is None
    assert results["all_crossing"]["d2d"]["state_bytes_moved"] == 2 * rows * page_bytes
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--out", str(bench.DEFAULT_OUT)])
    after = bench.DEFAULT_OUT.read_bytes() if bench.DEFAULT_OUT.exists() else None
    assert after == committed
