"""Constrained sampling's overhead per engine step: the embedded model decoding a batch
in which a fraction of the requests is constrained by a JSON schema.

For each batch size and constrained fraction (0, a half, all), every request decodes
greedily for ``--tokens`` tokens (free requests ignore EOS; constrained ones follow a
schema with long bounded strings, so they rarely finish early). The script reports
the median ``EngineCore.step`` time over the steps after the warm-up, the median host
time the step spends filling the grammar bitmasks (``sampler.plan_draw``, which calls
every constrained row's matcher), and the tokens per second. A step with a constrained
row runs eagerly and through the batched sampler (no decode graph, no argmax fast
path), so on CUDA the difference to the fraction-0 row includes the graphs it loses.

Usage: ``python benchmarks/bench_structured.py [--device cuda] [--batches 8,32]
[--out benchmarks/results/structured_<device>.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from provenance import ROOT, git_commit

from hybridserve import LLM, SamplingParams, StructuredOutputsParams
from hybridserve.runner import sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 200, "maxLength": 400},
        "size": {"type": "integer"},
    },
    "required": ["name", "size"],
    "additionalProperties": False,
}


def timed(owner, name: str, sink: list[float]):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)
    return real


def run(llm: LLM, batch: int, fraction: float, tokens: int, warmup: int) -> dict:
    constrained = round(batch * fraction)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(max_tokens=tokens, temperature=0.0, structured_outputs=so) if i < constrained
        else SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch)
    ]
    prompts = [f"def item_{i}():\n    return " for i in range(batch)]
    engine = llm.engine
    steps: list[float] = []
    masks: list[float] = []
    real_step = timed(engine, "step", steps)
    real_plan = timed(sampler, "plan_draw", masks)
    try:
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        engine.step = real_step
        sampler.plan_draw = real_plan
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    body = steps[warmup:] or steps
    return {
        "batch": batch, "constrained": constrained, "steps": len(steps),
        "step_ms_median": round(statistics.median(body) * 1e3, 3),
        "plan_step_ms_median": round(statistics.median(masks) * 1e3, 3) if masks else 0.0,
        "plan_step_calls": len(masks),
        "tokens_per_s": round(generated / wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    llm = LLM(device=args.device, max_num_seqs=max(int(b) for b in args.batches.split(",")), max_model_len=1024)
    # Compile once outside the timed runs (a cached grammar is what steady state sees).
    llm.engine.grammar_backend().compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for fraction in (0.0, 0.5, 1.0):
            row = run(llm, b, fraction, args.tokens, args.warmup)
            rows.append(row)
            print(json.dumps(row))
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else (platform.processor() or platform.machine())
    # The host's load average: on a shared machine the step times move with it.
    result = {"commit": git_commit(), "device": device, "torch": torch.__version__, "schema": SCHEMA,
              "tokens": args.tokens, "load_average_1m": round(os.getloadavg()[0], 2),
              "cpu_count": os.cpu_count(), "rows": rows}
    out = Path(args.out or ROOT / f"benchmarks/results/structured_{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
