"""Routing across replicas: token hit rate and modelled TTFT on a multi-turn chat trace.

Runs :func:`hybridserve.routing.sim.simulate`: each replica is the engine's real
scheduler and caches (BlockPool, StateCache, admission, checkpoint placement,
eviction, preemption) stepped without a model, so hit rates are the engine's own;
step times come from :class:`~hybridserve.routing.sim.StepCost` (a model, recorded in
the result). Policies compared on the same trace: ``checkpoint`` (deepest prefix with
KV blocks and a checkpoint), ``prefix`` (deepest KV-block prefix, checkpoints
ignored, as token-prefix routers do), ``round_robin`` and ``random``; plus one
replica serving everything as the reference hit rate.

Two cache sizes per replica: ``roomy`` (state pages for every live conversation's
checkpoints) and ``state_bound`` (few state pages beside plentiful KV blocks, as when
a recurrent state is megabytes: checkpoints are evicted while KV blocks stay).

Usage: ``python benchmarks/bench_routing.py [--out benchmarks/results/routing.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from provenance import git_commit, portable_path

from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.routing.sim import StepCost, multi_turn_trace, simulate

CACHES = {
    "roomy": CacheConfig(kv_block_size=16, num_kv_blocks=1500, num_state_pages=512, state_interval=64),
    "state_bound": CacheConfig(kv_block_size=16, num_kv_blocks=1500, num_state_pages=128, state_interval=64),
}
POLICIES = ("checkpoint", "prefix", "round_robin", "random")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/routing.json")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--arrival-rate", type=float, default=10.0, help="new conversations per second")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    trace_kw = dict(num_conversations=args.conversations, turns=args.turns,
                    arrival_rate=args.arrival_rate, num_system_prompts=4, seed=args.seed)
    trace = multi_turn_trace(**trace_kw)
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=4096)
    cost = StepCost()
    rows = []
    t0 = time.perf_counter()
    for cache_name, cache in CACHES.items():
        single = simulate(trace, 1, "checkpoint", cache, sched, cost)
        rows.append(_row(cache_name, single))
        for n in (2, 4):
            for policy in POLICIES:
                res = simulate(trace, n, policy, cache, sched, cost, max_queue=args.max_queue, seed=args.seed)
                rows.append(_row(cache_name, res))
    for r in rows:
        print(f"{r['cache']:12s} {r['replicas']} {r['policy']:12s} hit {r['hit_rate']:.3f} "
              f"ttft p50 {r['ttft_p50_ms']:.1f} ms p90 {r['ttft_p90_ms']:.1f} ms "
              f"sticky {r['sticky']:.2f} per replica {r['per_replica_requests']}")
    out = {
        "benchmark": "bench_routing",
        "commit": git_commit(),
        "python": platform.python_version(),
        "wall_s": round(time.perf_counter() - t0, 2),
        "trace": trace_kw,
        "max_queue": args.max_queue,
        "scheduler": asdict(sched),
        "step_cost_s": asdict(cost),
        "caches": {k: {f: getattr(v, f) for f in ("kv_block_size", "num_kv_blocks", "num_state_pages",
                                                   "state_interval", "checkpoint_budget")}
                   for k, v in CACHES.items()},
        "results": rows,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {portable_path(path)}", file=sys.stderr)


def _row(cache_name: str, res) -> dict:
    return {
        "cache": cache_name,
        "replicas": res.num_replicas,
        "policy": res.policy if res.num_replicas > 1 else "one_replica",
        "hit_rate": round(res.hit_rate, 4),
        "ttft_p50_ms": round(res.ttft_p50 * 1e3, 2),
        "ttft_p90_ms": round(res.ttft_p90 * 1e3, 2),
        "sticky": round(res.sticky_fraction(), 3),
        "per_replica_requests": res.per_replica_requests,
        "routing": res.routing,
    }


if __name__ == "__main__":
    main()
