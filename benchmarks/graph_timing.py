"""What the benchmarks share to time work replayed from CUDA graphs, and to rotate inputs.

Importable as ``graph_timing`` by the benchmark scripts (run as ``python
benchmarks/<script>.py``), like ``provenance``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch


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
