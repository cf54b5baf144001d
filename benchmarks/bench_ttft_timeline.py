"""Where the wall time of a cached-prefix first token goes on the GPU, phase by phase.

``bench_gpu.py``'s TTFT section splits the cached step (8,192 tokens, 8,064 cached)
into its kernels' time (profiler) and "the rest"; this script times the rest without a
profiler (which inflates launches). One engine as that section builds it (8B and ~1B
Nemotron-H shapes, random weights, short-row graphs), warmed, then ``--rounds`` rounds
of a cold prompt and a cached one over its prefix (a new tail). For each cached run:

- host phases (``time.perf_counter``, nested ones subtracted): ``add_request``,
  ``schedule`` (admission and the prefix walk), ``fill`` (the short-row graph's static
  buffer and its upload), ``launch`` (``CUDAGraph.replay``, host time), ``overlap``
  (the prefill row's commit, run while the device computes), ``wait`` (the read-back,
  the host blocked on the device), ``process`` (the step's results committed) and
  ``rest`` (the remainder of ``LLM.generate``);
- ``graph_device_s``: the device time from an event recorded just before the replay to
  one just after (kernels, the gaps between them, any wait for the launch), and
  ``graph_busy_s``: the same graph replayed 20 times back to back (one synchronize),
  per replay, after the rounds: the device's own time for it;
- ``cprofile``: one more cached run under ``cProfile`` (which inflates every Python
  call, so it ranks the host's functions rather than timing them): the top functions
  by own time and by cumulative time, per call of ``generate``.

Writes ``--out`` (JSON, default ``benchmarks/results/ttft_timeline.json``) with the
device, versions, commit and configuration. ``--smoke`` runs the tiny shape on the
CPU (the graph path without capture; no device times). Usage: ``python
benchmarks/bench_ttft_timeline.py [--shapes 8b,1b] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg  # noqa: E402
from provenance import git_commit  # noqa: E402

from hybridserve import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"8b": bg.NEMOTRON_8B, "1b": bg.NEMOTRON_1B, "tiny": bg.TINY}


def _wrap(owner, name: str, acc: dict, key: str, stack: list):
    f = getattr(owner, name)

    def timed(*args, **kwargs):
        stack.append(0.0)
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            inner = stack.pop()
            acc[key] += dt - inner
            if stack:
                stack[-1] += dt
    setattr(owner, name, timed)


def measure(shape_name: str, device: str, dtype, rounds: int, prompt_len: int, cached_len: int,
            interval: int) -> dict:
    shape = SHAPES[shape_name]
    work = Path(tempfile.mkdtemp(prefix="ttft_timeline_"))
    model, _, _, path = bg.build_models(shape, device, dtype, work, with_hf=False)
    max_len = prompt_len + 16
    pages = cached_len // interval + 24
    llm = bg.make_llm(
        model, path, device, dtype, 2, max_len, enable_prefix_caching=True,
        state_interval=interval, checkpoint_policies=("grid", "prompt_end"),
        max_checkpoint_pages=pages, num_state_pages=pages + 24,
        max_num_batched_tokens=prompt_len, num_kv_blocks=4 * (-(-max_len // 16)) + 8,
        enforce_eager=False,
    )
    eng = llm.engine
    vocab = shape["vocab_size"]
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ids(prefix):
        return prefix + torch.randint(3, vocab, (prompt_len - cached_len,), generator=g).tolist()

    acc: dict[str, float] = defaultdict(float)
    stack: list[float] = []
    on_gpu = device == "cuda"
    events: list = []
    last_graph: list = []
    graph_cls = torch.cuda.CUDAGraph
    replay = graph_cls.replay

    # Made ahead: an event's construction is host time the engine does not spend.
    spare = [torch.cuda.Event(enable_timing=True) for _ in range(2 * rounds + 16)] if on_gpu else []

    def timed_replay(self):
        last_graph[:] = [self]
        if on_gpu:
            before = spare.pop() if spare else torch.cuda.Event(enable_timing=True)
            before.record()
        t = time.perf_counter()
        replay(self)
        acc["launch"] += time.perf_counter() - t
        if stack:
            stack[-1] += time.perf_counter() - t
        if on_gpu:
            after = spare.pop() if spare else torch.cuda.Event(enable_timing=True)
            after.record()
            events.append((before, after))

    graph_cls.replay = timed_replay
    wait_t = []
    tensor_cls = torch.Tensor
    tolist = tensor_cls.tolist

    def timed_tolist(self):
        t = time.perf_counter()
        try:
            return tolist(self)
        finally:
            wait_t.append(time.perf_counter() - t)

    _wrap(eng, "add_request", acc, "add_request", stack)
    _wrap(eng.scheduler, "schedule", acc, "schedule", stack)
    graphs = eng.runner.graphs
    _wrap(graphs, "fill_short", acc, "fill", stack)
    _wrap(eng, "_commit_prefill_rows", acc, "overlap", stack)
    _wrap(eng, "_process", acc, "process", stack)
    try:
        warm = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
        for _ in range(2):
            llm.generate([ids(warm)], one, use_tqdm=False)
        runs = []
        for _ in range(rounds):
            prefix = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([ids(prefix)], one, use_tqdm=False)
            bg.sync(device)
            cold = time.perf_counter() - t
            acc.clear()
            events.clear()
            wait_t.clear()
            before = graphs.counters.get("short_graph_steps", 0)
            tensor_cls.tolist = timed_tolist
            cached_ids = ids(prefix)  # built before the clock starts
            t = time.perf_counter()
            out = llm.generate([cached_ids], one, use_tqdm=False)
            bg.sync(device)
            total = time.perf_counter() - t
            tensor_cls.tolist = tolist
            if out[0].num_cached_tokens != cached_len:
                raise RuntimeError(f"cached run hit {out[0].num_cached_tokens} of {cached_len}")
            row = {k: v for k, v in acc.items()}
            row["wait"] = sum(wait_t)
            row["rest"] = total - sum(row.values())
            row["total"] = total
            row["cold"] = cold
            row["replayed"] = graphs.counters.get("short_graph_steps", 0) > before
            if events:
                row["graph_device_s"] = sum(a.elapsed_time(b) for a, b in events) / 1e3
            runs.append(row)
        cached_ids = ids(prefix)
        profile = _cprofile(lambda: llm.generate([cached_ids], one, use_tqdm=False), device)
        busy = None
        if on_gpu and last_graph:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                replay(last_graph[0])
            torch.cuda.synchronize()
            busy = (time.perf_counter() - t) / 20
    finally:
        graph_cls.replay = replay
        tensor_cls.tolist = tolist
    keys = sorted({k for r in runs for k in r if k != "replayed"})
    med = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
    return {"shape": shape_name, "median_s": med, "graph_busy_s": busy, "runs": runs,
            "speedup": med["cold"] / med["total"], "cprofile": profile}


def _cprofile(fn, device: str, top: int = 40) -> dict:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    bg.sync(device)
    pr.disable()
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(pr).stats.items():
        # Relative names only: a result names no machine's folders.
        where = file.split("site-packages/")[-1]
        where = where.split("hybridserve/", 1)[-1] if "hybridserve/" in where else where
        where = str(Path(where).relative_to(ROOT)) if Path(where).is_absolute() and \
            Path(where).is_relative_to(ROOT) else where
        rows.append({"fn": f"{where}:{line} {name}", "calls": calls, "own_s": own, "cum_s": cum})
    return {"by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_s"])[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b,1b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--cached", type=int, default=8064)
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ttft_timeline.json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = ["tiny"] if args.smoke else args.shapes.split(",")
    if args.smoke:
        args.prompt, args.cached, args.rounds = 512, 448, 2
    rows = []
    for s in shapes:
        rows.append(measure(s, device, dtype, args.rounds, args.prompt, args.cached, 64))
        bg.free_memory(device)
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "commit": git_commit()}
    result = {"benchmark": "ttft_timeline", "env": env,
              "config": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        m = r["median_s"]
        parts = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in m.items() if k not in ("total", "cold"))
        busy = r["graph_busy_s"]
        print(f"{r['shape']}: cold {1e3 * m['cold']:.1f} ms, cached {1e3 * m['total']:.2f} ms "
              f"({r['speedup']:.1f}x): {parts}"
              + (f"; graph busy {1e3 * busy:.3f} ms" if busy else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
