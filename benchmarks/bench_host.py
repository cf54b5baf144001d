"""Host work of a decode step, measured on the CPU: the engine's whole ``step()`` minus the
model forward, at several batch sizes.

On a GPU the forward of a replayed decode graph runs while the host waits; everything
else in ``step()`` (scheduling, filling the static buffers, launching, reading back,
the state postprocess's host side, appending tokens, building outputs) adds to the step
time. This script measures that remainder without a GPU: a tiny Nemotron-H model on the
decode-graph path's static-buffer step (``enforce_eager=False``; no capture off CUDA),
timing ``step()`` and, inside it, the static forward (``DecodeGraphs._forward``), whose
time is subtracted. On the CPU the state postprocess runs its torch twin inside the
step (on CUDA it is a kernel): the breakdown reports the twin's call as
``postprocess_twin``, apart from ``postprocess_launch`` (the host's preparation of the
postprocess's inputs), and ``host_without_twin`` is the host remainder less the twin,
what a GPU host pays besides the kernel's launch. With async scheduling (on by default
with decode graphs) a plain decode step is scheduled by ``Scheduler.schedule_ahead``,
counted as ``schedule`` too; ``collect`` is the read-back and the rows' results and
decisions built from it; ``unattributed`` is the host remainder less every named part
(the step loop's own work). ``parts_sum`` adds the parts' medians: on a shared machine
it is the figure that holds (see ``_run``). ``gc`` reports the garbage collections
during the timed steps (their seconds a step, and how many were full ones), which the
medians leave out. ``--clock cpu`` times with this thread's CPU time instead of the wall
clock: on a machine shared with other work, the figure that compares between runs.

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
import gc
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
from hybridserve.runner import model_runner
from hybridserve.testing.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# engine attribute path -> name in the breakdown (those present in this version)
TIMED = {
    ("scheduler", "schedule"): "schedule",
    ("scheduler", "schedule_ahead"): "schedule",
    ("runner.graphs", "shape_of"): "graph_plan",
    ("runner.graphs", "fill"): "graph_fill",
    ("runner", "_postprocess"): "postprocess_launch",
    ("runner", "collect"): "collect",
    ("", "_commit_postprocess"): "postprocess_commit",
    ("", "_append_tokens"): "append_tokens",
    ("", "_make_output"): "make_output",
}

# What every timing reads (``--clock``): wall time, or this thread's CPU time, which
# leaves out the slices another process takes (on a shared machine they land in a
# different part of each step, and more in one run than in the next).
CLOCK = [time.perf_counter]

# Totals, not parts, in a step's figures.
TOTALS = ("step", "host", "forward", "host_without_twin", "parts_sum", "parts_sum_without_twin")


def measure(path: Path, batch: int, prompt: int, warmup: int, steps: int,
            final_only: bool, gc_freeze: bool = False) -> dict:
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
            t = CLOCK[0]()
            try:
                return f(*args, **kwargs)
            finally:
                acc[key] += CLOCK[0]() - t

        setattr(owner, name, timed)

    for (owner_path, name), key in TIMED.items():
        owner = eng
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        if hasattr(owner, name):
            wrap(owner, name, key)
    wrap(eng.runner.graphs, "_forward", "forward")
    # The CPU's postprocess twin, called from inside the runner's _postprocess (which
    # imported it by name): timed apart, and taken out of postprocess_launch below.
    twin = getattr(model_runner, "state_postprocess_reference", None)
    if twin is not None:
        wrap(model_runner, "state_postprocess_reference", "postprocess_twin")
    try:
        return _run(eng, batch, prompt, warmup, steps, final_only, acc, twin is not None,
                    gc_freeze)
    finally:
        if twin is not None:
            model_runner.state_postprocess_reference = twin


def _run(eng, batch: int, prompt: int, warmup: int, steps: int, final_only: bool,
         acc: dict[str, float], twin: bool, gc_freeze: bool) -> dict:
    """Fill the engine with ``batch`` decoding requests and time ``steps`` steps (``acc``
    gathers the timed functions' seconds of the step under way). ``gc_freeze``: move
    every object alive after the warm-up out of the collector's sight (``gc.freeze()``)
    for the timed steps, so that a full collection scans only what the steps made."""
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
    # Garbage collections during the timed steps: a full one lands on one step (the
    # medians skip it) but its cost is paid all the same, so it is reported apart.
    collections = {"seconds": 0.0, "full": 0, "count": 0}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = CLOCK[0]()
            return
        collections["seconds"] += CLOCK[0]() - started[0]
        collections["count"] += 1
        collections["full"] += info["generation"] == 2

    if gc_freeze:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(on_gc)
    try:
        _timed_steps(eng, steps, acc, twin, per_step)
    finally:
        gc.callbacks.remove(on_gc)
        if gc_freeze:
            gc.unfreeze()
    graphs = eng.runner.graphs.counters
    med = {k: statistics.median(v) for k, v in per_step.items()}
    # On a shared machine a step often loses a scheduler slice to another process
    # (several ms at once), which lands in a different part each time: the parts'
    # medians skip it, the host median does not. Their sum is the figure that holds.
    parts = [k for k in med if k not in TOTALS]
    med["parts_sum"] = sum(med[k] for k in parts)
    med["parts_sum_without_twin"] = med["parts_sum"] - med.get("postprocess_twin", 0.0)
    running = len(eng.scheduler.running)
    if running != batch:
        raise RuntimeError(f"only {running} of {batch} requests running; raise the cache sizes")
    gc_stats = {"seconds_per_step": collections["seconds"] / steps,
                "collections": collections["count"], "full_collections": collections["full"]}
    return {"batch": batch, "final_only": final_only, "median_s": med, "gc": gc_stats,
            "graph_counters": dict(graphs)}


def _timed_steps(eng, steps: int, acc: dict[str, float], twin: bool,
                 per_step: dict[str, list[float]]) -> None:
    for _ in range(steps):
        acc.clear()
        t = CLOCK[0]()
        eng.step()
        total = CLOCK[0]() - t
        per_step["step"].append(total)
        host = total - acc["forward"]
        per_step["host"].append(host)
        if twin:
            acc["postprocess_launch"] -= acc["postprocess_twin"]
            per_step["host_without_twin"].append(host - acc["postprocess_twin"])
        named = sum(v for k, v in acc.items() if k != "forward")
        per_step["unattributed"].append(host - named)
        for k, v in acc.items():
            per_step[k].append(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: time.perf_counter; cpu: time.thread_time (this thread's CPU "
                         "time: robust to other processes on the machine)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up: what full collections cost when "
                         "they scan only the objects the steps made")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/host_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    path = make_tiny_checkpoint("nemotron_h", tempfile.mkdtemp(prefix="bench_host_"),
                                max_position_embeddings=4096)
    # Per-step outputs (the server's mode) and, where the engine has it, finished-only
    # outputs (the offline API's mode).
    modes = [False]
    if "final_only" in inspect.signature(EngineCore.add_request).parameters:
        modes.append(True)
    rows = [measure(path, int(b), args.prompt, args.warmup, args.steps, final_only, args.gc_freeze)
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
                          if k not in TOTALS)
        print(f"batch {r['batch']}{' final-only' if r['final_only'] else ''}: step {1e3 * m['step']:.2f} ms, forward "
              f"{1e3 * m['forward']:.2f} ms, host {1e3 * m['host']:.2f} ms, parts {1e3 * m['parts_sum']:.2f} ms "
              f"({1e3 * m['parts_sum_without_twin']:.2f} ms without the twin; {parts}); "
              f"gc {1e3 * r['gc']['seconds_per_step']:.2f} ms a step ({r['gc']['full_collections']} full)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
