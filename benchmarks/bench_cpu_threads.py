"""Batch-1 generation speed on the CPU by torch thread count, on an idle and a busy host.

Why: the engine's CPU ops are small, and OpenMP threads that wait for each other spin;
when another process holds a core, every op waits for a thread that is not running.
This script measures what that costs on the embedded model, to pick the default
thread count of :class:`hybridserve.LLM` (``num_threads``).

Each configuration runs in a fresh process (the thread pool is process-wide): the
embedded model, one prompt, greedy, ``--tokens`` new tokens with ``ignore_eos``, after
one warm-up generation; the median of ``--repeats`` timed generations. Thread counts:
1, 2, torch's own default (what a process gets when nothing sets it), and
hybridserve's default (``LLM()`` with nothing set). Host states: ``idle`` (nothing
started by this script; the load average is recorded, since the host may be shared)
and ``busy`` (one extra process spinning on the CPU for the whole measurement).

Usage: ``python benchmarks/bench_cpu_threads.py [--tokens 64] [--repeats 3] [--out ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"
SPIN = "while True:\n    pass\n"


def worker(threads: str, tokens: int, repeats: int) -> dict:
    """One measurement in this process; ``threads`` is a count, ``torch`` or ``hybridserve``."""
    import statistics

    import torch

    from hybridserve import LLM, SamplingParams

    torch_default = torch.get_num_threads()
    if threads == "torch":
        num_threads = torch_default
    elif threads == "hybridserve":
        num_threads = None
    else:
        num_threads = int(threads)
    llm = LLM(max_num_seqs=1, num_threads=num_threads)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        rates.append(len(out.outputs[0].token_ids) / dt)
    return {
        "threads": threads,
        "torch_threads_used": torch.get_num_threads(),
        "torch_default_threads": torch_default,
        "tok_per_s_median": round(statistics.median(rates), 2),
        "tok_per_s": [round(r, 2) for r in rates],
    }


def run_config(threads: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HYBRIDSERVE_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, __file__, "--worker", threads, "--tokens", str(args.tokens),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_threads.json")
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.tokens, args.repeats)))
        return

    import torch

    configs = ["1", "2", "torch", "hybridserve"]
    results = {}
    for host in ("idle", "busy"):
        spinner = None
        if host == "busy":
            spinner = subprocess.Popen([sys.executable, "-c", SPIN])
            time.sleep(1.0)
        try:
            rows = []
            for threads in configs:
                load = os.getloadavg()[0]
                row = run_config(threads, args)
                row["load_average_1min_before"] = round(load, 2)
                rows.append(row)
                print(host, json.dumps(row), flush=True)
            results[host] = rows
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    report = {
        "benchmark": "bench_cpu_threads",
        "commit": git_commit(),
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": "embedded default model (hybridserve/default_model), float32",
        "config": {"prompt": PROMPT, "batch": 1, "new_tokens": args.tokens,
                   "repeats": args.repeats, "greedy": True, "ignore_eos": True,
                   "busy": "one extra process spinning a Python loop"},
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
