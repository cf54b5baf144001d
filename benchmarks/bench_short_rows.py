"""Benchmark: Mamba2's short-row recurrence, walked token by token against in chunks.

The step a cached prompt's tail takes (:func:`hybridserve.kernels.mamba_decode.ssm_update`
over rows of any length) at one Nemotron-H-8B Mamba layer's shape (128 heads x 64 x
state 128, 8 groups): a tail of ``--tail`` tokens from a stored state beside two decode
rows, states asked for on the engine's 64-token grid and at each row's end. Measured in
the same run, each with its relative error against a float64 twin:

  tokens    the token walk (``KernelPolicy.token_prefetch`` "off");
  prefetch  the token walk loading each token's operands one token ahead (the default);
  chunks    :mod:`hybridserve.kernels.ssm_chunks` for every chunk size, products
            (IEEE float32 FMA, "tf32x3"), head-dim rows a program and warp count of the
            sweep (``KernelPolicy.short_row_chunks``).

Times are ``triton.testing.do_bench`` medians. Writes
``benchmarks/results/short_rows.json``; ``--smoke`` runs tiny shapes (on the CPU through
Triton's interpreter when there is no GPU) and writes ``short_rows_smoke.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, chosen before they exist.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from graph_timing import median_us  # noqa: E402
from provenance import device_label, git_commit, result_writer  # noqa: E402

from hybridserve.kernels import mamba_decode, ssm_chunks  # noqa: E402

SHAPE_8B = dict(heads=128, head_dim=64, groups=8, d_state=128)
SHAPE_SMOKE = dict(heads=4, head_dim=16, groups=2, d_state=16)


def step(shape, tail, interval, device, seed):
    """Operands of one short step: the tail (from a page) and two decode rows."""
    g = torch.Generator().manual_seed(seed)
    lens = [tail, 1, 1]
    qs = [0, tail, tail + 1, tail + 2]
    t = qs[-1]
    h, p, gr, n = shape["heads"], shape["head_dim"], shape["groups"], shape["d_state"]
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).float()  # noqa: E731
    x, B, C = bf(t, h, p), bf(t, gr, n), bf(t, gr, n)
    dt = torch.randn(t, h, generator=g) * 0.5 - 2.0
    dt_bias = torch.randn(h, generator=g) * 0.3
    A = -torch.rand(h, generator=g) * 8 - 1
    D = torch.randn(h, generator=g)
    outs, page = [], len(lens)
    for q in lens:
        for i in range(q):
            asked = (i + 1) % interval == 0 or i == q - 1
            outs.append(page if asked else -1)
            page += asked
    cache = torch.randn(page, h, p, n, generator=g) * 0.1
    as_int = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ops = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, ssm_cache=cache, in_pages=as_int([0, 1, 2]),
               out_pages=as_int(outs), query_start=as_int(qs), dt_bias=dt_bias)
    return {k: v.to(device) for k, v in ops.items()}


def run(ops, walk, device):
    o = dict(ops, ssm_cache=ops["ssm_cache"].clone())
    if "dots" in walk:
        # Only the chunk launch takes the sweep's forms.
        y = torch.empty_like(o["x"])
        fn = lambda: ssm_chunks.launch(  # noqa: E731
            o["x"], o["dt"], o["dt_bias"], *mamba_decode.NO_CLAMP_LIMIT, None, o["A"],
            o["B"], o["C"], o["D"], o["ssm_cache"], o["query_start"], o["in_pages"],
            o["out_pages"], y, o["B"].shape[1], o["B"].shape[2], False, walk["chunk"],
            walk["dots"], walk["block_p"], walk["num_warps"])
    else:
        fn = lambda: mamba_decode.ssm_update(  # noqa: E731
            o["x"], o["dt"], o["A"], o["B"], o["C"], o["D"], o["ssm_cache"], o["in_pages"],
            o["out_pages"], o["query_start"], dt_bias=o["dt_bias"], time_step_limit=None,
            **walk)
    y = fn()
    cache = o["ssm_cache"].clone()
    return y, cache, median_us(fn, device)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes")
    ap.add_argument("--tail", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    started = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPE_SMOKE if args.smoke else SHAPE_8B
    tails = [40] if args.smoke else args.tail
    chunks = [16] if args.smoke else [16, 32]
    dots = ["ieee"] if args.smoke else ["ieee", "tf32x3"]
    forms = [(16, 4)] if args.smoke else [(16, 4), (16, 2), (32, 4), (64, 4)]
    out = args.out or ROOT / "benchmarks/results" / (
        "short_rows_smoke.json" if args.smoke else "short_rows.json")
    result = {"benchmark": "bench_short_rows", "commit": git_commit(), "torch": torch.__version__,
              "device": device_label(device), "smoke": args.smoke, "config": {"shape": shape, "tails": tails,
                                                         "interval": 64}, "rows": []}
    write = result_writer(result, out, started)
    for tail in tails:
        ops = step(shape, tail, 64, device, seed=tail)
        ref_cache = ops["ssm_cache"].double()
        ref = mamba_decode.ssm_update_reference(
            *(ops[k].double() for k in ("x", "dt", "A", "B", "C", "D")), ref_cache,
            ops["in_pages"], ops["out_pages"], ops["query_start"],
            dt_bias=ops["dt_bias"].double(), time_step_limit=None)
        written = ops["out_pages"][ops["out_pages"] >= 0].long()
        walks = [("tokens", dict(prefetch=False)), ("prefetch", dict(prefetch=True))]
        walks += [(f"chunks{c}_{d}_p{bp}_w{nw}",
                   dict(chunk=c, dots=d, block_p=bp, num_warps=nw))
                  for c in chunks for d in dots for bp, nw in forms]
        for name, walk in walks:
            try:
                y, cache, us = run(ops, walk, device)
            except Exception as e:  # a form the compiler rejects is recorded, not fatal
                result["rows"].append({"tail": tail, "walk": name, "error": repr(e)[:300]})
                continue
            rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
            row = {"tail": tail, "walk": name, **{k: v for k, v in walk.items()}, "us": us,
                   "y_rel_err_vs_float64": rel(y, ref),
                   "states_rel_err_vs_float64": rel(cache[written], ref_cache[written])}
            result["rows"].append(row)
            print(f"tail {tail:5d} {name:28s} {us:9.1f} us  y {row['y_rel_err_vs_float64']:.2e}"
                  f"  states {row['states_rel_err_vs_float64']:.2e}", flush=True)
        write()
    write()
    return result


if __name__ == "__main__":
    main()
