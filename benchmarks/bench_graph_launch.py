"""Does a CUDA graph's launch sit on the critical path, and does launching it in pieces help?

The cached-prefix first token is one captured short-row step: on an H200 at 8B shapes
its graph's ``cudaGraphLaunch`` takes 0.7-1.05 ms of host time (the profiles in
``gpu_bench*.json``), next to 7.2-7.6 ms of kernels. If the device waits for the whole
launch before its first kernel runs, capturing the step as ``K`` graphs launched back to
back lets the device start on the first while the host launches the rest.

This script measures that on a synthetic step with the 8B cached step's scale: ``layers``
layers of a bf16 matrix product (its own weight, ``[tokens, hidden] @ [hidden, width]``,
then back) and a few elementwise ops, captured whole and in ``K`` pieces (one memory
pool; each piece's output is the next one's input). Per configuration, medians over
``--reps`` calls of:

- ``wall_s``: host time from the first launch to the end of a synchronize;
- ``launch_s``: host time inside the launches (``replay`` calls) alone;
- ``device_s``: the device's time from an event recorded before the first launch to one
  after the last (so it counts device idling while launches are in flight);
- ``busy_s``: the pieces replayed back to back (100 calls, one synchronize), per call:
  the device's own time with no launch exposed.

Writes ``--out`` (JSON, default ``benchmarks/results/graph_launch.json``) with the
device, versions, commit and configuration. ``--smoke`` runs a tiny configuration on
the CPU to check the script (no graphs there: the calls run eagerly). Usage:
``python benchmarks/bench_graph_launch.py [--layers 52 --ops 12 --pieces 1,2,4,8]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent


def build_layers(layers: int, hidden: int, width: int, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(layers):
        up = (torch.randn(hidden, width, generator=g) / hidden**0.5).to(device, dtype)
        down = (torch.randn(width, hidden, generator=g) / width**0.5).to(device, dtype)
        out.append((up, down))
    return out


def layer_step(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ops: int) -> torch.Tensor:
    """One synthetic layer: two products and ``ops`` elementwise kernels (a norm's,
    an activation's and a residual's worth), about the launch count of a real layer."""
    y = x @ up
    for _ in range(max(ops - 4, 0) // 2):
        y = y * 0.5
        y = torch.relu(y)
    y = torch.square(y)
    return x + (y @ down) * 0.01


def run(pieces: int, weights, x0: torch.Tensor, ops: int, reps: int, device) -> dict:
    on_gpu = device.type == "cuda"
    bounds = [round(i * len(weights) / pieces) for i in range(pieces + 1)]
    static_in = x0.clone()
    fns = []

    def piece(a, b):
        def fn(x):
            for up, down in weights[a:b]:
                x = layer_step(x, up, down, ops)
            return x
        return fn

    graphs, outs = [], []
    if on_gpu:
        pool = torch.cuda.graph_pool_handle()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x = static_in
            for i in range(pieces):  # warm-up outside capture
                x = piece(bounds[i], bounds[i + 1])(x)
        torch.cuda.current_stream().wait_stream(s)
        x = static_in
        for i in range(pieces):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                x = piece(bounds[i], bounds[i + 1])(x)
            graphs.append(g)
            outs.append(x)
        torch.cuda.synchronize()
        fns = [g.replay for g in graphs]
    else:
        def eager():
            x = static_in
            for i in range(pieces):
                x = piece(bounds[i], bounds[i + 1])(x)
            outs[:] = [x]
        fns = [eager]
    walls, launches, devs = [], [], []
    for _ in range(reps + 2):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
        t0 = time.perf_counter()
        launch = 0.0
        for fn in fns:
            t = time.perf_counter()
            fn()
            launch += time.perf_counter() - t
        if on_gpu:
            end.record()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        walls.append(wall)
        launches.append(launch)
        devs.append(start.elapsed_time(end) / 1e3 if on_gpu else wall)
    n = 100 if on_gpu else 2
    if on_gpu:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        for fn in fns:
            fn()
    if on_gpu:
        torch.cuda.synchronize()
    busy = (time.perf_counter() - t) / n
    med = statistics.median
    return {"pieces": pieces, "wall_s": med(walls[2:]), "launch_s": med(launches[2:]),
            "device_s": med(devs[2:]), "busy_s": busy,
            "wall_range_s": [min(walls[2:]), max(walls[2:])],
            "output_sum": float(outs[-1].float().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=52)
    ap.add_argument("--ops", type=int, default=12, help="kernels a layer launches")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--pieces", default="1,2,4,8,13")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/graph_launch.json")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.width, args.tokens, args.reps = 4, 64, 128, 8, 2
        args.pieces = "1,2"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = build_layers(args.layers, args.hidden, args.width, device, dtype)
    x0 = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    rows = [run(int(k), weights, x0, args.ops, args.reps, device) for k in args.pieces.split(",")]
    sums = {round(r["output_sum"], 3) for r in rows}
    if len(sums) != 1:
        raise RuntimeError(f"the pieces' outputs differ from the whole graph's: {sums}")
    whole = rows[0]
    for r in rows:
        r["wall_over_whole"] = r["wall_s"] / whole["wall_s"]
        r["exposed_s"] = r["wall_s"] - r["busy_s"]
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
           or platform.machine(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "commit": git_commit()}
    result = {"benchmark": "graph_launch", "env": env,
              "config": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items()},
              "kernels_per_graph_whole": args.layers * args.ops, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"pieces {r['pieces']:>2}: wall {1e3 * r['wall_s']:.3f} ms, launches "
              f"{1e3 * r['launch_s']:.3f}, device {1e3 * r['device_s']:.3f}, busy "
              f"{1e3 * r['busy_s']:.3f} (exposed {1e3 * r['exposed_s']:.3f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
