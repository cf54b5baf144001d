"""Benchmark: one Mamba2 layer's prefill kernels at the Nemotron-H-8B shape, old against new.

Measured in one run (benchmarks/results/INDEX.md says how), kernel medians from CUDA events:

  ssd    the SSD part of a packed prefill step, requested states written to their pages,
         for 8 x 4,096 tokens with initial and final states, the same with a state every
         64 tokens (the checkpoint grid), and 1 x 8,192:
           ``new``    :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill` on the two-pass
                      scan (:mod:`hybridserve.kernels.ssd_two_pass`, the default: a state
                      pass, then every chunk's outputs in parallel; grouped B/C, raw dt,
                      states straight into their pages), its defaults, then a sweep of
                      both passes' tiles and warps and the product precisions, and of
                      output chunks of 128 tokens (``out_chunk=128``);
           ``chunk_states``  the same through the three-launch scan
                      (:mod:`hybridserve.kernels.ssd_chunk_states`,
                      ``packed_prefill="chunk_states"``: every chunk's local state in
                      parallel, an elementwise state passing, the two-pass output pass),
                      its defaults (also by kernel), a sweep of its local-state and
                      state-passing tiles, and output chunks of 128 tokens;
           ``fused``  the same through the one-launch scan
                      (:mod:`hybridserve.kernels.ssd_chunked`, ``packed_prefill="fused"``),
                      its defaults and a few tiles and precisions (``split``: 16-bit
                      halves, the default for bf16 inputs);
           ``old``    the previous engine path: dt discretised in the activations' dtype,
                      float32 copies, groups expanded, fla-core's scan (where importable);
         each checked against the float64 twin on the heads of the first two groups
         (relative error of outputs and states);
         the default two-pass run also by kernel (``kernels_ms``, torch.profiler: the
         state pass against the output pass);
  conv   ``conv_varlen`` over 8 x 4,096 tokens of the 10,240-channel conv: no window
         asked, the window mode on with no window in the step, windows at the row ends
         (every prefill step), windows every 64 tokens; a few tiles; against its twin
         (outputs, and the written windows bit for bit). Each window mode twice:
           ``slabs``      the planned step's writer (the step plan's ``window_tokens``:
                          one program per window token and block of its page, no launch
                          without a window), with the tile sweep;
           ``full_grid``  the writer without that list, as graph steps take it (one
                          program per conv tile: the previous default), at the default
                          tile, the baseline.

Shapes: 128 heads x 64, state 128, 8 groups, conv dim 10,240, kernel 4; bf16
activations (views of the projection, as the mixer passes them), float32 state pages.
Writes ``benchmarks/results/prefill_kernels.json``; ``--smoke`` runs tiny shapes (on the
CPU through Triton's interpreter when there is no GPU) and writes
``prefill_kernels_smoke.json``; ``--quick`` times the defaults only (fewer compiles);
``--no-old`` skips the previous path (fla-core's autotuning); ``--forms`` times only the
two-pass scan in the forms of its arithmetic listed in ``two_pass_forms`` (``forms``
in each SSD case; no conv), each also by kernel.

Every SSD time is given twice: ``median_ms``, synchronised calls (the host's launch work
of each call is in it), and ``pipelined_ms``, back-to-back calls (the host queues the next
call while the device runs this one, as in a prefill step, so what shows is the device's
time where it is the slower).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, chosen before they exist.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import device_label, git_commit, result_writer  # noqa: E402

from hybridserve.kernels import (  # noqa: E402
    ssd_chunk_states,
    ssd_chunked,
    ssd_two_pass,
    ssd_varlen,
)
from hybridserve.kernels.conv_varlen import (  # noqa: E402
    conv_varlen,
    conv_varlen_reference,
    token_rows,
)

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(heads=128, head_dim=64, groups=8, d_state=128, conv_dim=10240, d_conv=4,
            ssd=(("8x4096 initial+final", 8, 4096, False), ("8x4096 state every 64", 8, 4096,
                 True), ("1x8192 initial+final", 1, 8192, False)),
            conv_rows=(8, 4096), reps=20, check_groups=2,
            # Two-pass scan: (output block_p, its warps, state pass block_p x block_n,
            # its warps, precision); registers a thread (sm_90, spilled bytes) in comments.
            two_pass_variants=(
                (64, 4, 32, 128, 8, "split"),  # the default: output 255 (40), state 225
                (64, 8, 32, 128, 8, "split"),  # output 255 (0)
                (32, 4, 32, 128, 8, "split"),  # output 194 (0)
                (32, 8, 32, 128, 8, "split"),  # output 187 (0)
                (64, 4, 64, 64, 8, "split"),  # state 228 (0)
                (64, 4, 16, 128, 4, "split"),  # state 196 (0)
                (64, 4, 16, 64, 8, "split"),  # state 128 (0)
                (64, 4, 32, 64, 4, "split"),  # state 254 (0)
                (64, 4, 64, 128, 8, "split"),  # state 255 (232)
                (64, 4, 32, 128, 8, "tf32"),
            ),
            # The two-pass scan's output pass over 128-token chunks (the state pass still
            # stores every 64): (output block_p, its warps); the state pass at its default.
            two_pass_128_variants=((32, 8), (64, 8), (32, 4)),  # output 255 (8), (104), (216)
            # Chunk-state scan: (output block_p, its warps, local-state block_p x block_n,
            # its warps, state-passing block (entries of the flattened state), its warps,
            # precision); the first row its defaults (guesses: none of these has run on a
            # GPU yet). Registers a thread in sm_90 builds (Triton 3.9, none spill): local
            # states 80 at 64 x 128 / 8, 124 at 64 x 128 / 4 and 64 x 64 / 4, 156 at
            # 32 x 128 / 4, 80 at 32 x 64 / 4; state passing 40 at 1,024 / 4, 69 at
            # 1,024 / 2, 71 at 2,048 / 4 and 512 / 1, 82 at 4,096 / 8.
            chunk_states_variants=(
                (64, 4, 64, 128, 8, 1024, 4, "split"),
                (64, 4, 64, 128, 4, 1024, 4, "split"),
                (64, 4, 32, 128, 4, 1024, 4, "split"),
                (64, 4, 64, 64, 4, 1024, 4, "split"),
                (64, 4, 32, 64, 4, 1024, 4, "split"),
                (64, 4, 64, 128, 8, 2048, 4, "split"),
                (64, 4, 64, 128, 8, 4096, 8, "split"),
                (64, 4, 64, 128, 8, 512, 1, "split"),
                (64, 4, 64, 128, 8, 1024, 2, "split"),
                (64, 4, 64, 128, 8, 1024, 4, "tf32"),
            ),
            # Its output pass over 128-token chunks: (output block_p, its warps).
            chunk_states_128_variants=((32, 8), (64, 8)),
            # The two-pass scan in its forms (its keywords; ``--forms`` times these
            # alone): the default (operands one chunk ahead, the scratch as halves,
            # state tiles of 64 x 64 for many rows), the scratch in float32, both off,
            # the previous state tile with and without halves, the new one at 8 warps.
            two_pass_forms=(
                {}, {"halves": False}, {"prefetch": False, "halves": False},
                {"state_block_p": 32, "state_block_n": 64},
                {"state_block_p": 32, "state_block_n": 64, "halves": False},
                {"state_block_p": 64, "state_block_n": 64, "state_warps": 8},
            ),
            # One-launch scan: (block_p, warps, precision).
            ssd_variants=((64, 8, "split"), (32, 4, "split"), (64, 8, "tf32")),
            conv_tiles=((32, 128, None), (32, 128, 4), (64, 128, 8), (16, 256, 8),
                        (32, 256, 8), (64, 256, 8), (128, 128, 8)),
            # The token walk (conv_varlen's walk="tokens"): (span, channels, warps).
            conv_token_walks=((64, 256, 4), (32, 256, 4), (128, 256, 4), (256, 256, 4),
                              (64, 128, 4), (64, 512, 4), (128, 512, 8), (64, 256, 2),
                              (128, 128, 2), (256, 512, 4)))
SMOKE = dict(heads=4, head_dim=16, groups=2, d_state=16, conv_dim=48, d_conv=4,
             ssd=(("2x70 initial+final", 2, 70, False), ("1x130 state every 64", 1, 130,
                  True)),
             conv_rows=(2, 70), reps=1, check_groups=1,
             two_pass_variants=((16, 4, 16, 16, 4, "ieee"),), two_pass_128_variants=((16, 4),),
             chunk_states_variants=((16, 4, 16, 16, 4, 64, 4, "ieee"),),
             chunk_states_128_variants=((16, 4),),
             two_pass_forms=({}, {"prefetch": False, "halves": False}),
             ssd_variants=((16, 4, "ieee"),),
             conv_tiles=((32, 64, None),), conv_token_walks=((16, 32, 4),))


def _time(fn, reps: int, device: str) -> tuple[float, object]:
    """Median seconds of ``fn`` (CUDA events, after one warm-up call; the host clock on
    the CPU, without one: the interpreter compiles nothing) and what its last call
    returned: the callers check that output, so the smoke run (one rep) calls each form
    once, not once to check and again to time. Every call of a form writes the same pages
    from the same inputs, so the last one's are the first one's."""
    if device == "cuda":
        fn()
    times = []
    got = None
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            got = fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            got = fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times), got


def _time_pipelined(fn, device: str, calls: int = 8, rounds: int = 5) -> float | None:
    """Median seconds a call of ``fn`` over ``rounds`` runs of ``calls`` back-to-back
    calls between two CUDA events: the host queues the next call while the device runs
    this one, as in a prefill step, so the host's launch work between calls (which
    :func:`_time`'s synchronised calls count) is hidden where the device is the slower.
    None off CUDA."""
    if device != "cuda":
        return None
    fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def _kernel_breakdown(fn, reps: int, device: str) -> dict | None:
    """GPU time a call of ``fn`` by kernel name (ms, summed over that name's launches),
    from torch.profiler: where the scan's time goes (its state pass, its output pass, the
    host plan's small launches). None off CUDA."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us:
            times[e.key[:90]] = round(us / reps / 1e3, 4)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:12])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Layer:
    """Random weights and bf16 activations of one Mamba2 layer for ``rows x length``
    tokens: x, B, C are views of the conv output, dt a column view of the projection."""

    def __init__(self, cfg, rows, length, device, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, p, gr, n = cfg["heads"], cfg["head_dim"], cfg["groups"], cfg["d_state"]
        t = rows * length
        self.rows, self.length, self.tokens = rows, length, t
        bf = torch.bfloat16

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        conv_out = rnd(t, h * p + 2 * gr * n, scale=0.5).to(bf)
        proj = rnd(t, 2 * h * p + h, scale=0.5).to(bf)
        self.x = conv_out[:, : h * p].view(t, h, p)
        self.B = conv_out[:, h * p : h * p + gr * n].view(t, gr, n)
        self.C = conv_out[:, h * p + gr * n :].view(t, gr, n)
        proj[:, -h:] -= 2.0  # softplus(dt + bias) mostly well under 1
        self.dt = proj[:, -h:]
        self.A = -torch.exp(rnd(h, scale=0.5))
        # Nemotron-H's init: dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1].
        dt0 = torch.exp(torch.rand(h, generator=g) * (torch.log(torch.tensor(0.1)) - torch.log(
            torch.tensor(1e-3))) + torch.log(torch.tensor(1e-3)))
        self.dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(device)
        self.D = rnd(h)
        self.init = rnd(rows, h, p, n, scale=0.1)
        self.limit = (0.0, float("inf"))
        self.qs = [i * length for i in range(rows + 1)]

    def requests(self, every: int | None):
        rows, offs = [], []
        for r in range(self.rows):
            grid = list(range(every - 1, self.length - 1, every)) if every else []
            rows += [r] * (len(grid) + 1)
            offs += [*grid, self.length - 1]
        return rows, offs

    def heads_of_groups(self, groups: int, cfg):
        """The inputs restricted to the heads of the first ``groups`` groups, float64."""
        per = cfg["heads"] // cfg["groups"]
        hs = groups * per
        return dict(x=self.x[:, :hs].double(), dt=self.dt[:, :hs].double(),
                    A=self.A[:hs].double(), B=self.B[:, :groups].double(),
                    C=self.C[:, :groups].double(), D=self.D[:hs].double(),
                    dt_bias=self.dt_bias[:hs].double(), init=self.init[:, :hs].double(),
                    heads=hs)


def _ssd_case(cfg, name, rows, length, every64, device, reps, use_fla, forms_only=False):
    lay = Layer(cfg, rows, length, device)
    req_rows, req_offs = lay.requests(64 if every64 else None)
    k = len(req_rows)
    h, p, n = cfg["heads"], cfg["head_dim"], cfg["d_state"]
    pages = torch.zeros(k + rows, h, p, n, device=device)
    out_pages = torch.arange(rows, rows + k, device=device)
    segments = ssd_varlen.plan_segments(lay.qs, req_rows, req_offs, device,
                                        chunk=ssd_varlen.SCAN_CHUNK)
    args = (lay.x, lay.dt, lay.A, lay.B, lay.C, lay.D, lay.init, segments)
    out = {"case": name, "tokens": lay.tokens, "states": k}

    def run(fn, **kw):
        # As the mixer calls it: the states go straight to their pages.
        scan = functools.partial(fn, **kw)
        y, _ = ssd_varlen.ssd_prefill(*args, scan, dt_bias=lay.dt_bias,
                                      time_step_limit=lay.limit, out_cache=pages,
                                      out_pages=out_pages)
        return y

    # float64 twin on the heads of the first groups.
    sub = lay.heads_of_groups(cfg["check_groups"], cfg)
    hs = sub["heads"]
    y64, s64 = ssd_varlen.ssd_prefill(
        sub["x"], sub["dt"], sub["A"], sub["B"], sub["C"], sub["D"], sub["init"], segments,
        ssd_chunked.ssd_scan_fused_reference, dt_bias=sub["dt_bias"], time_step_limit=lay.limit)

    def check(y, states):
        return {"rel_err_y": _rel(y[:, :hs], y64), "rel_err_states": _rel(states[:, :hs], s64)}

    def measure(fn, **kw):
        pages.zero_()
        median, y = _time(lambda: run(fn, **kw), reps, device)
        got = check(y, pages[out_pages])
        del y
        piped = _time_pipelined(lambda: run(fn, **kw), device)
        return {"median_ms": 1e3 * median,
                "pipelined_ms": None if piped is None else 1e3 * piped, **got}

    two_pass = ssd_two_pass.ssd_scan_two_pass
    if forms_only:
        out["forms"] = []
        for form in cfg["two_pass_forms"]:
            out["forms"].append({"form": form, **measure(two_pass, **form),
                                 "kernels_ms": _kernel_breakdown(
                                     lambda form=form: run(two_pass, **form), reps, device)})
            print(json.dumps(out["forms"][-1])[:300], flush=True)
        return out

    out["new"] = {"scan": two_pass.__name__, **measure(two_pass),
                  "kernels_ms": _kernel_breakdown(lambda: run(two_pass), reps, device),
                  "variants": [
        {**kw, **measure(two_pass, **kw)} for kw in (
            dict(block_p=bp, num_warps=w, state_block_p=sbp, state_block_n=sbn,
                 state_warps=sw, precision=pr)
            for bp, w, sbp, sbn, sw, pr in cfg["two_pass_variants"])] + [
        {"out_chunk": 128, "block_p": bp, "num_warps": w,
         **measure(two_pass, out_chunk=128, block_p=bp, num_warps=w)}
        for bp, w in cfg["two_pass_128_variants"]]}
    chunked = ssd_chunk_states.ssd_scan_chunk_states
    out["chunk_states"] = {
        "scan": chunked.__name__, **measure(chunked),
        "kernels_ms": _kernel_breakdown(lambda: run(chunked), reps, device),
        "variants": [
            {**kw, **measure(chunked, **kw)} for kw in (
                dict(block_p=bp, num_warps=w, local_block_p=lbp, local_block_n=lbn,
                     local_warps=lw, pass_block=pb, pass_warps=pw, precision=pr)
                for bp, w, lbp, lbn, lw, pb, pw, pr in cfg["chunk_states_variants"])] + [
            {"out_chunk": 128, "block_p": bp, "num_warps": w,
             **measure(chunked, out_chunk=128, block_p=bp, num_warps=w)}
            for bp, w in cfg["chunk_states_128_variants"]]}
    fused = ssd_chunked.ssd_scan_fused
    out["fused"] = {"scan": fused.__name__, **measure(fused), "variants": [
        {**kw, **measure(fused, **kw)} for kw in (
            dict(block_p=bp, num_warps=w, precision=pr) for bp, w, pr in cfg["ssd_variants"])]}
    if use_fla:
        scan = ssd_varlen.ssd_scan_varlen_fla
        old_segments = ssd_varlen.plan_segments(
            lay.qs, req_rows, req_offs, device,
            ssd_varlen.SCAN_CHUNK if ssd_varlen.chunk_states_supported(scan) else None)
    else:
        scan, old_segments = ssd_varlen.ssd_scan_varlen_reference, segments

    def old():
        # The previous mixer: discretised in the activations' dtype, then the plain scan.
        dt = ssd_varlen.discretize_dt_varlen(lay.dt, lay.dt_bias, lay.limit)
        y, states = ssd_varlen.ssd_prefill(lay.x, dt, lay.A, lay.B, lay.C, lay.D, lay.init,
                                           old_segments, scan)
        pages[out_pages] = states
        return y, states

    median, (y, states) = _time(old, reps, device)
    out["old"] = {"scan": scan.__name__, "median_ms": 1e3 * median, **check(y, states)}
    return out


def _conv_case(cfg, device, reps):
    rows, length = cfg["conv_rows"]
    c, kk = cfg["conv_dim"], cfg["d_conv"]
    t = rows * length
    g = torch.Generator(device="cpu").manual_seed(1)
    proj = (torch.randn(t, c + 2 * 64, generator=g)).to(torch.bfloat16).to(device)
    xbc = proj[:, 64 : 64 + c]  # a column slice, as the mixer passes it
    weight = torch.randn(c, kk, generator=g).to(torch.bfloat16).to(device)
    bias = torch.randn(c, generator=g).to(torch.bfloat16).to(device)
    pages = rows + t // 64 + 2 * rows + 2
    cache = torch.randn(pages, c, kk - 1, generator=g).to(torch.bfloat16).to(device)
    qs = torch.tensor([i * length for i in range(rows + 1)], device=device)
    in_pages = torch.arange(rows, device=device)
    trow = token_rows(qs, t)
    none = torch.full((t,), -1, dtype=torch.int64, device=device)
    ends = none.clone()
    ends[qs[1:] - 1] = torch.arange(rows, 2 * rows, device=device)
    # Every 64th token of each row and its last one (the prefix cache's checkpoints).
    grid = none.clone()
    at = sorted({r * length + o for r in range(rows)
                 for o in [*range(63, length, 64), length - 1]})
    grid[at] = torch.arange(rows, rows + len(at), device=device)
    modes = {"no window asked": None, "window mode, no window": none,
             "windows at row ends": ends, "windows every 64": grid}
    out = {"tokens": t, "channels": c, "modes": []}
    for name, outs in modes.items():
        twin = cache.clone()
        want = conv_varlen_reference(xbc, weight, bias, twin, qs, in_pages, "silu",
                                     out_pages=outs)
        listed = None if outs is None else torch.nonzero(outs >= 0).flatten().to(torch.int32)
        step = (xbc, weight, bias, cache, qs, in_pages, trow, outs)
        tiles = [{"block_t": bt, "block_c": bc, "num_warps": warps,
                  **_conv_measure(step, listed, (bt, bc, warps), want, twin, reps, device)}
                 for bt, bc, warps in cfg["conv_tiles"]]
        # The token walk (span, channels, warps), against the tiles' outputs bit for bit.
        tiles += [{"walk": "tokens", "block_t": bt, "block_c": bc, "num_warps": warps,
                   **_conv_measure(step, listed, (bt, bc, warps), want, twin, reps, device,
                                   walk="tokens")}
                  for bt, bc, warps in cfg.get("conv_token_walks", ())]
        mode = {"mode": name, "windows": 0 if outs is None else int(listed.numel()),
                "default_tile_ms": tiles[0]["median_ms"], "rel_err": tiles[0]["rel_err"],
                "tiles": tiles}
        if outs is not None:
            mode["slabs"] = tiles[0]
            mode["full_grid"] = _conv_measure(step, None, cfg["conv_tiles"][0], want, twin,
                                              reps, device)
        out["modes"].append(mode)
    return out


def _conv_measure(step, window_tokens, tile, want, twin, reps, device, walk="tiles"):
    """Median ms of one conv call (``window_tokens``: the slab writer's list, None for the
    full-grid writer) on a copy of the pages, its error against the twin's output, and
    whether the windows it wrote are the twin's bit for bit."""
    xbc, weight, bias, cache, qs, in_pages, trow, outs = step
    pages = cache.clone()
    bt, bc, warps = tile

    def run():
        return conv_varlen(xbc, weight, bias, pages, qs, in_pages, "silu", trow,
                           out_pages=outs, window_tokens=window_tokens,
                           block_t=bt, block_c=bc, num_warps=warps, walk=walk)

    median, got = _time(run, reps, device)
    piped = _time_pipelined(run, device)
    row = {"median_ms": 1e3 * median, "pipelined_ms": None if piped is None else 1e3 * piped,
           "rel_err": _rel(got.float(), want.float())}
    if walk != "tiles":
        tiles = conv_varlen(xbc, weight, bias, cache.clone(), qs, in_pages, "silu", trow,
                            out_pages=outs, window_tokens=window_tokens, walk="tiles")
        row["tiles_bits"] = bool(torch.equal(got, tiles))
    if outs is not None:
        written = outs[outs >= 0]
        row["windows_exact"] = bool(torch.equal(pages[written], twin[written]))
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--no-old", action="store_true",
                    help="skip the previous path (fla-core's autotuning takes a while)")
    ap.add_argument("--quick", action="store_true",
                    help="defaults only: no sweep of tiles and precisions (fewer compiles)")
    ap.add_argument("--conv-only", action="store_true", help="the conv cases only")
    ap.add_argument("--forms", action="store_true",
                    help="the SSD cases through the two-pass scan's forms only (no conv)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = SMOKE if a.smoke or device == "cpu" else FULL
    if a.quick:
        cfg = {**cfg, "two_pass_variants": (), "two_pass_128_variants": (), "ssd_variants": (),
               "chunk_states_variants": (), "chunk_states_128_variants": (),
               "conv_tiles": cfg["conv_tiles"][:1],
               "conv_token_walks": cfg["conv_token_walks"][:1]}
    use_fla = device == "cuda" and ssd_varlen.fla_available()
    started = time.time()
    smoke = a.smoke or device == "cpu"
    out = a.out or RESULTS / ("prefill_kernels_smoke.json" if smoke else "prefill_kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench_prefill_kernels",
        "device": device_label(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "fla_core": ssd_varlen.fla_version()},
        "commit": git_commit(),
        "config": {**cfg, "quick": a.quick},
        "ssd": [],
        "conv": None,
        "complete": False,
    }
    save = result_writer(result, out, started)

    for name, rows, length, every in () if a.conv_only else cfg["ssd"]:
        case = _ssd_case(cfg, name, rows, length, every, device, cfg["reps"],
                         use_fla and not a.no_old, forms_only=a.forms)
        if a.no_old:
            case.pop("old", None)
        result["ssd"].append(case)
        save()
        print(json.dumps(case)[:400], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    if not a.forms:
        result["conv"] = _conv_case(cfg, device, cfg["reps"])
        print(json.dumps(result["conv"])[:400], flush=True)
    result["complete"] = True
    save()
    print(f"wrote {out} in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
