"""benchmarks/bench_prefill_kernels.py in its smoke mode (the real run needs a GPU)."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from bench_smoke_helpers import smoke_record  # noqa: E402


def test_benchmark_smoke(tmp_path):
    record = smoke_record("bench_prefill_kernels", tmp_path)
    assert record["commit"] and record["versions"]["torch"] == torch.__version__
    cases = {c["case"]: c for c in record["ssd"]}
    assert set(cases) == {"2x70 initial+final", "1x130 state every 64"}
    assert cases["1x130 state every 64"]["states"] == 3  # offsets 63, 127 and the end
    for case in record["ssd"]:
        for side in ("new", "chunk_states", "fused", "old"):
            assert case[side]["median_ms"] > 0
            # float32 kernels against the float64 twin on the same inputs
            assert case[side]["rel_err_y"] < 1e-2 and case[side]["rel_err_states"] < 1e-2
        # The two-pass default and the one-launch scan, with their tile sweeps.
        assert case["new"]["scan"] == "ssd_scan_two_pass"
        assert case["fused"]["scan"] == "ssd_scan_fused"
        assert case["chunk_states"]["scan"] == "ssd_scan_chunk_states"
        for side in ("new", "chunk_states", "fused"):
            assert case[side]["rel_err_y"] < 1e-5 and case[side]["rel_err_states"] < 1e-5
            variant = case[side]["variants"][0]
            assert variant["precision"] == "ieee"
            assert variant["rel_err_y"] < 1e-5 and variant["rel_err_states"] < 1e-5
        assert case["new"]["variants"][0]["state_block_p"] == 16
        assert case["chunk_states"]["variants"][0]["local_block_p"] == 16
        assert case["chunk_states"]["variants"][0]["pass_block"] == 64
        for side in ("new", "chunk_states"):
            wide = case[side]["variants"][-1]  # the 128-token output chunks
            assert wide["out_chunk"] == 128 and wide["rel_err_y"] < 1e-5
            assert wide["rel_err_states"] < 1e-5
    modes = [m["mode"] for m in record["conv"]["modes"]]
    assert modes == ["no window asked", "window mode, no window", "windows at row ends",
                     "windows every 64"]
    # bf16 outputs; the interpreter truncates where the GPU rounds: within a few ulps.
    assert all(m["rel_err"] < 1e-2 for m in record["conv"]["modes"])
    # Each window mode through both writers (the slab writer and the full-grid baseline),
    # the windows bit for bit the twin's.
    windows = {m["mode"]: m["windows"] for m in record["conv"]["modes"]}
    assert windows == {"no window asked": 0, "window mode, no window": 0,
                       "windows at row ends": 2, "windows every 64": 4}
    for m in record["conv"]["modes"][1:]:
        for writer in ("slabs", "full_grid"):
            assert m[writer]["median_ms"] > 0 and m[writer]["rel_err"] < 1e-2
            assert m[writer]["windows_exact"] is True, (m["mode"], writer)
    assert "full_grid" not in record["conv"]["modes"][0]
