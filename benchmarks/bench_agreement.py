"""Greedy agreement of a low-precision run with float32, ours against transformers'.

For a tiny random checkpoint of each family (the ones ``bench_models.py`` uses for its
agreement section), greedy tokens in ``--dtype`` on ``--device``, ours and transformers',
each against our float32 run on the CPU (equal to transformers' float32 by the parity
tests): ``positional_agreement`` (the share of positions whose token equals float32's) and
``identical_sequences``. Greedy decoding on a random model is a chain of near-ties, so one
rounding flips a token and the rest of the row follows it: the figure to read is ours
against the reference implementation at the same dtype, not either one alone. The CPU's
bfloat16 kernels are not the GPU's; run it on each.

    python benchmarks/bench_agreement.py --device cpu --dtype bfloat16 --prompts 48 \
        --out benchmarks/results/agreement_cpu_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402
from bench_models import SHAPES  # noqa: E402
from provenance import device_label, git_commit, portable_path  # noqa: E402

# (name, architecture, layer pattern, overrides): a Mamba2 dense model beside the
# families of bench_models.py's shapes.
FAMILIES = [("nemotron_h", "nemotron_h", "M*-M-M*-", {})] + [
    (name, *SHAPES[name]["tiny_family"]) for name in SHAPES]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--families", nargs="+", default=None,
                    help=f"a subset of {[f[0] for f in FAMILIES]}")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    families = [f for f in FAMILIES if a.families is None or f[0] in a.families]
    if not families:
        raise SystemExit(f"--families: none of {a.families} in {[f[0] for f in FAMILIES]}")
    import transformers
    import triton

    result = {"benchmark": "bench_agreement", "device": device_label(a.device),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__},
              "commit": git_commit(),
              "config": {"dtype": a.dtype, "prompts": a.prompts, "new_tokens": a.new_tokens},
              "families": []}
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, layers, overrides in families:
            r = bench_gpu.agreement(a.device, a.dtype, Path(tmp), prompts=a.prompts,
                                    new_tokens=a.new_tokens, arch=arch, layers=layers,
                                    **overrides)
            t = r.get("transformers", {})
            row = {"family": name, "arch": arch, "layers": layers,
                   "ours": {k: r[k] for k in ("positional_agreement", "identical_sequences")},
                   "transformers": {k: t[k] for k in ("positional_agreement",
                                                      "identical_sequences") if k in t},
                   "ours_vs_transformers": (t.get("ours_vs_transformers") or {}).get(
                       "positional_agreement"),
                   "transformers_error": t.get("error")}
            result["families"].append(row)
            print(json.dumps(row), flush=True)
    result["wall_s"] = round(time.time() - start, 1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {portable_path(a.out)}")
    return result


if __name__ == "__main__":
    main()
