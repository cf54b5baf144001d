"""Benchmark: one mixture-of-experts layer, the grouped Triton path against a torch loop.

Shapes (random weights, bf16 on CUDA), one MoE layer each:

  nemotron-3-nano   Nemotron 3 Nano 30B-A3B: hidden 2688, 128 routed experts of width 1856
                    (plain relu2), top-6 sigmoid routing with routed_scaling_factor 2.5,
                    one shared expert of width 3712
  granite-4.0-h-small  Granite 4.0-H Small: hidden 4096, 72 routed experts of width 768
                    (gated silu), top-10, plus the layer's dense shared_mlp of width 1536

(the published config.json values; ``--shapes`` picks a subset). For 1 / 16 / 64 / 256 /
2048 tokens (``--tokens``), all measured in the same run (benchmarks/results/INDEX.md
says how):

  grouped        the routed experts, ``moe_experts`` (sort by expert + two launches)
  loop           the same routing through ``moe_experts_loop`` (one expert at a time, a host
                 sync per step): the shape of the Hugging Face reference
  block          the whole MoEBlock forward (router + routed + shared), eager
  block_graph    the same replayed from a CUDA graph (the decode path); None if capture fails
  compare        per ``--compare`` variant (default ``old new``): the routed experts alone
                 and the whole block from a CUDA graph with that variant's routed path,
                 so one run shows the first version (torch sort, one tile threshold,
                 torch sum) against the current one; explicit tiles
                 ``block_m,n,k,warps,stages[,n_down]`` try other tiles in the same run
  copy           device-to-device copy bandwidth; the routed experts' time is compared with
                 the bytes of the experts the step touches (plus activations) at that rate
  matmul         one bf16 matrix product's FLOP rate; compared with the routed FLOPs

Inputs rotate over ``--variants`` random token sets (different experts each time) so
the L2 cache does not hold a step's experts from the previous one. A correctness check
per size compares grouped and loop outputs (relative error).

``--load``: also writes a random checkpoint of ``--load-layers`` MoE layers of the first
shape in the published per-expert naming, one shard per layer, and times ``load_model``
onto the device (its logged GB/s; the files were just written, so the page cache is
likely warm: a lower bound on a cold disk's time).

Writes benchmarks/results/moe.json; ``--smoke`` runs tiny shapes on the CPU (Triton's
interpreter when there is no GPU) and writes moe_smoke.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from graph_timing import capture, median_us, rotating  # noqa: E402
from provenance import git_commit  # noqa: E402

from hybridserve.kernels import moe  # noqa: E402
from hybridserve.models.config import (  # noqa: E402
    SIGMOID_GROUPED,
    TOPK_THEN_SOFTMAX,
    MoEParams,
)
from hybridserve.models.layers.mlp import FusedGatedMLP  # noqa: E402
from hybridserve.models.layers.moe import MoEBlock  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    params: MoEParams
    dense_beside: int = 0  # Granite's shared_mlp width (a dense MLP beside the block)


SHAPES = {
    "nemotron-3-nano": Shape(
        "nemotron-3-nano", 2688,
        MoEParams(SIGMOID_GROUPED, 128, 6, 1856, gated=False, activation="relu2",
                  norm_topk_prob=True, routed_scaling_factor=2.5,
                  shared_intermediate_size=3712),
    ),
    "granite-4.0-h-small": Shape(
        "granite-4.0-h-small", 4096,
        MoEParams(TOPK_THEN_SOFTMAX, 72, 10, 768, gated=True, activation="silu",
                  norm_topk_prob=False),
        dense_beside=1536,  # shared_intermediate_size in the published config.json
    ),
}


def smoke_shape(s: Shape) -> Shape:
    p = replace(s.params, num_experts=8, top_k=min(s.params.top_k, 3), intermediate_size=32,
                shared_intermediate_size=48 if s.params.shared_intermediate_size else 0)
    return replace(s, hidden=64, params=p, dense_beside=48 if s.dense_beside else 0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Median seconds of ``fn``: do_bench on CUDA, else the wall clock of one call."""
    return median_us(fn, device, warmup_ms=5, rep_ms=50) / 1e6


def in_turn(fns):
    """One callable that runs ``fns`` in turn (a different input set on each call)."""
    nxt = rotating(fns)
    return lambda: nxt()()


def copy_bandwidth(device: str, nbytes: int) -> dict:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device)
    return {"bytes_per_copy": nbytes, "median_s": t, "bytes_per_s": 2 * nbytes / t}


def matmul_rate(device: str, dtype: torch.dtype, n: int) -> dict:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = timed(lambda: a @ b, device)
    return {"n": n, "dtype": str(dtype), "median_s": t, "flops_per_s": 2 * n**3 / t}


def build_block(shape: Shape, device: str, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    with torch.device(device):
        block = MoEBlock(shape.hidden, shape.params).to(dtype)
        dense = None
        if shape.dense_beside:
            from hybridserve.models.config import MLPParams

            dense = FusedGatedMLP(
                shape.hidden, MLPParams("gated_fused", shape.dense_beside, "silu", False)
            ).to(dtype)
    with torch.no_grad():
        for m in (block, dense):
            if m is None:
                continue
            for _, t in [*m.named_parameters(), *m.named_buffers()]:
                fan_in = t.shape[-1] if t.dim() > 1 else 1
                t.copy_(torch.randn(t.shape, device=device) * (fan_in**-0.5 if t.dim() > 1
                                                             else 0.01))
    block.requires_grad_(False)
    if dense is not None:
        dense.requires_grad_(False)
    return block, dense


def old_routed(x, w1, w2, ids, weights, add, *, gated, activation):
    """The routed experts as the first version ran them: the torch sort, one threshold on
    the assignment count for the tiles, a torch sum and cast, the shared output added in
    the activation dtype afterwards (what ``--compare old`` times)."""
    t, top_k = ids.shape
    tiles = moe.legacy_tiles(t * top_k, x)
    blocks = moe.sort_by_expert_reference(ids, w1.shape[0], tiles.block_m)
    h = moe.grouped_up(x, w1, blocks, top_k, gated=gated, activation=activation, tiles=tiles)
    out = moe.grouped_down(h, w2, blocks, weights, tiles=tiles)
    y = out.view(t, top_k, out.shape[1]).sum(dim=1).to(x.dtype)
    return y if add is None else y + add


def variant_routed(variant: str, kw: dict):
    """``(x, w1, w2, ids, weights, add) -> y`` of one ``--compare`` entry: ``old``,
    ``new`` (the default tiles of :func:`moe.default_tiles`) or explicit tiles
    ``block_m,n,k,warps,stages[,n_down]``."""
    if variant == "old":
        return lambda *a: old_routed(*a, **kw)
    tiles = None if variant == "new" else moe.Tiles.parse(variant)
    return lambda x, w1, w2, ids, wt, add: moe.moe_experts(
        x, w1, w2, ids, wt, tiles=tiles, add=add, **kw)


def layer_case(shape: Shape, block, dense, tokens: int, variants: int, device: str,
               dtype: torch.dtype, copy_bps: float, flops_ps: float,
               compare: list[str]) -> dict:
    p = shape.params
    g = torch.Generator(device=device).manual_seed(tokens)
    xs = [torch.randn(tokens, shape.hidden, device=device, generator=g).to(dtype)
          for _ in range(variants)]
    router = getattr(block, "router", None) or block.gate
    shared = getattr(block, block._shared) if block._shared is not None else None
    with torch.no_grad():
        routes = [router(x) for x in xs]
        x_exp = [block.fc1_latent_proj(x) if block.latent else x for x in xs]
    w1, w2 = block.experts.w1, block.experts.down_proj
    kw = dict(gated=p.gated, activation=p.activation)

    new_routed = variant_routed("new", kw)

    def grouped(i, routed=new_routed):
        return lambda: routed(x_exp[i], w1, w2, *routes[i], None)

    def loop(i):
        return lambda: moe.moe_experts_loop(
            x_exp[i], w1, w2, *routes[i], gated=p.gated, act=block.experts.act,
            accumulate_dtype=torch.float32)

    def whole(i):
        def run():
            return block(xs[i], add=dense(xs[i]) if dense is not None else None)
        return run

    def whole_variant(routed):
        """The block's forward with the routed experts of one variant (no latent
        projection in the benchmarked shapes; the shared output goes in as ``add``)."""
        def make(i):
            def run():
                x = xs[i]
                ids, wt = router(x)
                add = shared(x) if shared is not None else None
                if dense is not None:
                    add = dense(x) if add is None else add + dense(x)
                return routed(x, w1, w2, ids, wt, add)
            return run
        return make

    out: dict = {"tokens": tokens}
    with torch.no_grad():
        a = grouped(0)().float()
        b = loop(0)().float()
        out["grouped_vs_loop_rel_err"] = float((a - b).norm() / b.norm().clamp_min(1e-30))
        out["grouped_s"] = timed(in_turn([grouped(i) for i in range(variants)]), device)
        out["loop_s"] = timed(in_turn([loop(i) for i in range(variants)]), device)
        out["block_s"] = timed(in_turn([whole(i) for i in range(variants)]), device)
        out["block_graph_s"], out["graph_error"] = graph_time(whole, xs, variants, device)
        rows = {}
        ref = whole(0)().float()
        for name in compare:
            routed = variant_routed(name, kw)
            make = whole_variant(routed)
            got = make(0)().float()
            rows[name] = {
                "block_vs_module_rel_err": float((got - ref).norm()
                                                 / ref.norm().clamp_min(1e-30)),
                "grouped_s": timed(in_turn([grouped(i, routed) for i in range(variants)]),
                                   device),
            }
            rows[name]["block_graph_s"], rows[name]["graph_error"] = graph_time(
                make, xs, variants, device)
        out["compare"] = rows
    touched = [int(r[0].unique().numel()) for r in routes]
    expert_bytes = w1[0].nbytes + w2[0].nbytes
    moved = statistics.mean(touched) * expert_bytes + 2 * xs[0].nbytes
    flops = 2 * tokens * p.top_k * (w1.shape[1] * w1.shape[2] + w2.shape[1] * w2.shape[2])
    out.update(
        experts_touched_mean=statistics.mean(touched),
        bytes_touched=moved,
        routed_flops=flops,
        tiles=asdict(moe.default_tiles(tokens, p.top_k, w1.shape[0], w2.shape[2], w2.shape[1],
                                       xs[0], gated=p.gated)),
        grouped_fraction_of_copy_bandwidth=moved / out["grouped_s"] / copy_bps,
        grouped_fraction_of_matmul_rate=flops / out["grouped_s"] / flops_ps,
        loop_over_grouped=out["loop_s"] / out["grouped_s"],
    )
    return out


def graph_time(whole, xs, variants, device):
    """The whole block replayed from one CUDA graph per input set; (median s, error)."""
    if not device.startswith("cuda"):
        return None, "no CUDA"
    try:
        graphs = [capture(whole(i)) for i in range(variants)]
        return timed(in_turn([g.replay for g in graphs]), device), None
    except Exception as e:  # record and go on: the eager numbers still stand
        return None, f"{type(e).__name__}: {e}"


def load_case(shape: Shape, layers: int, device: str, dtype: torch.dtype) -> dict:
    """Write a random ``layers``-layer Nemotron-H MoE checkpoint (per-expert names, one
    shard per layer) and time ``load_model`` onto ``device``."""
    from safetensors.torch import save_file

    from hybridserve.models.loader import load_model

    p = shape.params
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        config = {
            "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "vocab_size": 1024, "hidden_size": shape.hidden,
            "hybrid_override_pattern": "E" * layers, "n_routed_experts": p.num_experts,
            "num_experts_per_tok": p.top_k, "moe_intermediate_size": p.intermediate_size,
            "moe_shared_expert_intermediate_size": p.shared_intermediate_size or 64,
            "routed_scaling_factor": p.routed_scaling_factor, "mlp_hidden_act": "relu2",
        }
        (path / "config.json").write_text(json.dumps(config))
        weight_map = {}
        write_t = time.perf_counter()
        for layer in range(layers):
            pre = f"backbone.layers.{layer}."
            t = {pre + "norm.weight": torch.ones(shape.hidden, dtype=dtype),
                 pre + "mixer.gate.weight": torch.randn(p.num_experts, shape.hidden).to(dtype),
                 pre + "mixer.gate.e_score_correction_bias": torch.randn(p.num_experts) * 0.01}
            for j in range(p.num_experts):
                t[pre + f"mixer.experts.{j}.up_proj.weight"] = torch.randn(
                    p.intermediate_size, shape.hidden).to(dtype)
                t[pre + f"mixer.experts.{j}.down_proj.weight"] = torch.randn(
                    shape.hidden, p.intermediate_size).to(dtype)
            si = p.shared_intermediate_size or 64
            t[pre + "mixer.shared_experts.up_proj.weight"] = torch.randn(si, shape.hidden).to(dtype)
            t[pre + "mixer.shared_experts.down_proj.weight"] = torch.randn(shape.hidden, si).to(dtype)
            if layer == layers - 1:
                t["backbone.embeddings.weight"] = torch.randn(1024, shape.hidden).to(dtype)
                t["backbone.norm_f.weight"] = torch.ones(shape.hidden, dtype=dtype)
                t["lm_head.weight"] = torch.randn(1024, shape.hidden).to(dtype)
            shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
            save_file(t, str(path / shard))
            weight_map.update(dict.fromkeys(t, shard))
            del t
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        write_s = time.perf_counter() - write_t
        model = load_model(path, dtype=dtype, device=device)
        stats = model.load_stats
        stacked = model.model.layers[0].mixer.experts.up_proj.shape
        del model
    return {"layers": layers, "shards": stats.files, "bytes": stats.bytes_read,
            "load_s": stats.seconds, "gb_per_s": stats.gb_per_s, "write_s": write_s,
            "stacked_up_proj_shape": list(stacked),
            "note": "files just written: the page cache is likely warm"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--variants", type=int, default=None)
    ap.add_argument("--compare", nargs="+", default=["old", "new"],
                    help="routed-expert variants timed side by side (routed alone and the "
                         "whole block from a CUDA graph): 'old' (the first version: torch "
                         "sort, one tile threshold, torch sum), 'new' (the default path), "
                         "or explicit tiles 'block_m,n,k,warps,stages[,n_down]'")
    ap.add_argument("--load", action="store_true", help="also time load_model")
    ap.add_argument("--load-layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for v in args.compare:
        if v not in ("old", "new"):
            moe.Tiles.parse(v)  # a clear error before anything runs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device == "cpu":
        print("bench_moe needs a GPU (use --smoke on the CPU)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = args.tokens or ([1, 4] if args.smoke else [1, 16, 64, 256, 2048])
    variants = args.variants or (2 if args.smoke else 8)
    out_path = args.out or RESULTS / ("moe_smoke.json" if args.smoke else "moe.json")
    copy = copy_bandwidth(device, 2**20 if args.smoke else 2**30)
    mm = matmul_rate(device, dtype, 64 if args.smoke else 8192)
    result = {
        "env": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__,
                "commit": git_commit(), "interpreter": bool(triton.knobs.runtime.interpret)},
        "config": {"smoke": args.smoke, "dtype": str(dtype), "tokens": tokens,
                   "variants": variants, "compare": args.compare},
        "copy_bandwidth": copy, "matmul": mm, "shapes": {}, "errors": {},
    }
    for name in args.shapes:
        shape = smoke_shape(SHAPES[name]) if args.smoke else SHAPES[name]
        block, dense = build_block(shape, device, dtype, seed=0)
        cases = []
        for t in tokens:
            try:
                cases.append(layer_case(shape, block, dense, t, variants, device, dtype,
                                        copy["bytes_per_s"], mm["flops_per_s"],
                                        args.compare))
            except Exception as e:  # record it, measure the rest
                result["errors"][f"{name}/{t}"] = f"{type(e).__name__}: {e}"
            sync(device)
        p = asdict(shape.params)
        result["shapes"][name] = {"hidden": shape.hidden, "moe": p,
                                  "dense_beside": shape.dense_beside, "cases": cases}
        del block, dense
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.load:
        shape = smoke_shape(SHAPES[args.shapes[0]]) if args.smoke else SHAPES[args.shapes[0]]
        try:
            result["load"] = load_case(shape, args.load_layers, device, dtype)
        except Exception as e:
            result["errors"]["load"] = f"{type(e).__name__}: {e}"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"copy {copy['bytes_per_s'] / 1e12:.2f} TB/s, matmul {mm['flops_per_s'] / 1e12:.1f} "
          f"TFLOP/s ({result['env']['device']})")
    print(f"{'shape':<22}{'tokens':>7}{'grouped us':>12}{'loop us':>11}{'block us':>10}"
          f"{'graph us':>10}{'%copy':>7}{'%mm':>6}{'err':>9}")
    for name, s in result["shapes"].items():
        for c in s["cases"]:
            graph = f"{c['block_graph_s'] * 1e6:10.1f}" if c["block_graph_s"] else f"{'-':>10}"
            print(f"{name:<22}{c['tokens']:>7}{c['grouped_s'] * 1e6:12.1f}"
                  f"{c['loop_s'] * 1e6:11.1f}{c['block_s'] * 1e6:10.1f}{graph}"
                  f"{100 * c['grouped_fraction_of_copy_bandwidth']:7.1f}"
                  f"{100 * c['grouped_fraction_of_matmul_rate']:6.1f}"
                  f"{c['grouped_vs_loop_rel_err']:9.1e}")
    print(f"\n{'shape':<22}{'tokens':>7}  {'variant':<20}{'routed us':>11}{'graph us':>10}"
          f"{'err':>9}")
    for name, s in result["shapes"].items():
        for c in s["cases"]:
            for v, r in c["compare"].items():
                graph = (f"{r['block_graph_s'] * 1e6:10.1f}" if r["block_graph_s"]
                         else f"{'-':>10}")
                print(f"{name:<22}{c['tokens']:>7}  {v:<20}{r['grouped_s'] * 1e6:11.1f}{graph}"
                      f"{r['block_vs_module_rel_err']:9.1e}")
    if "load" in result:
        ld = result["load"]
        print(f"load: {ld['bytes'] / 1e9:.2f} GB in {ld['load_s']:.2f} s ({ld['gb_per_s']:.2f} "
              f"GB/s, {ld['shards']} shards)")
    for k, v in result["errors"].items():
        print(f"[error] {k}: {v}")
    print(f"wrote {out_path}")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
