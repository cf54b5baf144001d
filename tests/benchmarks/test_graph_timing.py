"""benchmarks/graph_timing.py: the input rotation and the graph capture the benchmarks
share."""

import pytest
import torch
from bench_smoke_helpers import load_benchmark


def test_rotating_returns_the_items_in_turn():
    nxt = load_benchmark("graph_timing").rotating(["a", "b", "c"])
    assert [nxt() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


@pytest.mark.gpu
def test_captured_graph_replays_the_work():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.zeros(4, device="cuda")
    graph = load_benchmark("graph_timing").capture(lambda: x.add_(1))
    assert x.tolist() == [1.0] * 4  # the side-stream warm-up ran once; capture runs nothing
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4
