"""Host work of a decode step, measured on the CPU: the engine's whole ``step()`` minus the
model forward, at several batch sizes.

On a GPU the forward of a replayed decode graph runs while the host waits; everything
else in ``step()`` (scheduling, filling the static buffers, launching, reading back,
the state postprocess's host side, appending tokens, building outputs) adds to the step
time. This script measures that remainder without a GPU: a tiny Nemotron-H model on the
decode-graph path's static-buffer step (``enforce_eager=False``; no capture off CUDA),
timing ``step()`` and, inside it, the static forward (``DecodeGraphs._forward``), whose
time is subtracted. On the CPU the state postprocess runs its torch twin inside the
step, so its compute counts as host time here (on CUDA it is a kernel); the breakdown
reports it separately where the engine exposes it.

Every request decodes greedily with ``max_tokens`` large enough that no request
finishes during the timed steps. Each batch runs twice where the engine supports it:
with an output per request per step (what a streaming server asks for) and with
finished-only outputs (what the offline ``LLM.generate`` asks for). Results go to ``--out`` (JSON): device, versions,
commit, config, and per batch the median step time, the median forward time, the host
remainder and the breakdown by engine function (medians over the timed steps).

Usage: ``python benchmarks/bench_host.py [--batches 16,64,256] [--out ...]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from provenance import git_commit, portable_path

from hybridserve import LLM, SamplingParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.testing.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# engine attribute path -> name in the breakdown (those present in this version)
TIMED = {
    ("scheduler", "schedule"): "schedule",
    ("runner.graphs", "shape_of"): "graph_plan",
    ("runner.graphs", "fill"): "graph_fill",
    ("runner", "_postprocess"): "postprocess_launch",
    ("", "_commit_postprocess"): "postprocess_commit",
    ("", "_append_tokens"): "append_tokens",
    ("", "_make_output"): "make_output",
}


def measure(path: Path, batch: int, prompt: int, warmup: int, steps: int,
            final_only: bool) -> dict:
    max_len = prompt + warmup + steps + 64
    llm = LLM(str(path), max_num_seqs=batch, max_model_len=max_len, enforce_eager=False,
              enable_prefix_caching=False, num_kv_blocks=batch * (-(-max_len // 16)) + 8,
              num_state_pages=4 * batch + 8, max_checkpoint_pages=1,
              max_num_batched_tokens=max(2048, batch))
    eng = llm.engine
    acc: dict[str, float] = defaultdict(float)

    def wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t

        setattr(owner, name, timed)

    for (owner_path, name), key in TIMED.items():
        owner = eng
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        if hasattr(owner, name):
            wrap(owner, name, key)
    wrap(eng.runner.graphs, "_forward", "forward")

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 32, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, 200, (prompt,), generator=g).tolist()
        if final_only:
            eng.add_request(f"r{i}", ids, params, final_only=True)
        else:
            eng.add_request(f"r{i}", ids, params)
    while any(r.num_computed_tokens < prompt for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(warmup):
        eng.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        acc.clear()
        t = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t
        per_step["step"].append(total)
        per_step["host"].append(total - acc["forward"])
        for k, v in acc.items():
            per_step[k].append(v)
    graphs = eng.runner.graphs.counters
    med = {k: statistics.median(v) for k, v in per_step.items()}
    running = len(eng.scheduler.running)
    if running != batch:
        raise RuntimeError(f"only {running} of {batch} requests running; raise the cache sizes")
    return {"batch": batch, "final_only": final_only, "median_s": med,
            "graph_counters": dict(graphs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/host_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = make_tiny_checkpoint("nemotron_h", tempfile.mkdtemp(prefix="bench_host_"),
                                max_position_embeddings=4096)
    # Per-step outputs (the server's mode) and, where the engine has it, finished-only
    # outputs (the offline API's mode).
    modes = [False]
    if "final_only" in inspect.signature(EngineCore.add_request).parameters:
        modes.append(True)
    rows = [measure(path, int(b), args.prompt, args.warmup, args.steps, final_only)
            for b in args.batches.split(",") if b for final_only in modes]
    result = {
        "env": {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
                "python": platform.python_version(), "commit": git_commit(),
                "threads": args.threads},
        "config": {k: portable_path(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()},
        "model": "tiny random Nemotron-H (hybridserve.testing.tiny_models)",
        "path": "decode-graph static-buffer step, no capture (CPU)",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        m = r["median_s"]
        parts = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in sorted(m.items())
                          if k not in ("step", "host", "forward"))
        print(f"batch {r['batch']}{' final-only' if r['final_only'] else ''}: step {1e3 * m['step']:.2f} ms, forward "
              f"{1e3 * m['forward']:.2f} ms, host {1e3 * m['host']:.2f} ms ({parts})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
