"""Host side of the cached-prefix first token, measured on the CPU.

The step: one ``--prompt``-token prompt whose first ``--cached`` tokens are cached (a
checkpoint on the state grid), generated to its first token through ``LLM.generate``.
On an H200 at 8B shapes its kernels take about 9 ms and its wall time two to four times
that: the host is the bottleneck. This script times the host work of exactly that step
on a tiny random Nemotron-H (its kernels' compute is small there), by phase:

- ``add_request``: validating and queueing the prompt (every token checked);
- ``schedule``: admission, the prefix-cache lookup (hashing every full block of the
  prompt, probing the block and checkpoint indexes) and the row;
- ``build_batch`` / ``plan_step``: the forward's metadata and step plan (their uploads);
- ``forward``: the model's forward (on the CPU this includes the layers' compute; the
  torch operators it runs are counted, per layer, as the launches a GPU would see);
- ``short_graph``: the short-row graph step (static buffer filled, forward, draw) when
  ``--graphs`` is on (the CPU runs it without capture, so this is its forward too);
- ``logits_and_draw``: gathering the sampled positions, the LM head and the draw;
- ``process``: committing the step (tokens, blocks registered, checkpoints admitted);
- ``rest``: everything else of the call (the output, the engine loop).

The kernel policy takes the short-row path with the torch twins (``short_rows =
"reference"``), the path the step takes on CUDA with the Triton kernels. Each mode runs
``--reps`` cached first tokens (each with a fresh tail over the same cached prefix) after
two warm-ups; medians are reported. ``--graphs`` adds the mode whose short-row steps
replay through the graph machinery (without capture on the CPU). ``--host-only`` replaces
every decoder layer's forward with the identity, so a call is host work and little else
(its total is then the figure to compare: ``min_s`` beside the median, as a loaded host's
noise only ever adds).

Writes ``--out`` (JSON, default ``benchmarks/results/host_cached_step_cpu.json``) with the
device, versions, commit and configuration. Usage: ``python benchmarks/bench_cached_step.py
[--prompt 8192 --cached 8064] [--graphs] [--host-only]``.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from hybridserve.config import KernelPolicy
from hybridserve.engine.engine_core import EngineCore
from hybridserve.testing.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# (owner path from the engine, attribute) -> phase name; nested phases are subtracted
# from their parents' times below.
PHASES = {
    ("", "add_request"): "add_request",
    ("scheduler", "schedule"): "schedule",
    ("scheduler", "_lookup_prefix"): "prefix_lookup",
    ("runner", "build_batch"): "build_batch",
    ("runner.model", "plan_step"): "plan_step",
    ("runner.model.model", "forward"): "forward",
    ("runner.graphs", "replay_short"): "short_graph",
    ("runner.model", "compute_logits"): "logits",
    ("runner", "_read_back"): "read_back",
    ("", "_process"): "process",
}


def _owner(eng, path: str):
    owner = eng
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _count_ops(fn) -> dict:
    """The torch operators ``fn`` runs (``torch.profiler``): the total and the top ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = [(e.count, e.key) for e in prof.key_averages() if e.key.startswith("aten::")]
    ops.sort(reverse=True)
    return {"aten_ops": sum(c for c, _ in ops),
            "top": [{"calls": c, "name": k} for c, k in ops[:12]]}


def measure(path: Path, prompt: int, cached: int, reps: int, graphs: bool) -> dict:
    interval = 64
    pages = cached // interval + 24
    llm = LLM(str(path), max_num_seqs=2, max_model_len=prompt + 16,
              enable_prefix_caching=True, state_interval=interval,
              checkpoint_policies=("grid", "prompt_end"), max_checkpoint_pages=pages,
              num_state_pages=pages + 24, max_num_batched_tokens=prompt,
              num_kv_blocks=4 * (-(-prompt // 16)) + 8,
              kernel_policy=KernelPolicy(short_rows="reference"))
    if graphs:
        eng = llm.engine
        llm.engine = None
        llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                                eng.eos_token_ids, enforce_eager=False)
    eng = llm.engine
    layers = len(llm.model.model.layers)
    acc: dict[str, float] = defaultdict(float)
    for (owner_path, name), key in PHASES.items():
        owner = _owner(eng, owner_path)
        if owner is None or not hasattr(owner, name):
            continue
        f = getattr(owner, name)

        def timed(*args, _f=f, _key=key, **kwargs):
            t = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                acc[_key] += time.perf_counter() - t

        setattr(owner, name, timed)

    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = llm.model.config.vocab_size
    prefix = torch.randint(3, vocab, (cached,), generator=g).tolist()

    def ids():
        return prefix + torch.randint(3, vocab, (prompt - cached,), generator=g).tolist()

    t = time.perf_counter()
    first = llm.generate([ids()], one, use_tqdm=False)
    cold_s = time.perf_counter() - t
    if first[0].num_cached_tokens != 0:
        raise RuntimeError("the cold run hit the cache")
    for _ in range(2):
        llm.generate([ids()], one, use_tqdm=False)
    per: dict[str, list[float]] = defaultdict(list)
    tokens = []
    for _ in range(reps):
        acc.clear()
        t = time.perf_counter()
        out = llm.generate([ids()], one, use_tqdm=False)
        total = time.perf_counter() - t
        if out[0].num_cached_tokens != cached:
            raise RuntimeError(f"cached run hit {out[0].num_cached_tokens} of {cached} tokens")
        tokens.append(out[0].outputs[0].token_ids)
        per["total"].append(total)
        a = dict(acc)
        # Nested phases: the lookup inside schedule; logits inside the graph step.
        a["schedule"] = a.get("schedule", 0.0) - a.get("prefix_lookup", 0.0)
        if "short_graph" in a:
            a["short_graph"] -= a.get("forward", 0.0) + a.get("logits", 0.0)
        for k, v in a.items():
            per[k].append(v)
        per["rest"].append(total - sum(a.values()))
    med = {k: statistics.median(v) for k, v in per.items()}
    low = min(per["total"])
    fwd_ops = _count_ops(lambda: llm.generate([ids()], one, use_tqdm=False))
    counters = dict(eng.runner.graphs.counters) if eng.runner.graphs is not None else {}
    # The host phases' medians summed (the forward's compute left out: on the CPU it is
    # the torch twins' arithmetic, and its variance would swamp a difference).
    host = sum(v for k, v in med.items() if k not in ("total", "forward"))
    return {"graphs": graphs, "cold_s": cold_s, "median_s": med, "min_s": low,
            "host_phases_s": host,
            "per_run_s": {k: v for k, v in per.items()},
            "layers": layers, "ops_per_call": fwd_ops,
            "aten_ops_per_layer": fwd_ops["aten_ops"] / layers,
            "graph_counters": counters, "tokens": tokens[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--cached", type=int, default=8064)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--graphs", action="store_true",
                    help="also the mode whose short-row steps take the graph path")
    ap.add_argument("--host-only", action="store_true",
                    help="decoder layers' forward replaced by the identity (host work only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="", help="what this run measures (e.g. before/after)")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks/results/host_cached_step_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = make_tiny_checkpoint("nemotron_h", tempfile.mkdtemp(prefix="bench_cached_"),
                                max_position_embeddings=2 * args.prompt)
    if args.host_only:
        # Every layer passes its input through: the step's tensors keep their shapes,
        # and what is left of a call is the engine's host work.
        from hybridserve.models.hybrid import DecoderLayer

        DecoderLayer.forward = lambda self, h, pending, batch, caches: (h, pending)
    rows = [measure(path, args.prompt, args.cached, args.reps, False)]
    if args.graphs:
        rows.append(measure(path, args.prompt, args.cached, args.reps, True))
    if len(rows) == 2 and rows[0]["tokens"] != rows[1]["tokens"]:
        raise RuntimeError("the graph path's first token differs from the eager path's")
    run = {
        "label": args.label,
        "env": {"device": platform.processor() or platform.machine(),
                "torch": torch.__version__, "python": platform.python_version(),
                "commit": git_commit(), "threads": args.threads},
        "config": {k: portable_path(v) if isinstance(v, Path) else v
                   for k, v in vars(args).items()},
        "model": "tiny random Nemotron-H (hybridserve.testing.tiny_models)",
        "kernel_policy": dataclasses.asdict(KernelPolicy(short_rows="reference")),
        "results": rows,
    }
    # Runs accumulate under their label (before / after a change), the latest per label.
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = old.get("runs", {}) if isinstance(old, dict) else {}
    runs[args.label or "latest"] = run
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "host_cached_step", "runs": runs}, indent=1)
                        + "\n")
    for r in rows:
        m = r["median_s"]
        parts = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(m.items()) if k != "total")
        print(f"{'graphs' if r['graphs'] else 'eager'}: total {1e3 * m['total']:.2f} ms "
              f"(min {1e3 * r['min_s']:.2f}) "
              f"(host phases {1e3 * r['host_phases_s']:.2f} ms; {parts}); "
              f"{r['ops_per_call']['aten_ops']} aten ops, "
              f"{r['aten_ops_per_layer']:.1f} per layer")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
