"""What the benchmarks share to time work (replayed from CUDA graphs or not), and to
rotate inputs.

Importable as ``graph_timing`` by the benchmark scripts (run as ``python
benchmarks/<script>.py``), like ``provenance``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import torch
import triton


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one call on a side stream: compiles,
    autotuning and the allocator's first allocations happen outside the capture (what
    torch's graph capture asks for)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def rotating(items: Sequence):
    """A callable returning ``items`` in turn, round and round: each timed call takes
    another input set, so no iteration reads what the one before left in L2."""
    return itertools.cycle(items).__next__


def median_us(fn: Callable[[], object], device: str, warmup_ms: float = 25,
              rep_ms: float = 200) -> float:
    """Median microseconds of one call of ``fn``: ``triton.testing.do_bench`` on CUDA
    (``warmup_ms`` / ``rep_ms`` of calls); elsewhere (a smoke run) the wall clock of one
    call, the interpreter's time and not a kernel's: it compiles nothing to warm up, and
    more calls would only run the same code again, slowly."""
    if str(device).startswith("cuda"):
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                       return_mode="median") * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6
