"""``hybridserve demo``: what the engine does, on the embedded model, in half a minute.

1. A few greedy code completions.
2. A shared-prefix batch (one long module header, several different function stubs)
   arriving together, then again, showing prefix-cache hits per request.
3. The same batch with n-gram speculative decoding and, on the embedded model, with
   its trained draft model (``"default-draft"``), showing each drafter's acceptance
   rate and that the greedy text is unchanged.
"""

from __future__ import annotations

import argparse
import time

from hybridserve.engine.request import SamplingParams

COMPLETIONS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_py_files(path):"]

HEADER = '''"""Utilities for reading and writing configuration files."""

import json
import os
import sys
from pathlib import Path


class ConfigError(Exception):
    """Raised when a configuration file cannot be parsed."""


def _read_text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()

'''

STUBS = ["def load_json(path):", "def save_json(obj, path):", "def find_config(start):", "def merge(a, b):"]


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def run_demo(args: argparse.Namespace) -> int:
    from hybridserve.cli import llm_from_args

    t0 = time.perf_counter()
    llm = llm_from_args(args)
    if llm.tokenizer is None:
        print("this model ships no tokenizer; the demo needs text")
        return 2
    print(f"model: {llm.config.model}  ({time.perf_counter() - t0:.1f} s to load)\n")

    print("== 1. Code completions (greedy, repetition penalty 1.2: the model is tiny) ==")
    greedy = SamplingParams(
        max_tokens=48, temperature=0.0, repetition_penalty=1.2, stop=["\n\n\n", "\nclass ", "\ndef "]
    )
    for out in llm.generate(COMPLETIONS, greedy, use_tqdm=False):
        print(f"--- {out.prompt.splitlines()[0]}")
        print(out.prompt + out.outputs[0].text)
        print()

    print("== 2. Shared prefix: the same module header, different stubs ==")
    prompts = [HEADER + s for s in STUBS]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    # All four arrive together: the first computes the header and leaves a checkpoint
    # where the prompts part; the other three start from it. Then the batch again.
    cold = llm.generate(prompts, params, use_tqdm=False)
    t = time.perf_counter()
    warm = llm.generate(prompts, params, use_tqdm=False)
    warm_s = time.perf_counter() - t
    rows = [
        [s, len(w.prompt_token_ids), c.num_cached_tokens, w.num_cached_tokens,
         "yes" if c.outputs[0].token_ids == w.outputs[0].token_ids else "NO"]
        for s, c, w in zip(STUBS, cold, warm)
    ]
    print(_table(rows, ["stub", "prompt tokens", "cached (1st run)", "cached (2nd run)", "same output"]))
    st = llm.stats()
    print(
        f"\nprefix-cache token hit rate so far: {st['prefix_hit_rate']:.0%}; "
        f"checkpoint pages live: {st['checkpoint_pages']}; warm batch took {warm_s:.2f} s\n"
    )

    drafters = [("n-gram", {"method": "ngram", "num_speculative_tokens": 4})]
    if args.model is None and args.speculative_config is None:
        drafters.append(("draft model", {"method": "draft_model", "model": "default-draft",
                                         "num_speculative_tokens": 4}))
    names = " and ".join(name for name, _ in drafters)
    print(f"== 3. Speculative decoding ({names}, 4 draft tokens) on the same batch ==")
    args.num_speculative_tokens = 0
    summary = []
    for name, config in drafters:
        args.speculative_config = config
        spec_llm = llm_from_args(args)
        spec = spec_llm.generate(prompts, params, use_tqdm=False)
        rows = [
            [s, out.metrics["spec_draft_tokens"], out.metrics["spec_accepted_tokens"],
             f"{out.metrics['spec_mean_accepted_length']:.2f}",
             "yes" if out.outputs[0].token_ids == ref.outputs[0].token_ids else "NO"]
            for s, out, ref in zip(STUBS, spec, warm)
        ]
        print(f"-- {name}")
        print(_table(rows, ["stub", "drafted", "accepted", "tokens/step", "same output"]))
        st = spec_llm.stats()
        rate = st["spec_accepted_tokens"] / st["spec_draft_tokens"] if st["spec_draft_tokens"] else 0.0
        summary.append(f"{name}: acceptance rate {rate:.0%}, mean tokens per verify step "
                       f"{st['spec_mean_accepted_length']:.2f}")
        del spec_llm
    print("\n" + "\n".join(summary))
    return 0
