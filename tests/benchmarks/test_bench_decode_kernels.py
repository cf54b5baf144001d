"""benchmarks/bench_decode_kernels.py in its smoke mode (the real run needs a GPU)."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_smoke_helpers import smoke_record  # noqa: E402


def test_benchmark_smoke(tmp_path):
    record = smoke_record("bench_decode_kernels", tmp_path)
    assert record["complete"] and record["commit"]
    assert [(c["rows"], c["q"]) for c in record["cases"]] == [(2, 1), (2, 4)]
    for case in record["cases"]:
        assert set(case["us"]) == {"conv_old", "conv_new", "ssm", "ops_old", "ops_two",
                                   "ops_fused"}
        assert all(v > 0 for v in case["us"].values())
        check = case["check"]
        # bf16 activations; the interpreter truncates where the GPU rounds: a few ulps.
        for form in ("conv_old", "conv_new"):
            assert check[form]["windows_equal_twin"]
            assert check[form]["out_rel_err_vs_twin"] < 2e-2
        assert check["fused"]["windows_equal_twin"]
        assert check["fused"]["y_rel_err_vs_two_launches"] < 1e-5
        assert check["fused"]["states_rel_err_vs_twin"] < 2e-2
        # Every tile of the sweep computes the twin's function.
        assert [t["tile"] for t in case["conv_tiles"]] == [[16, 4], [8, 2]]
        assert all(t["rel_err_vs_twin"] < 2e-2 and t["us"] > 0 for t in case["conv_tiles"])
        assert all(t["rel_err_vs_twin"] < 2e-2 and t["us"] > 0 for t in case["fused_tiles"])
        # The fused launch moves less than the two: the conv output stays in registers.
        assert case["min_bytes"]["fused"] < case["min_bytes"]["two_launches"]
    assert record["layers24_batch1"]["layers"] == 2
