"""bench_agreement.py runs end to end: in float32 on the CPU, ours and transformers'
greedy tokens both equal the float32 reference (the parity the tests establish), and the
report names its device, versions and commit."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_float32_agrees_everywhere(tmp_path):
    import bench_agreement

    out = tmp_path / "agreement.json"
    result = bench_agreement.main(["--device", "cpu", "--dtype", "float32", "--prompts", "2",
                                   "--new-tokens", "4", "--families", "nemotron_h",
                                   "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert {"device", "versions", "commit", "config"} <= set(result)
    (row,) = result["families"]
    assert row["transformers_error"] is None
    assert row["ours"] == {"positional_agreement": 1.0, "identical_sequences": 2}
    assert row["transformers"] == {"positional_agreement": 1.0, "identical_sequences": 2}
    assert row["ours_vs_transformers"] == 1.0
