"""Benchmark: one Mamba2 layer's decode / verify kernels at the Nemotron-H-8B shape, old
against new, at batch 1 / 64 / 256 and q = 1 / 4 (q = 4: a speculative verify row) in
one run.

Per (batch, q), kernel medians (``triton.testing.do_bench``, CUDA events):

  conv       ``conv_decode_update``: ``old`` the previous form (every output re-reads its
             K inputs, every window its K - 1 entries: ``registers=False``), ``new`` the
             window read once and shifted in registers;
  ssm        ``ssm_update`` on the conv output (dt raw, discretised in the kernel);
  ops        the Mamba decode ops of one layer: ``old`` old conv + ssm (two launches),
             ``two`` new conv + ssm, ``fused`` ``conv_ssm_update`` (one launch: the conv
             output never goes through memory);

each checked against its torch twin (relative error of outputs, windows, states), with the
bytes each must move at least (its DRAM traffic if every byte moved once) and the
bandwidth that makes. At batch 1 the ops of 24 layers (distinct weights and pages, as in a
model) are also captured in one CUDA graph and replayed: ``layers24_us``, the figure of the
issue's table (the peer's 150 us; ours 245 us before dt was fused).

Unless ``--no-sweep``, each case also times the new kernels over a few tiles
(``conv_tiles``: channels and warps a program; ``fused_tiles``: head-dim rows and warps),
each checked against the twin, to choose the defaults from.

Shapes: 128 heads x 64, state 128, 8 groups, conv dim 10,240, kernel 4; bf16 activations
(xBC and dt column views of one projection, as the mixer passes them), bf16 conv windows,
float32 state pages; every token's window and state written to its own page.
Writes ``benchmarks/results/decode_kernels.json``; ``--smoke`` runs tiny shapes (on the CPU
through Triton's interpreter when there is no GPU) and writes ``decode_kernels_smoke.json``.
"""

from __future__ import annotations

import argparse
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
from graph_timing import capture  # noqa: E402
from provenance import device_label, git_commit, result_writer  # noqa: E402

from hybridserve.kernels import mamba_decode  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# conv_tiles: (channels, warps) a program of conv_decode_update's register form;
# fused_tiles: (head-dim rows, warps) a program of conv_ssm_update. The defaults first.
FULL = dict(heads=128, head_dim=64, groups=8, d_state=128, conv_dim=10240, d_conv=4,
            batches=(1, 64, 256), qs=(1, 4), graph_layers=24,
            conv_tiles=((256, 4), (128, 4), (256, 2), (512, 4), (1024, 4), (1024, 8)),
            fused_tiles=((16, 4), (8, 2), (8, 4), (16, 2), (16, 8), (32, 4), (32, 8),
                         (64, 8)))
# The smoke run's cases: two rows (batch 1 runs in layers24_batch1), decode and verify.
SMOKE = dict(heads=2, head_dim=4, groups=1, d_state=8, conv_dim=24, d_conv=4,
             batches=(2,), qs=(1, 4), graph_layers=2, conv_tiles=((16, 4), (8, 2)),
             fused_tiles=((2, 4), (4, 2)))


def _time(fn, device: str) -> tuple[float, object]:
    """Median seconds of one call of ``fn``: ``do_bench`` on CUDA; the host clock of one
    call on the CPU (the interpreter's time, not the kernel's: the smoke mode's check that
    every form runs). With what a call returned: the callers check that output, so the
    smoke run calls each form once, not once to check and again to time (every call of a
    form writes the same pages from the same inputs, so the pages checked after the timing
    calls are the first call's)."""
    if device == "cuda":
        got = fn()
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3, got
    t = time.perf_counter()
    got = fn()
    return time.perf_counter() - t, got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().nan_to_num(0.0), b.double().nan_to_num(0.0)
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Layer:
    """One layer's weights, pages and a step's inputs for ``rows`` rows of ``q`` tokens:
    row ``r`` reads page ``r`` and writes token ``t``'s window and state to page
    ``rows + r * q + t``."""

    def __init__(self, cfg, rows, q, device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        h, p, gr, n, c, k = (cfg[key] for key in ("heads", "head_dim", "groups", "d_state",
                                                  "conv_dim", "d_conv"))
        if c != h * p + 2 * gr * n:
            raise ValueError("conv_dim must be heads * head_dim + 2 * groups * d_state")
        t = rows * q
        bf = torch.bfloat16

        def rnd(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=device) * scale

        self.rows, self.q, self.tokens = rows, q, t
        self.heads, self.head_dim, self.groups, self.d_state = h, p, gr, n
        proj = rnd(t, h * p + c + h, scale=0.5).to(bf)  # z, xBC, dt
        proj[:, -h:] -= 2.0
        self.xbc = proj[:, h * p : h * p + c]
        self.dt = proj[:, -h:]
        self.weight = rnd(c, k, scale=0.5).to(bf)
        self.bias = rnd(c, scale=0.1).to(bf)
        self.A = -torch.exp(rnd(h, scale=0.5))
        self.D = rnd(h)
        self.dt_bias = rnd(h, scale=0.5)
        pages = rows + t
        self.conv_cache = rnd(pages, c, k - 1).to(bf)
        self.ssm_cache = rnd(pages, h, p, n, scale=0.1)
        self.in_pages = torch.arange(rows, dtype=torch.int32, device=device)
        self.out_pages = (rows + torch.arange(t, dtype=torch.int32, device=device)).view(rows, q)
        self.written = t

    # The ops (each writes windows / states to the output pages, as the engine's step).
    def conv(self, registers: bool, tile: tuple[int, int] | None = None) -> torch.Tensor:
        block_c, warps = tile or (None, 4)
        return mamba_decode.conv_decode_update(
            self.xbc, self.weight, self.bias, self.conv_cache, self.in_pages, self.out_pages,
            "silu", registers=registers, block_c=block_c, num_warps=warps,
        )

    def ssm(self, conv: torch.Tensor) -> torch.Tensor:
        t, h, p, gr, n = self.tokens, self.heads, self.head_dim, self.groups, self.d_state
        x, B, C = conv.split([h * p, gr * n, gr * n], dim=-1)
        return mamba_decode.ssm_update(
            x.view(t, h, p), self.dt, self.A, B.view(t, gr, n), C.view(t, gr, n), self.D,
            self.ssm_cache, self.in_pages, self.out_pages, dt_bias=self.dt_bias,
            time_step_limit=None,
        )

    def fused(self, tile: tuple[int, int] | None = None) -> torch.Tensor:
        block_p, warps = tile or (None, 4)
        return mamba_decode.conv_ssm_update(
            self.xbc, self.dt, self.weight, self.bias, self.A, self.D, self.conv_cache,
            self.ssm_cache, self.in_pages, self.out_pages, "silu", dt_bias=self.dt_bias,
            time_step_limit=None, block_p=block_p, num_warps=warps,
        )

    def twin(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv output, y, conv pages, state pages) of the torch twins, on copies."""
        conv_cache, ssm_cache = self.conv_cache.clone(), self.ssm_cache.clone()
        conv = mamba_decode.conv_decode_update_reference(
            self.xbc.contiguous(), self.weight, self.bias, conv_cache, self.in_pages,
            self.out_pages, "silu",
        )
        y = mamba_decode.conv_ssm_update_reference(
            self.xbc, self.dt, self.weight, self.bias, self.A, self.D, conv_cache,
            ssm_cache, self.in_pages, self.out_pages, "silu", dt_bias=self.dt_bias,
            time_step_limit=None,
        )
        return conv, y, conv_cache, ssm_cache

    def written_pages(self) -> torch.Tensor:
        return self.out_pages.reshape(-1).long()

    # Bytes each op must move at least.
    def bytes(self) -> dict[str, int]:
        t, c = self.xbc.shape
        k = self.weight.shape[1]
        act = self.xbc.element_size()
        window = c * (k - 1) * self.conv_cache.element_size()
        state = self.ssm_cache[0].numel() * self.ssm_cache.element_size()
        hp = self.heads * self.head_dim
        taps = c * (k + 1) * act
        conv = 2 * t * c * act + self.rows * window + self.written * window + taps
        # The recurrence reads x, B, C (the conv output), dt; writes y (float32) and states.
        ssm_io = t * (c * act + self.heads * act + hp * 4)
        ssm = ssm_io + self.rows * state + self.written * state
        # Fused: the conv output is neither written nor read back.
        fused = conv + ssm - 2 * t * c * act
        return {"conv": conv, "ssm": ssm, "two_launches": conv + ssm, "fused": fused}


def _sweep(fn, tiles, want, device) -> list[dict]:
    """Each tile's median and its output's relative error against ``want``."""
    out = []
    for tile in tiles:
        seconds, got = _time(lambda tile=tile: fn(tile), device)
        out.append({"tile": list(tile), "rel_err_vs_twin": _rel(got, want), "us": seconds * 1e6})
    return out


def _case(cfg, rows, q, device, sweep: bool) -> dict:
    layer = Layer(cfg, rows, q, device, seed=1000 * rows + q)
    conv_want, y_want, conv_pages_want, ssm_pages_want = layer.twin()
    pages = layer.written_pages()
    check, measured = {}, {}
    # Each form's timed call is the one checked (the pages it writes NaN before it).
    for name, registers in (("old", False), ("new", True)):
        layer.conv_cache[pages] = float("nan")
        measured[f"conv_{name}"], got = _time(lambda r=registers: layer.conv(r), device)
        check[f"conv_{name}"] = {
            "out_rel_err_vs_twin": _rel(got, conv_want),
            "windows_equal_twin": bool(torch.equal(layer.conv_cache[pages],
                                                   conv_pages_want[pages])),
        }
    conv_out = got  # the register form's output: the ssm's input in the two launches
    layer.ssm_cache[pages] = float("nan")
    measured["ssm"], y_two = _time(lambda: layer.ssm(conv_out), device)
    check["two_launches"] = {
        "y_rel_err_vs_twin": _rel(y_two, y_want),
        "states_rel_err_vs_twin": _rel(layer.ssm_cache[pages], ssm_pages_want[pages]),
    }
    layer.conv_cache[pages] = float("nan")
    layer.ssm_cache[pages] = float("nan")
    measured["ops_fused"], y_fused = _time(layer.fused, device)
    check["fused"] = {
        "y_rel_err_vs_twin": _rel(y_fused, y_want),
        "y_rel_err_vs_two_launches": _rel(y_fused, y_two),
        "states_rel_err_vs_twin": _rel(layer.ssm_cache[pages], ssm_pages_want[pages]),
        "windows_equal_twin": bool(torch.equal(layer.conv_cache[pages],
                                               conv_pages_want[pages])),
    }
    measured["ops_old"] = _time(lambda: layer.ssm(layer.conv(False)), device)[0]
    measured["ops_two"] = _time(lambda: layer.ssm(layer.conv(True)), device)[0]
    times = {key: measured[key] for key in ("conv_old", "conv_new", "ssm", "ops_old",
                                            "ops_two", "ops_fused")}
    need = layer.bytes()
    use = {"conv_old": "conv", "conv_new": "conv", "ssm": "ssm", "ops_old": "two_launches",
           "ops_two": "two_launches", "ops_fused": "fused"}
    case = {
        "rows": rows, "q": q, "windows_and_states_written": layer.written,
        "us": {key: s * 1e6 for key, s in times.items()},
        "min_bytes": need,
        "gb_per_s": {key: need[use[key]] / s / 1e9 for key, s in times.items()},
        "speedup": {
            "conv_new_over_old": times["conv_old"] / times["conv_new"],
            "ops_fused_over_old": times["ops_old"] / times["ops_fused"],
            "ops_fused_over_two": times["ops_two"] / times["ops_fused"],
        },
        "check": check,
    }
    if sweep:
        case["conv_tiles"] = _sweep(lambda tile: layer.conv(True, tile), cfg["conv_tiles"],
                                    conv_want, device)
        case["fused_tiles"] = _sweep(layer.fused, cfg["fused_tiles"], y_want, device)
    return case


def _graph_layers(cfg, device, layers: int) -> dict:
    """Batch 1, q = 1: the Mamba ops of ``layers`` layers (each its own weights and pages)
    captured in one CUDA graph, replay medians (the host's launch cost out of the figure,
    as in the engine's decode graphs). On the CPU: one eager pass, the interpreter's time."""
    stack = [Layer(cfg, 1, 1, device, seed=7 + i) for i in range(layers)]
    forms = {
        "old": lambda: [lay.ssm(lay.conv(False)) for lay in stack],
        "two": lambda: [lay.ssm(lay.conv(True)) for lay in stack],
        "fused": lambda: [lay.fused() for lay in stack],
    }
    out = {"layers": layers}
    for name, fn in forms.items():
        if device != "cuda":
            out[f"{name}_us"] = _time(fn, device)[0] * 1e6
            continue
        graph = capture(fn)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        out[f"{name}_us"] = statistics.median(times)
        del graph
    out["fused_over_old"] = out["old_us"] / out["fused_us"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="defaults only: no sweep of the new kernels' tiles")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = a.smoke or device == "cpu"
    cfg = SMOKE if smoke else FULL
    started = time.time()
    out = a.out or RESULTS / ("decode_kernels_smoke.json" if smoke else "decode_kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench_decode_kernels",
        "device": device_label(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "commit": git_commit(),
        "config": cfg,
        "cases": [],
        "layers24_batch1": None,
        "complete": False,
    }
    save = result_writer(result, out, started)

    for rows in cfg["batches"]:
        for q in cfg["qs"]:
            case = _case(cfg, rows, q, device, not a.no_sweep)
            result["cases"].append(case)
            save()
            us = case["us"]
            print(f"batch {rows:4d} q {q}: conv old {us['conv_old']:8.1f} new "
                  f"{us['conv_new']:8.1f} us | ops old {us['ops_old']:8.1f} two "
                  f"{us['ops_two']:8.1f} fused {us['ops_fused']:8.1f} us", flush=True)
            for kind in ("conv_tiles", "fused_tiles"):
                if kind in case:
                    best = min(case[kind], key=lambda v: v["us"])
                    print(f"  best {kind}: {best['tile']} {best['us']:.1f} us", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    result["layers24_batch1"] = _graph_layers(cfg, device, cfg["graph_layers"])
    print(json.dumps(result["layers24_batch1"]), flush=True)
    result["complete"] = True
    save()
    print(f"wrote {out} in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
