"""Benchmark: the state postprocess after a speculative decode step.

Variants, all measured in the same run (benchmarks/results/INDEX.md says how):

  (a) ownership   hybridserve's fused postprocess: page-id updates only, no state bytes
  (b) copy        state_copy of every crossed state to a checkpoint page, in all layers:
                  what a copying design must do on each crossing
  (c) d2d         torch device-to-device copy of the same bytes as (b), one contiguous
                  buffer: the bandwidth reference

Cases (batch of --rows requests, each ran 1 + --draft tokens): one request crossing a
checkpoint, all requests crossing, none crossing. Inputs are rotated over --variants
random page assignments so no iteration reads pages the previous one left in L2.

On CUDA: Nemotron-H-8B-like state by default (24 Mamba layers, SSM 128 x 64 x 128 bf16,
conv dim 10240, d_conv 4), timed with triton.testing.do_bench (median). Writes
benchmarks/results/state_postprocess.json. ``--smoke`` runs tiny shapes (on the CPU
through Triton's interpreter when there is no GPU) and writes a separate file; it never
writes the committed results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, chosen before they exist.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import capture, median_us, rotating  # noqa: E402

from hybridserve.kernels.state_postprocess import (  # noqa: E402
    PostprocessResult,
    StateCopyPlan,
    state_postprocess,
    state_postprocess_reference,
)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "state_postprocess.json"
SMOKE_OUT = RESULTS / "state_postprocess_smoke.json"

# Measured elsewhere, quoted for comparison only and labelled so (benchmarks/results/INDEX.md):
# vLLM 0.33.0's own postprocess kernel on an H200, same state shapes, 24 layers, 3 draft
# tokens.
EXTERNAL_REFERENCE = {
    "source": "vLLM 0.33.0 postprocess kernel on an H200, measured elsewhere; "
    "not measured by this script",
    "measured_here": False,
    "one_crossing_us": 73.0,
    "one_crossing_fraction_of_copy_bandwidth": 0.34,
    "all_128_crossing_us": 3550.0,
    "all_128_crossing_fraction_of_copy_bandwidth": 0.89,
    "h200_d2d_copy_tb_per_s": 4.27,
}


@dataclass(frozen=True)
class Config:
    rows: int = 128
    layers: int = 24
    ssm_heads: int = 128
    ssm_head_dim: int = 64
    d_state: int = 128
    conv_dim: int = 10240
    d_conv: int = 4
    draft: int = 3
    boundary_interval: int = 64
    dtype: str = "bfloat16"
    pool_pages: int = 768
    variants: int = 8
    warmup_ms: int = 25
    rep_ms: int = 200

    @property
    def page_bytes(self) -> int:
        """Bytes of one state page across all layers (conv window + SSM state)."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        conv = self.conv_dim * (self.d_conv - 1) * elem
        ssm = self.ssm_heads * self.ssm_head_dim * self.d_state * elem
        return self.layers * (conv + ssm)


SMOKE = Config(rows=8, layers=2, ssm_heads=2, ssm_head_dim=4, d_state=8, conv_dim=16,
               d_conv=4, draft=3, boundary_interval=16, dtype="float32", pool_pages=48,
               variants=2, warmup_ms=1, rep_ms=1)


def _git_commit() -> str:
    # A copy of the tree without .git can be told its commit through the environment.
    if os.environ.get("HYBRIDSERVE_COMMIT"):
        return os.environ["HYBRIDSERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _make_step(cfg: Config, num_crossing: int, g: torch.Generator, device: str) -> dict:
    """A decode step of cfg.rows requests, exactly ``num_crossing`` of which cross a grid
    point, on pages drawn at random from the pool; slots non-contiguous."""
    q, interval = cfg.draft + 1, cfg.boundary_interval
    num_slots = 4 * cfg.rows
    slots = torch.randperm(num_slots, generator=g)[: cfg.rows].to(torch.int32)
    crossing = torch.zeros(cfg.rows, dtype=torch.bool)
    crossing[torch.randperm(cfg.rows, generator=g)[:num_crossing]] = True
    num_computed = torch.zeros(num_slots, dtype=torch.int32)
    num_accepted = torch.zeros(cfg.rows, dtype=torch.int32)
    for r in range(cfg.rows):
        base = int(torch.randint(1, 64, (), generator=g)) * interval
        a = int(torch.randint(1, q + 1, (), generator=g))
        if crossing[r]:
            n = base - 1 - int(torch.randint(0, a, (), generator=g))
        else:
            n = base + int(torch.randint(0, interval - q, (), generator=g))
        num_computed[slots[r]], num_accepted[r] = n, a
    pages = torch.randperm(cfg.pool_pages, generator=g).to(torch.int32)
    need = cfg.rows * (q + 2)
    if need > cfg.pool_pages:
        raise ValueError(f"--pool-pages must be at least {need}")
    out_pages = pages[: cfg.rows * q].reshape(cfg.rows, q)
    state_page = torch.full((num_slots,), -1, dtype=torch.int32)
    state_page[slots.long()] = pages[cfg.rows * q: cfg.rows * (q + 1)]
    step = dict(idx_mapping=slots, num_computed=num_computed, num_accepted=num_accepted,
                out_pages=out_pages.contiguous(), state_page=state_page,
                release_prev=torch.ones(cfg.rows, dtype=torch.bool), boundary_interval=interval)
    decided = state_postprocess_reference(**step)
    src = decided.ckpt_page[:, 0].contiguous()
    assert int((src >= 0).sum()) == num_crossing
    spare = pages[cfg.rows * (q + 1): cfg.rows * (q + 2)]
    dst = torch.where(src >= 0, spare, -1).to(torch.int32)
    step = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.items()}
    k = decided.ckpt_page.shape[1]
    out = PostprocessResult(
        new_state_page=step["state_page"].clone(),
        new_num_computed=step["num_computed"].clone(),
        ckpt_page=torch.empty(cfg.rows, k, dtype=torch.int32, device=device),
        ckpt_len=torch.empty(cfg.rows, k, dtype=torch.int32, device=device),
        release_pages=torch.empty(cfg.rows, q, dtype=torch.int32, device=device),
    )
    return dict(step=step, out=out, src=src.to(device), dst=dst.to(device))


def _time_us(fn, cfg: Config, device: str) -> float:
    """Median time of ``fn()`` in microseconds."""
    return median_us(fn, device, cfg.warmup_ms, cfg.rep_ms)


def _graph_time_us(launches: list, cfg: Config) -> float:
    """Median GPU time of replaying each launch (rotating) from a captured CUDA graph."""
    graphs = [capture(fn) for fn in launches]
    next_graph = rotating(graphs)
    return _time_us(lambda: next_graph().replay(), cfg, "cuda")


def run(cfg: Config, device: str) -> dict:
    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(0)
    conv = [torch.empty(cfg.pool_pages, cfg.conv_dim, cfg.d_conv - 1, dtype=dtype, device=device)
            for _ in range(cfg.layers)]
    ssm = [torch.empty(cfg.pool_pages, cfg.ssm_heads, cfg.ssm_head_dim, cfg.d_state, dtype=dtype,
                       device=device) for _ in range(cfg.layers)]
    for t in conv + ssm:
        t.normal_()
    plan = StateCopyPlan(conv, ssm)
    q = cfg.draft + 1
    # Bookkeeping traffic of (a) per row: 4 x int32 reads, 1 bool, q page ids read,
    # 2 per-slot int32 writes, 2K + q int32 list writes (see the kernel docstring).
    k = -(-q // cfg.boundary_interval)
    ids_bytes = cfg.rows * (4 * 4 + 1 + 4 * q + 8 + 4 * (2 * k + q))

    cases = {"one_crossing": 1, "all_crossing": cfg.rows, "none_crossing": 0}
    results = {}
    for name, num_crossing in cases.items():
        variants = [_make_step(cfg, num_crossing, g, device) for _ in range(cfg.variants)]
        results[name] = _measure_case(cfg, device, plan, variants, num_crossing, ids_bytes)
    return results


def _measure_case(cfg: Config, device: str, plan: StateCopyPlan, variants: list[dict],
                  num_crossing: int, ids_bytes: int) -> dict:
    next_variant = rotating(variants)
    copied = num_crossing * cfg.page_bytes

    def ownership():
        v = next_variant()
        state_postprocess(**v["step"])

    def copy():
        v = next_variant()
        plan(v["src"], v["dst"])

    row = {"num_crossing": num_crossing, "state_bytes_per_crossing": cfg.page_bytes}
    t_own = _time_us(ownership, cfg, device)
    row["ownership"] = {"median_us": t_own, "state_bytes_moved": 0,
                        "bookkeeping_bytes": ids_bytes}
    t_copy = _time_us(copy, cfg, device)
    row["copy"] = {"median_us": t_copy, "state_bytes_moved": 2 * copied,
                   "achieved_gb_per_s": 2 * copied / t_copy / 1e3 if copied else None}
    if device == "cuda":
        # Eager timings above include the Python launchers (host-bound for a kernel this
        # small). A decode step captured as a CUDA graph pays only the GPU time:
        # replay each variant's launch from a graph and time the replays.
        row["ownership"]["graph_median_us"] = _graph_time_us(
            [lambda v=v: state_postprocess(**v["step"], out=v["out"]) for v in variants], cfg)
        row["copy"]["graph_median_us"] = _graph_time_us(
            [lambda v=v: plan(v["src"], v["dst"]) for v in variants], cfg)
    row["d2d"] = None
    if copied:
        src_buf = torch.empty(copied, dtype=torch.uint8, device=device)
        dst_buf = torch.empty_like(src_buf)
        t_d2d = _time_us(lambda: dst_buf.copy_(src_buf), cfg, device)
        d2d_bw = 2 * copied / t_d2d / 1e3
        row["d2d"] = {"median_us": t_d2d, "state_bytes_moved": 2 * copied,
                      "achieved_gb_per_s": d2d_bw}
        row["copy"]["fraction_of_d2d_bandwidth"] = row["copy"]["achieved_gb_per_s"] / d2d_bw
    row["copy_over_ownership"] = t_copy / t_own
    return row


def _table(results: dict) -> str:
    lines = [f"{'case':<15}{'crossing':>9}{'own us':>9}{'own graph':>10}{'copy us':>9}"
             f"{'copy graph':>11}{'copy GB/s':>10}{'d2d us':>9}{'d2d GB/s':>10}{'copy/own':>9}"]

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for name, row in results.items():
        d2d = row["d2d"] or {}
        lines.append(
            f"{name:<15}{row['num_crossing']:>9}{row['ownership']['median_us']:>9.1f}"
            f"{fmt(row['ownership'].get('graph_median_us'), '.1f'):>10}"
            f"{row['copy']['median_us']:>9.1f}{fmt(row['copy'].get('graph_median_us'), '.1f'):>11}"
            f"{fmt(row['copy']['achieved_gb_per_s'], '.0f'):>10}"
            f"{fmt(d2d.get('median_us'), '.1f'):>9}{fmt(d2d.get('achieved_gb_per_s'), '.0f'):>10}"
            f"{row['copy_over_ownership']:>9.1f}"
        )
    ref = EXTERNAL_REFERENCE
    lines.append(f"external reference (not measured here): vLLM 0.33.0 on an H200, "
                 f"{ref['one_crossing_us']:.0f} us one crossing, "
                 f"{ref['all_128_crossing_us'] / 1e3:.2f} ms 128 crossing")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the record written to the output file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU is fine")
    parser.add_argument("--out", type=Path, default=None, help="output JSON path")
    defaults = Config()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)

    base = SMOKE if args.smoke else defaults
    overrides = {f: getattr(args, f) for f in asdict(base) if getattr(args, f) is not None}
    cfg = Config(**{**asdict(base), **overrides})
    out = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    if args.smoke and out.resolve() == DEFAULT_OUT.resolve():
        parser.error("--smoke never writes the committed results file; pick another --out")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("the full benchmark needs a CUDA device; use --smoke on the CPU")

    results = run(cfg, device)
    record = {
        "benchmark": "state_postprocess",
        "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": _git_commit(),
        "config": {**asdict(cfg), "page_bytes": cfg.page_bytes},
        "timing": "triton.testing.do_bench median" if device == "cuda" else "perf_counter median",
        "results": results,
        "external_reference": EXTERNAL_REFERENCE,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(_table(results))
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
