"""Constrained sampling's overhead per engine step: the embedded model decoding a batch
in which a fraction of the requests is constrained by a JSON schema.

For each batch size and constrained fraction (0, a half, all), every request decodes
greedily for ``--tokens`` tokens (free requests ignore EOS; constrained ones follow a
schema with long bounded strings, so they rarely finish early). The script reports
the median ``EngineCore.step`` time over the steps after the warm-up, the tokens per
second, and the host phases of a step: the median time spent filling a replayed
step's static buffer (``graph_fill_ms_median``) and, for constrained steps, the
grammar bitmasks (``mask_fill_ms_median``: ``DecodeGraphs.fill_masks`` where a decode
graph replays the step, ``sampler.plan_draw`` where it runs eagerly), and how the steps
ran (``graph_steps``, ``masked_graph_steps``: decode steps with constrained rows
replayed from a graph, ``eager_steps``).

With decode graphs (the default on CUDA; ``--graphs on`` runs the same static-buffer
steps without capture on the CPU), a constrained decode step replays the forward's
graph, fills the masks on the host while the device runs it, then replays the draw's
graph. ``--masked-graphs off`` sends constrained steps to the eager path instead (what
the engine did before they replayed), for a comparison in one run.

Usage: ``python benchmarks/bench_structured.py [--device cuda] [--batches 8,32]
[--masked-graphs on|off] [--out benchmarks/results/structured_<device>.json]``;
``--smoke``: a tiny CPU run through the graph path (a check that it runs).
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
from hybridserve.runner.cuda_graph import DecodeGraphs

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
    graphs = engine.runner.graphs
    before = dict(graphs.counters) if graphs is not None else {}
    steps: list[float] = []
    plans: list[float] = []
    fills: list[float] = []
    metas: list[float] = []
    real_step = timed(engine, "step", steps)
    real_meta = timed(DecodeGraphs, "fill", metas)
    real_plan = timed(sampler, "plan_draw", plans)
    real_fill = timed(DecodeGraphs, "fill_masks", fills)
    try:
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        engine.step = real_step
        sampler.plan_draw = real_plan
        DecodeGraphs.fill_masks = real_fill
        DecodeGraphs.fill = real_meta
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    body = steps[warmup:] or steps
    # A constrained step fills its masks once, in one of the two places.
    masks = fills + plans if constrained else []
    counts = {k: v - before.get(k, 0) for k, v in graphs.counters.items()} if graphs is not None else {}
    return {
        "batch": batch, "constrained": constrained, "steps": len(steps),
        "step_ms_median": round(statistics.median(body) * 1e3, 3),
        "mask_fill_ms_median": round(statistics.median(masks) * 1e3, 3) if masks else 0.0,
        "mask_fill_calls": len(masks),
        "plan_draw_calls": len(plans),
        # The rest of a replayed step's host input work: its static buffer's rows.
        "graph_fill_ms_median": round(statistics.median(metas) * 1e3, 3) if metas else 0.0,
        "graph_steps": counts.get("graph_steps", 0),
        "masked_graph_steps": counts.get("masked_graph_steps", 0),
        "eager_steps": counts.get("eager_steps", len(steps)),
        "tokens_per_s": round(generated / wall, 1),
    }


def _no_masked_graphs(graphs: DecodeGraphs) -> None:
    """Send steps with masked rows to the eager path (the engine before masked graphs)."""
    real = graphs.shape_of

    def shape_of(sched):
        shape = real(sched)
        return None if shape is not None and shape.sampling.masked else shape

    graphs.shape_of = shape_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                    help="decode graphs: auto (on CUDA only), on (captured on CUDA, the same "
                         "static-buffer steps without capture elsewhere), off (every step eager)")
    ap.add_argument("--masked-graphs", choices=("on", "off"), default="on",
                    help="off: steps with constrained rows run eagerly (the comparison)")
    ap.add_argument("--fractions", default="0,0.5,1")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny CPU run through the graph path (a check that it runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.batches, args.tokens, args.warmup = "cpu", "4", 6, 1
        args.graphs = "on" if args.graphs == "auto" else args.graphs
    if args.device == "cpu":
        torch.set_num_threads(1)
    enforce_eager = {"auto": None, "on": False, "off": True}[args.graphs]
    llm = LLM(device=args.device, max_num_seqs=max(int(b) for b in args.batches.split(",")),
              max_model_len=1024, enforce_eager=enforce_eager)
    graphs = llm.engine.runner.graphs
    if graphs is not None and args.masked_graphs == "off":
        _no_masked_graphs(graphs)
    # Compile once outside the timed runs (a cached grammar is what steady state sees).
    llm.engine.grammar_backend().compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for fraction in (float(f) for f in args.fractions.split(",")):
            row = run(llm, b, fraction, args.tokens, args.warmup)
            rows.append(row)
            print(json.dumps(row))
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else (platform.processor() or platform.machine())
    # The host's load average: on a shared machine the step times move with it.
    result = {"commit": git_commit(), "device": device, "torch": torch.__version__, "schema": SCHEMA,
              "tokens": args.tokens, "graphs": graphs is not None, "captured": bool(graphs and graphs.capture),
              "masked_graphs": args.masked_graphs, "async_scheduling": llm.engine.async_scheduling,
              "capture_errors": list(graphs.capture_errors) if graphs is not None else [],
              "load_average_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(), "rows": rows}
    if args.smoke and args.out is None:
        return
    out = Path(args.out or ROOT / f"benchmarks/results/structured_{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
