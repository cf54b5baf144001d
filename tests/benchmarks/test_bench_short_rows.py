"""benchmarks/bench_short_rows.py --smoke runs end to end: the token walk, its
prefetching form and the chunked walk on one short step, each timed and held to the
float64 twin in the JSON it writes."""

from bench_smoke_helpers import smoke_record


def test_short_rows_benchmark_smoke(tmp_path):
    record = smoke_record("bench_short_rows", tmp_path)
    assert {"device", "torch", "commit", "config", "rows", "wall_s"} <= set(record)
    assert record["smoke"]
    walks = [r["walk"] for r in record["rows"]]
    assert walks == ["tokens", "prefetch", "chunks16_ieee_p16_w4"]
    for r in record["rows"]:
        assert "error" not in r, r
        assert r["us"] > 0
        assert r["y_rel_err_vs_float64"] < 1e-5 and r["states_rel_err_vs_float64"] < 1e-5
