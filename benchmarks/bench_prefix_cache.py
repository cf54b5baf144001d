"""Prefix-cache hit rate on shared-prefix and multi-turn chat traces.

Runs the engine (CPU, a tiny random model: hit rates depend on the token trace, not on
the weights) on two traces and reports, for each, the token hit rate and the prefill
tokens saved, beside two baselines computed on the *same* trace in the same run:

- ``no_cache``: prefix caching off (every prompt token is prefilled).
- ``block_grid_528``: a model of a block-grid policy as vLLM applies it to hybrid
  models. Rules modelled:
    1. The recurrent state shares the attention page, whose size is raised to fit one
       state: 528 tokens (the smallest hybrid page size seen in vLLM; real models get
       528 to 8,320).
    2. A state is kept only where a scheduler step ends on a page boundary ("align"
       mode). We credit it generously: every page boundary inside every earlier
       request's computed tokens (prompt and output) gets a state, as if the
       scheduler always split prefill there.
    3. A hit is the largest page boundary h <= len(prompt) - 1 whose whole prefix was
       computed by an earlier request with identical tokens.
    4. Unlimited capacity: nothing is ever evicted (an upper bound for the policy).

Usage: ``python benchmarks/bench_prefix_cache.py [--out benchmarks/results/prefix_cache.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.testing.tiny_models import make_tiny_checkpoint

VOCAB = 256


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def shared_prefix_trace(rng: random.Random, num_requests: int, system_len: int) -> list[list[list[int]]]:
    """Waves of requests: one system prompt of ``system_len`` tokens + a unique question."""
    system = _rand(rng, system_len)
    prompts = [system + _rand(rng, rng.randint(20, 60)) for _ in range(num_requests)]
    return [prompts[i : i + 4] for i in range(0, len(prompts), 4)]


class BlockGridModel:
    """The block-grid policy of the module docstring, replayed on a token trace."""

    def __init__(self, page: int = 528) -> None:
        self.page = page
        self.states: set[tuple[int, ...]] = set()

    def lookup(self, prompt: list[int]) -> int:
        best = 0
        for h in range(self.page, len(prompt), self.page):
            if tuple(prompt[:h]) in self.states:
                best = h
        return best

    def record(self, computed: list[int]) -> None:
        for h in range(self.page, len(computed) + 1, self.page):
            self.states.add(tuple(computed[:h]))


def run_trace(llm: LLM, waves_fn, params: SamplingParams) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    """Run a trace; returns engine counters and (prompt, output) pairs in order."""
    pairs = []
    t0 = time.perf_counter()
    for wave in waves_fn(pairs):
        outs = llm.generate(wave, params, use_tqdm=False)
        pairs += [(p, o.outputs[0].token_ids) for p, o in zip(wave, outs)]
    stats = llm.stats()
    stats["wall_s"] = time.perf_counter() - t0
    return stats, pairs


def replay_block_grid(pairs: list[tuple[list[int], list[int]]], page: int) -> dict:
    model = BlockGridModel(page)
    hit = total = 0
    for prompt, output in pairs:
        hit += model.lookup(prompt)
        total += len(prompt)
        # Computed tokens: the prompt and every output token but the last.
        model.record(prompt + output[:-1])
    return {"prefix_hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / total if total else 0.0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=300)
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--state-interval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    model_dir = make_tiny_checkpoint("granitemoehybrid", Path(tempfile.mkdtemp()) / "m", seed=0)

    def shared_waves(_pairs):
        yield from shared_prefix_trace(random.Random(args.seed), args.requests, args.system_len)

    def chat_waves(pairs):
        rng = random.Random(args.seed + 1)
        convs = [_rand(rng, rng.randint(200, 500)) for _ in range(args.chats)]
        for turn in range(args.turns):
            if turn:
                done = pairs[-args.chats :]
                convs = [p + o + _rand(rng, rng.randint(30, 120)) for p, o in done]
            yield list(convs)

    results = {}
    for name, waves in (("shared_prefix", shared_waves), ("multi_turn_chat", chat_waves)):
        row = {}
        for label, caching in (("hybridserve", True), ("no_cache", False)):
            llm = LLM(
                model_dir, enable_prefix_caching=caching, state_interval=args.state_interval,
                max_model_len=2048, max_num_seqs=8,
            )
            stats, pairs = run_trace(llm, waves, params)
            q = sum(len(p) for p, _ in pairs)
            row[label] = {
                "prefix_hit_tokens": stats["prefix_hit_tokens"],
                "prompt_tokens": q,
                "hit_rate": stats["prefix_hit_tokens"] / q,
                "prefill_tokens_computed": q - stats["prefix_hit_tokens"],
                "checkpoints_admitted": stats["checkpoints_admitted"],
                "checkpoint_pages_live": stats["checkpoint_pages"],
                "wall_s": stats["wall_s"],
            }
            if caching:
                row["block_grid_528"] = replay_block_grid(pairs, 528)
        results[name] = row

    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    report = {
        "benchmark": "prefix_cache_hit_rate",
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "commit": commit,
        "config": vars(args) | {"kv_block_size": 16, "max_tokens": params.max_tokens, "model": "tiny random"},
        "results": results,
    }
    print(f"{'trace':<18} {'policy':<16} {'hit rate':>9} {'prefill tokens':>15}")
    for trace, row in results.items():
        for policy, r in row.items():
            computed = r["prompt_tokens"] - r["prefix_hit_tokens"]
            print(f"{trace:<18} {policy:<16} {r['hit_rate']:>9.1%} {computed:>15}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
