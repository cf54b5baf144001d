"""benchmarks/bench_gdn.py --smoke runs end to end: the paged decode kernel and the
token-by-token prefill against their twins, and the decode kernel's state drift against
a float64 twin, in the JSON it writes."""

from bench_smoke_helpers import smoke_record


def test_gdn_benchmark_smoke(tmp_path):
    record = smoke_record("bench_gdn", tmp_path)
    assert {"device", "torch", "triton", "commit", "config"} <= set(record)
    assert record["decode"] and all(r["rel_err_vs_twin"] < 1e-5 for r in record["decode"])
    assert all(r["token_kernel_rel_err_vs_twin"] < 1e-5 for r in record["prefill"])
    assert all(r["prefetch_equal"] and r["token_kernel_prefetch_us"] > 0 for r in record["prefill"])
    n = record["numerics"]
    assert n["steps"] == 8 and n["reference"] == "float64 twin"
    # float32 pages against float64: rounding only, no bfloat16-sized drift.
    assert 0 < n["state_rel_err_after_8_steps"] < 1e-5
    assert n["output_rel_err_at_step_8"] < 1e-5
