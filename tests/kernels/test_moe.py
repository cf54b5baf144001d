"""Grouped experts (:mod:`hybridserve.kernels.moe`): the sort by expert, the two Triton
launches against their gather-and-bmm twins on NaN-poisoned outputs, the whole path
against the twin and a per-expert loop (float64 oracle), on fresh random routings with
empty experts, one token, every token on one expert; gated and plain experts; the race
checker and three program orders; the dispatch in the model layer.

Shapes stay tiny (the interpreter runs one program at a time) but not tile-aligned.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from hybridserve.kernels import moe  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors run the kernels through TRITON_INTERPRET=1"
)

TILES = moe.Tiles(16, 16, 16, 1, 1)
ACTS = {"silu": F.silu, "relu": F.relu, "relu2": lambda v: torch.square(F.relu(v))}


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _routing(g, tokens, experts, top_k, kind):
    """``topk_ids [T, k]`` (distinct experts per token) and weights of one routing kind."""
    if kind == "random":
        rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    elif kind == "one_expert":  # every token's first choice is expert 2, the rest expert 4..
        rows = [torch.tensor([2, *range(4, 3 + top_k)])] * tokens
    elif kind == "few_experts":  # most experts get nothing
        rows = [torch.randperm(top_k + 1, generator=g)[:top_k] * 2 for _ in range(tokens)]
    else:
        raise AssertionError(kind)
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids.to(torch.int64), weights


def _operands(g, tokens, hidden, inter, experts, gated, dtype=torch.float32):
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return x.to(dtype), w1.to(dtype), w2.to(dtype)


def _loop64(x, w1, w2, ids, weights, gated, act):
    return moe.moe_experts_loop(
        x.double(), w1.double(), w2.double(), ids, weights.double(), gated=gated,
        act=ACTS[act], accumulate_dtype=torch.float64,
    )


# --------------------------------------------------------------------------------------
# Sorting by expert
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "one_expert", "few_experts"])
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (9, 4), (40, 16), (0, 16)])
def test_sort_by_expert_blocks_are_whole_and_homogeneous(kind, tokens, block_m):
    g = torch.Generator().manual_seed(_seed())
    experts, top_k = 7, 3
    ids, _ = _routing(g, tokens, experts, top_k, kind)
    ids = ids.reshape(tokens, top_k)
    b = moe.sort_by_expert(ids, experts, block_m)
    a = tokens * top_k
    assert b.num_blocks == moe.max_blocks(a, experts, block_m)
    assert b.rows.shape == (b.num_blocks * block_m,)
    rows = b.rows.view(b.num_blocks, block_m)
    real = b.rows[b.rows >= 0]
    assert sorted(real.tolist()) == list(range(a))  # every assignment exactly once
    flat = ids.reshape(-1)
    for blk in range(b.num_blocks):
        e = int(b.block_expert[blk])
        r = rows[blk][rows[blk] >= 0]
        if e < 0:
            assert r.numel() == 0
            continue
        assert r.numel() > 0 and (flat[r.long()] == e).all()
        assert (r[1:] > r[:-1]).all()  # stable: assignment order within an expert
    used = b.block_expert[b.block_expert >= 0]
    assert (used[1:] >= used[:-1]).all() and (b.block_expert[used.numel():] == -1).all()
    torch.testing.assert_close(moe.expert_of_assignment(b), flat)


# --------------------------------------------------------------------------------------
# The launches against their twins
# --------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("gated,act", [(True, "silu"), (False, "relu2"), (True, "relu")])
@pytest.mark.parametrize("kind", ["random", "one_expert", "few_experts"])
def test_launches_match_twins(gated, act, kind):
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 9, 24, 20, 6, 2
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, gated)
    ids, weights = _routing(g, tokens, experts, top_k, kind)
    blocks = moe.sort_by_expert(ids, experts, TILES.block_m)
    h = torch.full((tokens * top_k, inter), float("nan"))
    moe.grouped_up(x, w1, blocks, top_k, gated=gated, activation=act, tiles=TILES, out=h)
    want_h = moe.grouped_up_reference(x, w1, blocks, top_k, gated=gated, activation=act)
    torch.testing.assert_close(h, want_h, rtol=2e-5, atol=2e-5)
    out = torch.full((tokens * top_k, hidden), float("nan"))
    moe.grouped_down(h, w2, blocks, weights, tiles=TILES, out=out)
    torch.testing.assert_close(
        out, moe.grouped_down_reference(h, w2, blocks, weights), rtol=2e-5, atol=2e-5
    )


@interpreted
@pytest.mark.parametrize("gated,act", [(True, "silu"), (False, "relu2")])
@pytest.mark.parametrize(
    "tokens,top_k,kind",
    [(1, 2, "random"), (1, 1, "random"), (13, 3, "random"), (11, 2, "one_expert"),
     (10, 2, "few_experts"), (0, 2, "random")],
)
def test_whole_path_matches_twin_and_loop(gated, act, tokens, top_k, kind):
    g = torch.Generator().manual_seed(_seed())
    hidden, inter, experts = 24, 20, 8
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, gated)
    ids, weights = _routing(g, tokens, experts, top_k, kind)
    ids = ids.reshape(tokens, top_k)
    weights = weights.reshape(tokens, top_k)
    got = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act, tiles=TILES)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = _loop64(x, w1, w2, ids, weights, gated, act)
    twin = moe.moe_experts_reference(x, w1, w2, ids, weights, gated=gated, activation=act)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twin.double(), want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("tiles", [moe.Tiles(16, 32, 16, 1, 1), moe.Tiles(32, 16, 32, 1, 1)])
def test_other_tiles_and_strided_weights(tiles):
    """Tiles wider than a dimension, and w1 / w2 that are transposed views (the kernels
    take any weight strides)."""
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 7, 24, 20, 5, 2
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, True)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    ids, weights = _routing(g, tokens, experts, top_k, "random")
    got = moe.moe_experts(x, w1t, w2t, ids, weights, gated=True, activation="silu", tiles=tiles)
    want = _loop64(x, w1, w2, ids, weights, True, "silu")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@interpreted
def test_a_token_gets_the_same_bits_alone_or_in_a_batch():
    """Each row's products and its sum over its k experts run in a fixed order, whatever
    else the block holds: batch invariance, bit for bit (here, under the interpreter)."""
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 13, 48, 40, 6, 2
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, True)
    ids, weights = _routing(g, tokens, experts, top_k, "random")
    kw = dict(gated=True, activation="silu", tiles=TILES)
    full = moe.moe_experts(x, w1, w2, ids, weights, **kw)
    for i in (0, 7, 12):
        alone = moe.moe_experts(x[i : i + 1], w1, w2, ids[i : i + 1], weights[i : i + 1], **kw)
        assert torch.equal(alone[0], full[i])


@interpreted
def test_bfloat16_close_to_float64():
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 9, 32, 16, 4, 2
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, True, torch.bfloat16)
    ids, weights = _routing(g, tokens, experts, top_k, "random")
    got = moe.moe_experts(x, w1, w2, ids, weights, gated=True, activation="silu", tiles=TILES)
    assert got.dtype == torch.bfloat16
    want = _loop64(x, w1, w2, ids, weights, True, "silu")
    # One bf16 rounding of h and of the output (2^-8 relative each), nothing worse.
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2


def test_bad_operands_are_refused():
    x = torch.randn(3, 8)
    w1 = torch.randn(2, 10, 8)
    w2 = torch.randn(2, 8, 5)
    ids = torch.zeros(3, 1, dtype=torch.int64)
    wts = torch.ones(3, 1)
    with pytest.raises(ValueError, match="weights do not fit"):
        moe.moe_experts(x, w1, w2[:, :, :4], ids, wts, gated=True, activation="silu")
    with pytest.raises(ValueError, match="activation 'gelu'"):
        moe.moe_experts(x, w1, w2, ids, wts, gated=True, activation="gelu")
    with pytest.raises(ValueError, match="topk_weights"):
        moe.moe_experts(x, w1, w2, ids, wts[:2], gated=True, activation="silu")


# --------------------------------------------------------------------------------------
# Races and program order
# --------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("kind", ["random", "one_expert"])
def test_launches_race_free_and_independent_of_program_order(kind):
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 11, 24, 20, 6, 3
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, True)
    ids, weights = _routing(g, tokens, experts, top_k, kind)

    def make_args():
        return dict(x=x, w1=w1, w2=w2, topk_ids=ids, topk_weights=weights, gated=True,
                    activation="silu", tiles=TILES)

    with racecheck.record_launches() as rec:
        moe.moe_experts(**make_args())
    assert len(rec.reports) == 2
    for report in rec.reports:
        assert report.clean, str(report)
        assert report.bytes_stored > 0
    report = racecheck.run_launcher_in_orders(moe.moe_experts, make_args, seed=_seed() % 1000)
    assert report.consistent, report.differences


# --------------------------------------------------------------------------------------
# Dispatch in the model layer
# --------------------------------------------------------------------------------------


def test_layer_takes_the_kernels_only_where_enabled(monkeypatch, count_calls):
    from hybridserve.models.config import SIGMOID_GROUPED, MoEParams
    from hybridserve.models.layers.moe import MoEBlock

    p = MoEParams(SIGMOID_GROUPED, 8, 2, 16, gated=False, activation="relu2",
                  norm_topk_prob=True, n_group=2, topk_group=1, shared_intermediate_size=8)
    block = MoEBlock(24, p)
    with torch.no_grad():
        for t in block.parameters():
            t.copy_(torch.randn(t.shape) * 0.3)
    x = torch.randn(5, 24)
    kernel_calls = count_calls(moe, "moe_experts")
    loop_calls = count_calls(moe, "moe_experts_loop")
    with torch.no_grad():
        loop = block(x)  # CPU tensors: the loop by default
        assert (len(kernel_calls), len(loop_calls)) == (0, 1)
        if INTERPRETED:
            block.experts.kernels = "triton"  # what KernelPolicy(moe="triton") sets
            fused = block(x)
            assert (len(kernel_calls), len(loop_calls)) == (1, 1)
            torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-5)
            # float64 has no kernel path: the loop.
            block64 = block.double()
            block64(x.double())
            assert (len(kernel_calls), len(loop_calls)) == (1, 2)
    with pytest.raises(ValueError, match="moe mode"):
        moe.triton_enabled("sometimes", x, x, x, "silu")


# --------------------------------------------------------------------------------------
# GPU (compiled kernels): TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_moe.py -s
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)",
)
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes_match_the_loop_and_capture_in_a_graph(tokens, dtype):
    """Nemotron 3 Nano (plain relu2, 128 experts, top-6) and Granite 4.0-H Small (gated
    silu, 72 experts, top-10) layer shapes: the compiled kernels against the float64 loop
    on a slice of tokens, and a CUDA-graph replay equal to the eager call."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens)
    for hidden, inter, experts, top_k, gated, act in (
        (2688, 1856, 128, 6, False, "relu2"), (4096, 768, 72, 10, True, "silu"),
    ):
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(dtype)
        w1 = (torch.randn(experts, (2 if gated else 1) * inter, hidden, device=dev, generator=g)
              / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=dev, generator=g) / inter**0.5).to(dtype)
        ids = torch.rand(tokens, experts, device=dev, generator=g).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device=dev, generator=g)
        got = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act)
        few = min(tokens, 16)
        want = _loop64(x[:few], w1, w2, ids[:few], weights[:few], gated, act)
        err = ((got[:few].double() - want).norm() / want.norm()).item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), err  # fp32: ieee products
        graph = torch.cuda.CUDAGraph()
        out = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act)
        with torch.cuda.graph(graph):
            out = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)
