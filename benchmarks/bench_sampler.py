"""Benchmark: the sampler's draw as the one-pass Triton kernel against its torch twin.

Measured in the same run, at batch 1 / 16 / 64 / 256 over a 131,072-token vocabulary
(the 8B shape's), each call replayed from a CUDA graph of its own (as the decode graphs
run it) with inputs rotated over several sets:

  draw         :func:`hybridserve.runner.sampler.draw` on processed log-probabilities,
               every row sampled: the twin (``kernels="reference"``: the ``[N, vocab]``
               int64 uniform table, float64 keys, argmax) against the kernel
               (:func:`hybridserve.kernels.sampling.draw`);
  sample_step  the whole :func:`~hybridserve.runner.sampler.sample_step` of raw logits
               at temperature 0.8 / top-p 0.95 (the decode benchmark's sampled setting:
               temperature, log-softmax, the top-p sort, the draw), twin against kernel;
  speculative  :func:`~hybridserve.runner.sampler.speculative_choices` over ``N`` draft
               positions with a drafter's distribution (acceptance and the residual
               draw), twin against kernel (:func:`hybridserve.kernels.sampling.residual_draw`);
  splits       the kernel at every power-of-two split count of the vocabulary (the
               default is :func:`hybridserve.kernels.sampling.num_splits`');
  floor        ``torch.argmax`` of the same log-probabilities (one read of them, the
               greedy draw) and a device-to-device copy of the bytes the kernel must
               read (``N x vocab`` float32), for the fraction of copy bandwidth.

Every case checks that kernel and twin chose the same tokens. Writes
``benchmarks/results/sampler.json``; ``--smoke`` runs tiny shapes (on the CPU through
Triton's interpreter when there is no GPU) and writes ``sampler_smoke.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, chosen before they exist.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import capture, median_us, rotating  # noqa: E402
from provenance import device_label, git_commit  # noqa: E402

from hybridserve.kernels import sampling  # noqa: E402
from hybridserve.runner import sampler  # noqa: E402
from hybridserve.step import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(vocab=131072, batches=(1, 16, 64, 256), temperature=0.8, top_p=0.95, variants=3)
SMOKE = dict(vocab=300, batches=(1, 4), temperature=0.8, top_p=0.95, variants=2)


def replayed_us(fn, sets, device: str) -> float:
    """Median microseconds of ``fn(*s)`` over the rotated input ``sets``: on CUDA each
    set's call captured in a graph of its own and the graphs replayed in turn."""
    if device == "cuda":
        graphs = [capture(functools.partial(fn, *s)) for s in sets]
        nxt = rotating(graphs)
        return median_us(lambda: nxt().replay(), device)
    nxt = rotating(sets)
    return median_us(lambda: fn(*nxt()), device)


def copy_us(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return median_us(lambda: dst.copy_(src), device)


def step_inputs(g, rows: int, s: dict, device: str):
    """A step of ``rows`` sampled rows at the configured temperature / top-p: raw logits,
    the plan and its buffer on the device, and the draw's inputs (processed ``logp``,
    greedy flags, seed words, indices)."""
    params = SamplingParams(temperature=s["temperature"], top_p=s["top_p"])
    seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
    index = torch.randint(0, 4096, (rows,), generator=g).tolist()
    plan = sampler.plan_draw(
        [sampler.SampleRow(params, seed, i, [], [], []) for seed, i in zip(seeds, index)],
        s["vocab"])
    packed = plan.packed.to(device)
    # Logits spread like a language model's: a few likely tokens, a long tail.
    logits = (torch.randn(rows, s["vocab"], generator=g) * 2.5).to(device)
    logp = sampler.process_step(logits, plan, packed)
    cols = packed[: rows * len(sampler._COLS)].view(rows, len(sampler._COLS))
    c = sampler._C
    draw_args = (logp, cols[:, c["temperature"]] == 0, cols[:, c["seed_lo"]].long(),
                 cols[:, c["seed_hi"]].long(), cols[:, c["index"]].long())
    logq = torch.log_softmax(torch.randn(rows, s["vocab"], generator=g) * 2.5, -1).to(device)
    drafts = torch.randint(0, s["vocab"], (rows,), generator=g).to(device)
    spec_args = (logp, logq, drafts, *draw_args[2:])
    return logits, plan, packed, draw_args, spec_args


def bench_batch(rows: int, s: dict, device: str, g) -> dict:
    sets = [step_inputs(g, rows, s, device) for _ in range(s["variants"])]
    draws = [d for *_, d, _ in sets]
    specs = [sp for *_, sp in sets]
    steps = [(logits, plan, packed) for logits, plan, packed, *_ in sets]

    def twin_draw(*a):
        return sampler.draw(*a, kernels="reference")

    def twin_step(logits, plan, packed):
        return sampler.sample_step(logits, plan, packed, kernels="reference")

    def kernel_step(logits, plan, packed):
        return sampler.sample_step(logits, plan, packed, kernels="triton")

    def twin_spec(*a):
        return sampler.speculative_choices(*a, kernels="reference")

    def kernel_spec(*a):
        return sampler.speculative_choices(*a, kernels="triton")

    same_spec = all(torch.equal(kernel_spec(*a), twin_spec(*a)) for a in specs)
    same_draw = all(torch.equal(sampling.draw(*d), twin_draw(*d)) for d in draws)
    same_step = all(torch.equal(kernel_step(*t), twin_step(*t)) for t in steps)
    nbytes = rows * s["vocab"] * 4  # the float32 log-probabilities, read once
    out = dict(
        rows=rows, splits=sampling.num_splits(rows, s["vocab"]),
        draw_twin_us=replayed_us(twin_draw, draws, device),
        draw_kernel_us=replayed_us(sampling.draw, draws, device),
        sample_step_twin_us=replayed_us(twin_step, steps, device),
        sample_step_kernel_us=replayed_us(kernel_step, steps, device),
        speculative_twin_us=replayed_us(twin_spec, specs, device),
        speculative_kernel_us=replayed_us(kernel_spec, specs, device),
        argmax_us=replayed_us(lambda logp, *_: torch.argmax(logp, dim=-1), draws, device),
        kernel_bytes=nbytes,
        # A copy of b bytes reads b and writes b; the kernel only reads, so the copy of
        # half its bytes moves as much.
        copy_us_same_traffic=copy_us(nbytes // 2, device),
        same_tokens_draw=same_draw, same_tokens_sample_step=same_step,
        same_tokens_speculative=same_spec,
    )
    # The kernel at every power-of-two split count (the default is num_splits'), to check
    # the split heuristic; the same tokens at each.
    blocks = -(-s["vocab"] // sampling.BLOCK)
    by_splits = {}
    for splits in (2**i for i in range(blocks.bit_length())):
        if splits > blocks:
            break
        fn = functools.partial(sampling.draw, splits=splits)
        out["same_tokens_draw"] &= torch.equal(fn(*draws[0]), twin_draw(*draws[0]))
        by_splits[splits] = replayed_us(fn, draws, device)
    out["draw_kernel_us_by_splits"] = by_splits
    out["draw_speedup"] = out["draw_twin_us"] / out["draw_kernel_us"]
    out["sample_step_saved_us"] = out["sample_step_twin_us"] - out["sample_step_kernel_us"]
    out["kernel_fraction_of_copy"] = out["copy_us_same_traffic"] / out["draw_kernel_us"]
    print(f"batch {rows:4d}: draw twin {out['draw_twin_us']:9.1f} us  kernel "
          f"{out['draw_kernel_us']:8.1f} us ({out['draw_speedup']:5.1f}x, "
          f"{out['kernel_fraction_of_copy']:5.1%} of copy)  sample_step twin "
          f"{out['sample_step_twin_us']:9.1f}  kernel {out['sample_step_kernel_us']:9.1f} us  "
          f"speculative twin {out['speculative_twin_us']:9.1f}  kernel "
          f"{out['speculative_kernel_us']:8.1f} us  argmax {out['argmax_us']:7.1f} us  "
          f"same tokens {out['same_tokens_draw'] and same_step and same_spec}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; a separate file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE if args.smoke or device != "cuda" else FULL
    g = torch.Generator().manual_seed(args.seed)
    result = dict(
        device=device_label(device), torch=torch.__version__, triton=triton.__version__,
        commit=git_commit(), smoke=shapes is SMOKE, config=dict(shapes),
        timing=("each call replayed from a CUDA graph, do_bench median" if device == "cuda"
                else "one eager call on the CPU interpreter (not a speed)"),
        results=[bench_batch(rows, shapes, device, g) for rows in shapes["batches"]],
    )
    name = "sampler_smoke.json" if shapes is SMOKE else "sampler.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
