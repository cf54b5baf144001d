"""A/B of the cached-prefix first token between two source trees, on one GPU.

``bench_gpu.py``'s ``ttft`` section, run for each tree in its own process, alternating
(A, B, A, B, ...): the 8B-shaped model, an 8,192-token prompt cold, then the same
prefix with a new 128-token tail served from its checkpoint at 8,064 tokens. Two
machines of the same kind differ by more than a small regression, so a before/after of
this step is only worth quoting from one run of this script.

Each tree is a directory holding ``hybridserve/`` and ``benchmarks/`` (a worktree or
``git archive COMMIT hybridserve benchmarks | tar -x -C DIR``); its ``bench_gpu.ttft``
and engine are imported from it alone. Writes ``--out`` (JSON: device, versions, each
tree's commit as given by ``--labels``, every run, and per tree the medians and ranges
of the cold and cached times, their speedup, and the cached step's host and kernel
parts). Usage::

    python benchmarks/bench_ttft_ab.py --trees OLD_DIR . --labels 851c208 28159ac \
        --rounds 2 --out benchmarks/results/gpu_ttft_ab_851c208_28159ac.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KEPT = ("cold_s", "cached_s", "speedup", "cached_split", "cold_runs", "cached_runs",
        "cached_by_tail", "cached_syncs")


def child(root: Path, reps: int, out: Path) -> None:
    """One process: ``reps`` ttft measurements of the tree at ``root``."""
    sys.path[:0] = [str(root), str(root / "benchmarks")]
    import bench_gpu
    import torch

    import hybridserve

    for module in (bench_gpu, hybridserve):  # the tree's own code, not an installed copy
        if not Path(module.__file__).resolve().is_relative_to(root):
            raise SystemExit(f"{module.__name__} imported from {module.__file__}, not {root}")
    model, _, mcfg, path = bench_gpu.build_models(
        bench_gpu.NEMOTRON_8B, "cuda", torch.bfloat16, Path(tempfile.mkdtemp()), False)
    runs = []
    for _ in range(reps):
        t = bench_gpu.ttft(model, path, "cuda", torch.bfloat16, 8192, 8064, 64,
                           mcfg.vocab_size, seed=7, tails=(128,))
        runs.append({**{k: t[k] for k in KEPT},
                     "top_kernels": t["cached_profile"]["top_kernels"]})
        print(root.name, t["cold_s"], t["cached_s"], t["speedup"], flush=True)
    out.write_text(json.dumps({"runs": runs, "device": torch.cuda.get_device_name(),
                               "torch": torch.__version__}, default=str))


def summary(runs: list[dict]) -> dict:
    def stat(values):
        values = list(values)
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"cold_s": stat(r["cold_s"] for r in runs),
            "cached_s": stat(r["cached_s"] for r in runs),
            "speedup": stat(r["speedup"] for r in runs),
            "host_s": stat(r["cached_split"]["host_s"] for r in runs),
            "kernel_s": stat(r["cached_split"]["kernel_s"] for r in runs),
            # Cached runs that follow a cached run (not a cold one), tail 128.
            "repeated_cached_s": stat(r["cached_by_tail"][0]["s"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, type=Path, required=True)
    ap.add_argument("--labels", nargs=2, required=True, help="what each tree is (commits)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tree, alternating")
    ap.add_argument("--reps", type=int, default=2, help="measurements per process")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child.resolve(), args.reps, args.child_out)
        return 0
    import torch
    import triton

    runs: dict[str, list] = {label: [] for label in args.labels}
    device = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for tree, label in zip(args.trees, args.labels):
                out = Path(tmp) / f"{label}_{i}.json"
                subprocess.run([sys.executable, __file__, "--trees", *map(str, args.trees),
                                "--labels", *args.labels, "--out", str(args.out),
                                "--reps", str(args.reps), "--child", str(tree),
                                "--child-out", str(out)], check=True)
                got = json.loads(out.read_text())
                device = got["device"]
                runs[label] += [{"process": i, **r} for r in got["runs"]]
    result = {
        "benchmark": "bench_ttft_ab", "device": device, "torch": torch.__version__,
        "triton": triton.__version__, "python": sys.version.split()[0],
        "config": {"prompt_len": 8192, "cached_len": 8064, "state_interval": 64,
                   "tail": 128, "rounds": args.rounds, "reps": args.reps,
                   "order": "alternating", "labels": args.labels},
        "medians": {label: summary(r) for label, r in runs.items()},
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["medians"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
