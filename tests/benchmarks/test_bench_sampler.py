"""benchmarks/bench_sampler.py --smoke runs end to end: the twin's and the kernel's draw
and sample_step at every batch of the smoke shape, with the same tokens, in the JSON it
writes."""

import pytest
from bench_smoke_helpers import smoke_record

# The interpreter's NumPy log of a residual's zeros: -inf, as torch gives, with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def test_sampler_benchmark_smoke(tmp_path):
    record = smoke_record("bench_sampler", tmp_path)
    assert {"device", "torch", "triton", "commit", "config", "results"} <= set(record)
    assert record["smoke"] and record["config"]["top_p"] == 0.95
    rows = [r["rows"] for r in record["results"]]
    assert rows == list(record["config"]["batches"])
    for r in record["results"]:
        assert r["same_tokens_draw"] and r["same_tokens_sample_step"]
        assert r["same_tokens_speculative"]
        assert list(r["draw_kernel_us_by_splits"]) == [1]  # the smoke vocabulary is one block
        assert r["kernel_bytes"] == r["rows"] * record["config"]["vocab"] * 4
        for key in ("draw_twin_us", "draw_kernel_us", "sample_step_twin_us",
                    "sample_step_kernel_us", "speculative_twin_us", "speculative_kernel_us", "argmax_us", "copy_us_same_traffic"):
            assert r[key] > 0, key
