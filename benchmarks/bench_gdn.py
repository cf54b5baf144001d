"""Benchmark: one Gated DeltaNet layer's state kernels at Qwen3.6-27B shapes.

Measured in the same run (benchmarks/results/INDEX.md says how):

  decode    ``gdn_decode_update`` (paged: read one state page per row, write the state
            after each of ``q`` tokens to its own page) at batch 1 / 16 / 64 / 256,
            ``q = 1`` (decode) and ``q = 4`` (verify of 3 drafts), against the bytes it
            must move and a device-to-device copy of the same bytes;
  prefill   the token-by-token ``gdn_varlen_update`` over 1 x 4,096 and 8 x 4,096 tokens
            (also with its operands loaded one token ahead, ``prefetch=True``)
            with a state every 64 tokens (checkpoints), and, where fla-core's pieces are
            importable (CUDA), fla-core's chunked scan alone (``chunk_scan_fla``, q, k, v
            in float32 and in bfloat16) and the chunked ``gdn_prefill`` on it, the
            engine's ``gdn_rows="fla"`` path (same outputs and states as the token kernel;
            per layer: the host plan of where the states come from is made once per step
            and timed apart);
  check     each kernel against its torch twin on fresh random inputs (relative error);
  numerics  the paged decode kernel's state after 1 and 256 decode steps against a float64
            twin, bf16-rounded inputs, float32 pages (``numerics``).

Shapes (Qwen3.6-27B's config.json): 16 key heads, 48 value heads, head dims 128, float32
state pages (3 MiB per sequence per layer). Inputs are rotated over several page sets so
no iteration reads what the previous one left in L2. Writes
``benchmarks/results/gdn_kernels.json``; ``--smoke`` runs tiny shapes (on the CPU through
Triton's interpreter when there is no GPU) and writes ``gdn_kernels_smoke.json``;
``--f32-dots ieee`` (or ``tf32x3``) compiles fla-core's float32 dots at that precision
(``--skip-decode --out ...`` for a run of that alone).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, chosen before they exist.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import median_us, rotating  # noqa: E402
from provenance import git_commit  # noqa: E402

from hybridserve.kernels import gdn_chunked  # noqa: E402
from hybridserve.kernels.gdn import l2_normalize  # noqa: E402
from hybridserve.kernels.gdn_decode import (  # noqa: E402
    gdn_decode_update,
    gdn_decode_update_reference,
)
from hybridserve.kernels.gdn_varlen import (  # noqa: E402
    VarlenPlan,
    gdn_varlen_update,
    gdn_varlen_update_reference,
)
from hybridserve.kernels.ssd_varlen import fla_version  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(hk=16, hv=48, dk=128, dv=128, batches=(1, 16, 64, 256), prefill=((1, 4096),
            (8, 4096)), interval=64, variants=4)
# The smoke prefill: two rows of 20 tokens, a state every 8 and one at each row's end,
# off that grid (mid-row states, an end state, two rows), in few tokens: the token
# kernel runs token by token, the interpreter's slowest launch in this run.
SMOKE = dict(hk=2, hv=4, dk=8, dv=8, batches=(1, 4), prefill=((2, 20),), interval=8,
             variants=2)


def inputs(g, tokens, s, device):
    """``[q, k, v, a, b]`` (a, b the projections' raw gate inputs) and the gate parameters
    ``{A_log, dt_bias}`` the kernels take by keyword."""
    q = l2_normalize(torch.randn(tokens, s["hk"], s["dk"], generator=g)) * s["dk"] ** -0.5
    k = l2_normalize(torch.randn(tokens, s["hk"], s["dk"], generator=g))
    v = torch.randn(tokens, s["hv"], s["dv"], generator=g)
    a = torch.randn(tokens, s["hv"], generator=g) * 1.5
    b = torch.randn(tokens, s["hv"], generator=g) * 2
    gate = {"A_log": (torch.randn(s["hv"], generator=g) * 0.5).to(device),
            "dt_bias": (torch.randn(s["hv"], generator=g) * 0.5).to(device)}
    return [x.to(device) for x in (q, k, v, a, b)], gate


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def copy_us(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return median_us(lambda: dst.copy_(src), device)


def bench_decode(s, device, g) -> list[dict]:
    out = []
    state_bytes = s["hv"] * s["dk"] * s["dv"] * 4
    for rows in s["batches"]:
        for q in (1, 4):
            pages = rows * (q + 1) * s["variants"]
            cache = torch.randn(pages, s["hv"], s["dk"], s["dv"], generator=g).to(device)
            perm = torch.randperm(pages, generator=g).to(torch.int32).view(s["variants"], -1)
            sets = [(p[:rows].to(device), p[rows:].view(rows, q).to(device)) for p in perm]
            x, gate = inputs(g, rows * q, s, device)
            nxt = rotating(sets)
            us = median_us(lambda x=x, c=cache, n=nxt, k=gate: gdn_decode_update(*x, c, *n(), **k),
                         device)
            moved = rows * (q + 1) * state_bytes  # one page read, q pages written per row
            ref = copy_us(moved // 2, device)  # a copy reads and writes: half the bytes each
            # The check: the kernel against its twin on the same pages (a copy of some).
            small = cache[: 2 * rows * (q + 1)].clone()
            perm_small = torch.randperm(small.shape[0], generator=g).to(torch.int32).to(device)
            ip, op = perm_small[:rows], perm_small[rows : rows * (q + 1)].view(rows, q)
            want_cache = small.clone()
            want = gdn_decode_update_reference(*x, want_cache, ip, op, **gate)
            got = gdn_decode_update(*x, small, ip, op, **gate)
            out.append(dict(
                rows=rows, q=q, us=us, bytes=moved, tb_per_s=moved / us / 1e6,
                copy_us_same_bytes=ref, fraction_of_copy=ref / us,
                rel_err_vs_twin=max(rel_err(got, want), rel_err(small, want_cache)),
            ))
            print(f"decode rows={rows:4d} q={q}: {us:9.1f} us  {moved / us / 1e6:6.2f} TB/s "
                  f"({ref / us:5.1%} of copy)  err {out[-1]['rel_err_vs_twin']:.1e}")
    return out


def bench_numerics(s, device, g, steps: int, rows: int = 2) -> dict:
    """The paged decode kernel's state drift against float64: ``rows`` sequences decode
    ``steps`` tokens one step at a time (each step reads the page the last one wrote),
    q, k, v and the gate inputs rounded to bfloat16 as the projections give them, float32
    pages; the twin runs the same rounded inputs in float64 with float64 pages. Relative
    error of the states (max-abs, as ``rel_err``) after the first step and after the last,
    and of the last step's outputs."""
    x, gate = inputs(g, rows * steps, s, device)
    x = [t.to(torch.bfloat16) for t in x]
    init = torch.randn(rows, s["hv"], s["dk"], s["dv"], generator=g).to(device) * 0.1
    pages = torch.zeros(2 * rows, *init.shape[1:], device=device)
    pages64 = pages.double()
    pages[:rows], pages64[:rows] = init, init.double()
    gate64 = {k: v.double() for k, v in gate.items()}
    ids = torch.arange(rows, dtype=torch.int32, device=device)
    errs = {}
    for t in range(steps):
        at = slice(t * rows, (t + 1) * rows)
        src, dst = ids + (t % 2) * rows, ids + ((t + 1) % 2) * rows
        q, k, v, a, b = (u[at] for u in x)
        out = gdn_decode_update(q.float(), k.float(), v.float(), a, b, pages, src,
                                dst.view(rows, 1), **gate)
        want = gdn_decode_update_reference(q.double(), k.double(), v.double(), a.double(),
                                           b.double(), pages64, src, dst.view(rows, 1),
                                           **gate64)
        if t == 0:
            errs["state_rel_err_after_1_step"] = rel_err(pages[dst.long()], pages64[dst.long()])
    errs[f"state_rel_err_after_{steps}_steps"] = rel_err(pages[dst.long()], pages64[dst.long()])
    errs[f"output_rel_err_at_step_{steps}"] = rel_err(out, want)
    print("numerics: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    return {"rows": rows, "steps": steps, "inputs": "bfloat16", "pages": "float32",
            "reference": "float64 twin", **errs}


def varlen_plan(rows, length, interval, pages, device):
    qs = [r * length for r in range(rows + 1)]
    outs = [-1] * (rows * length)
    it = iter(range(rows, pages))
    for r in range(rows):
        for off in range(length):
            if (off + 1) % interval == 0 or off == length - 1:
                outs[r * length + off] = next(it)
    qs_t = torch.tensor(qs, dtype=torch.int32, device=device)
    return VarlenPlan(
        num_rows=rows, query_start=qs_t,
        in_pages=torch.arange(rows, dtype=torch.int32, device=device),
        token_out_pages=torch.tensor(outs, dtype=torch.int32, device=device),
        token_row=torch.empty(0), query_start_host=tuple(qs), token_out_pages_host=tuple(outs),
    )


def bench_fla(x, gate, cache, plan, token_out, token_args, device) -> dict:
    """fla-core's chunked scan over the same rows: the bare scan (``chunk_scan_fla``, q, k,
    v in float32 and in bfloat16) and the engine's path (``gdn_prefill`` on it: the
    requested states from chunk states and tails, into their pages), each against the
    token kernel's outputs and states (relative error)."""
    from hybridserve.kernels.gdn import gdn_gates

    q, k, v, a, b = x
    g, beta = gdn_gates(a, b, gate["A_log"], gate["dt_bias"], torch.float32)
    starts = list(plan.query_start_host)
    init = cache[plan.in_pages.long()]
    written = plan.token_out_pages[plan.token_out_pages >= 0].long()
    token_cache = cache.clone()
    gdn_varlen_update(*x, token_cache, *token_args[1:], **gate)
    want_states = token_cache[written]
    # Where the step's states come from: planned on the host once per step (every layer
    # of the step reuses it), so timed apart from the per-layer calls below.
    gdn_chunked._LAST_LAYOUT.clear()
    t0 = time.perf_counter()
    gdn_chunked._prefill_layout(plan, 64, cache.device)
    out = {"fla_layout_host_us_once_per_step": (time.perf_counter() - t0) * 1e6}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        scan = functools.partial(gdn_chunked.chunk_scan_fla, dtype=dtype)
        out[f"fla_scan_{name}_us"] = median_us(
            lambda scan=scan: scan(q, k, v, g, beta, starts, init, 64), device)

        def prefill(scan=scan, c=cache):
            return gdn_chunked.gdn_prefill(*x, c, plan, scan, gdn_varlen_update, 64, **gate)

        out[f"fla_chunked_{name}_us"] = median_us(prefill, device)
        fla_cache = cache.clone()
        o = prefill(c=fla_cache)
        out[f"fla_chunked_{name}_rel_err_vs_token_kernel"] = max(
            rel_err(o, token_out), rel_err(fla_cache[written], want_states))
        del fla_cache
    return out


def bench_prefill(s, device, g) -> list[dict]:
    out = []
    for rows, length in s["prefill"]:
        per_row = -(-length // s["interval"]) + 1
        pages = rows + rows * per_row
        cache = torch.randn(pages, s["hv"], s["dk"], s["dv"], generator=g).to(device) * 0.1
        plan = varlen_plan(rows, length, s["interval"], pages, device)
        x, gate = inputs(g, rows * length, s, device)
        args = (cache, plan.query_start, plan.in_pages, plan.token_out_pages)
        entry = dict(rows=rows, length=length, states_per_row=per_row - 1,
                     token_kernel_us=median_us(
                         lambda x=x, a=args, k=gate: gdn_varlen_update(*x, *a, **k), device))
        got = gdn_varlen_update(*x, *args, **gate)
        # The same kernel loading each token's operands one token ahead
        # (KernelPolicy.token_prefetch): its time, and its values against the plain loop's.
        entry["token_kernel_prefetch_us"] = median_us(
            lambda x=x, a=args, k=gate: gdn_varlen_update(*x, *a, **k, prefetch=True), device)
        entry["prefetch_equal"] = bool(torch.equal(
            gdn_varlen_update(*x, *args, **gate, prefetch=True), got))
        if rows * length <= 4096:  # the twin is a host loop per token: check one row's worth
            want = gdn_varlen_update_reference(*x, cache.clone(), *args[1:], **gate)
            entry["token_kernel_rel_err_vs_twin"] = rel_err(got, want)
        if device == "cuda" and gdn_chunked.fla_chunk_scan_available():
            entry.update(bench_fla(x, gate, cache, plan, got, args, device))
        out.append(entry)
        print(f"prefill {rows} x {length}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in entry.items() if k not in ("rows", "length")))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; a separate file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-decode", action="store_true", help="the prefill section only")
    parser.add_argument(
        "--f32-dots", choices=("tf32", "tf32x3", "ieee"), default=None,
        help="how fla-core's float32 dots run (Triton's TRITON_F32_DEFAULT, read when a "
             "kernel compiles; fla-core leaves it to Triton, whose default is TF32): its "
             "error against the token kernel and its time at each")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.f32_dots:
        # Before any kernel of this process compiles: the setting is read at compile time.
        os.environ["TRITON_F32_DEFAULT"] = args.f32_dots
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE if args.smoke or device != "cuda" else FULL
    g = torch.Generator().manual_seed(args.seed)
    result = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
        fla_chunk_scan=gdn_chunked.fla_chunk_scan_available(), fla_core=fla_version(),
        config={k: v for k, v in shapes.items()}, f32_dots=args.f32_dots or "triton default",
        decode=None if args.skip_decode else bench_decode(shapes, device, g),
        numerics=None if args.skip_decode else bench_numerics(
            shapes, device, g, steps=256 if shapes is FULL else 8),
        prefill=bench_prefill(shapes, device, g),
    )
    name = "gdn_kernels_smoke.json" if shapes is SMOKE else "gdn_kernels.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
