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


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


# --------------------------------------------------------------------------------------
# Sorting by expert
# --------------------------------------------------------------------------------------


SORTS = {
    "kernel": lambda ids, e, bm: moe.sort_by_expert(ids, e, bm, chunk=8),
    "reference": moe.sort_by_expert_reference,
}


@pytest.mark.parametrize("impl", [pytest.param("kernel", marks=interpreted), "reference"])
@pytest.mark.parametrize("kind", ["random", "one_expert", "few_experts"])
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (9, 4), (40, 16), (0, 16)])
def test_sort_by_expert_blocks_are_whole_and_homogeneous(impl, kind, tokens, block_m):
    g = torch.Generator().manual_seed(_seed())
    experts, top_k = 7, 3
    ids, _ = _routing(g, tokens, experts, top_k, kind)
    ids = ids.reshape(tokens, top_k)
    b = SORTS[impl](ids, experts, block_m)
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


@interpreted
@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m,chunk",
    [(1, 6, 128, 16, 64), (13, 3, 5, 4, 4), (40, 3, 7, 16, 8), (50, 2, 72, 16, 16),
     (21, 2, 1, 8, 8), (33, 1, 9, 32, 64)],
)
@pytest.mark.parametrize("kind", ["random", "one_expert", "few_experts"])
def test_sort_kernel_equals_its_twin(tokens, top_k, experts, block_m, chunk, kind):
    """Every row and block expert equal to the torch sort's, bit for bit, whatever the
    chunk (one program or many, a partial last chunk, more blocks than assignments)."""
    g = torch.Generator().manual_seed(_seed())
    if kind == "one_expert" and experts < 3 + top_k:
        kind = "random"
    if kind == "few_experts" and experts < 2 * top_k + 1:
        kind = "random"
    top_k = min(top_k, experts)
    ids, _ = _routing(g, tokens, experts, top_k, kind)
    for dtype in (torch.int64, torch.int32):
        got = moe.sort_by_expert(ids.to(dtype), experts, block_m, chunk=chunk)
        want = moe.sort_by_expert_reference(ids, experts, block_m)
        assert torch.equal(got.rows, want.rows)
        assert torch.equal(got.block_expert, want.block_expert)


@interpreted
def test_sort_kernel_race_free_over_many_programs():
    g = torch.Generator().manual_seed(_seed())
    ids, _ = _routing(g, 23, 9, 3, "random")
    with racecheck.record_launches() as rec:
        moe.sort_by_expert(ids, 9, 4, chunk=8)
    (report,) = rec.reports
    assert report.grid[0] > 2 and report.clean, str(report)
    report = racecheck.run_launcher_in_orders(
        lambda ids: moe.sort_by_expert(ids, 9, 4, chunk=8).rows, lambda: dict(ids=ids),
        seed=_seed() % 1000,
    )
    assert report.consistent, report.differences


def test_sort_refuses_bad_sizes():
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        moe.sort_by_expert(ids, 4, 12)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        moe.sort_by_expert(ids, 4, 16, chunk=48)
    with pytest.raises(ValueError, match="topk_ids must be"):
        moe.sort_by_expert_reference(ids[0], 4, 16)


# --------------------------------------------------------------------------------------
# The tile table
# --------------------------------------------------------------------------------------

H200_SMS = 132
NEMOTRON = dict(top_k=6, num_experts=128, n_up=1856, n_down=2688, gated=False)
GRANITE = dict(top_k=10, num_experts=72, n_up=768, n_down=4096, gated=True)


def _programs(tiles, tokens, shape, n):
    """Programs of one launch that hold rows at most (blocks that can be non-empty)."""
    a = tokens * shape["top_k"]
    return min(shape["num_experts"], a) * triton.cdiv(n, tiles)


@pytest.mark.parametrize("shape", [NEMOTRON, GRANITE], ids=["nemotron", "granite"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_decode_tiles_spread_the_weight_reads_over_every_sm(shape, tokens):
    t = moe.tile_table(tokens, **shape, itemsize=2, sms=H200_SMS)
    assert t.block_m == 16 and t.k == 64
    for n, cols in ((t.n, shape["n_up"]), (t.down_n, shape["n_down"])):
        # at least two programs per SM, or the narrowest tile there is
        assert _programs(n, tokens, shape, cols) >= 2 * H200_SMS or n == 16
        if n < 64:  # and no wider tile would have been enough
            assert _programs(2 * n, tokens, shape, cols) < 2 * H200_SMS


def test_tile_table_rows():
    nem, gra = dict(NEMOTRON), dict(GRANITE)
    one = moe.tile_table(1, **nem, itemsize=2, sms=H200_SMS)
    assert (one.block_m, one.n, one.down_n) == (16, 32, 32)  # 348 and 504 programs
    one = moe.tile_table(1, **gra, itemsize=2, sms=H200_SMS)
    assert (one.block_m, one.n, one.down_n) == (16, 16, 64)  # 480 and 640 programs
    assert moe.tile_table(16, **nem, itemsize=2, sms=H200_SMS).n == 64
    assert moe.tile_table(256, **nem, itemsize=2, sms=H200_SMS).block_m == 16  # 12 / expert
    assert moe.tile_table(256, **gra, itemsize=2, sms=H200_SMS).block_m == 32  # 36 / expert
    big = moe.tile_table(2048, **nem, itemsize=2, sms=H200_SMS)
    assert big == moe.Tiles(64, 128, 64, 8, 3)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("shape", [NEMOTRON, GRANITE], ids=["nemotron", "granite"])
def test_tiles_fit_shared_memory_and_keep_k(shape, itemsize):
    for tokens in (1, 3, 16, 64, 100, 256, 600):
        t = moe.tile_table(tokens, **shape, itemsize=itemsize, sms=H200_SMS)
        assert t.k == 64  # the K chunks (and so a token's sums) never change with the batch
        w = 2 if shape["gated"] else 1
        smem = t.num_stages * itemsize * t.k * (t.block_m + w * max(t.n, t.down_n))
        assert smem <= 200 * 1024, (tokens, t)
        assert t.num_stages <= (3 if itemsize == 4 else 5)


def test_tiles_parse():
    assert moe.Tiles.parse("16,32,64,4,5,64") == moe.Tiles(16, 32, 64, 4, 5, 64)
    assert moe.Tiles.parse("64,128,64,8,3").down_n == 128
    with pytest.raises(ValueError, match="power of two"):
        moe.Tiles.parse("16,48,64,4,3")
    with pytest.raises(ValueError, match="integers"):
        moe.Tiles.parse("16,x")


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
@pytest.mark.parametrize(
    "tiles",
    [moe.Tiles(16, 32, 16, 1, 1), moe.Tiles(32, 16, 32, 1, 1), moe.Tiles(16, 16, 64, 1, 1, 32)],
)
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(5, 3), (1, 2), (0, 2)])
def test_combine_matches_twin(dtype, tokens, top_k):
    """Each token's rows summed in order plus the shared expert's output (of the model's
    dtype), one rounding: equal to the twin in float32; bf16 results equal to the bit
    (the same float32 sums, rounded once)."""
    g = torch.Generator().manual_seed(_seed())
    hidden = 37
    out = torch.randn(tokens * top_k, hidden, generator=g)
    add = torch.randn(tokens, hidden, generator=g).to(dtype)
    for a in (None, add):
        got = moe.combine(out, top_k, dtype, a)
        want = moe.combine_reference(out, top_k, dtype, a)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        elif tokens:
            # The same float32 sum (up to its last bit) rounded once: at most one unit in
            # the last place of bf16 apart.
            assert (_bits(got).int() - _bits(want).int()).abs().max().item() <= 1
    with pytest.raises(ValueError, match="add must be"):
        moe.combine(out, top_k, dtype, add[:, :5] if tokens else torch.zeros(1, 5))
    with pytest.raises(ValueError, match="out must be float32"):
        moe.combine(out.double(), top_k, dtype)


@interpreted
def test_combine_race_free_and_order_independent():
    g = torch.Generator().manual_seed(_seed())
    out = torch.randn(4 * 3, 40, generator=g)
    add = torch.randn(4, 40, generator=g)
    with racecheck.record_launches() as rec:
        moe.combine(out, 3, torch.float32, add)
    (report,) = rec.reports
    assert report.clean and report.bytes_stored == 4 * 40 * 4, str(report)
    report = racecheck.run_launcher_in_orders(
        moe.combine, lambda: dict(out=out, top_k=3, dtype=torch.float32, add=add),
        seed=_seed() % 1000,
    )
    assert report.consistent, report.differences


@interpreted
@pytest.mark.parametrize("gated,act,kind", [(True, "silu", "random"), (False, "relu2", "one_expert")])
def test_whole_path_adds_the_shared_output(gated, act, kind):
    """``add`` (the shared expert's output) joins the float32 sum: equal to the loop's
    result plus it, and to the twin with it."""
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 7, 24, 20, 8, 3
    x, w1, w2 = _operands(g, tokens, hidden, inter, experts, gated)
    ids, weights = _routing(g, tokens, experts, top_k, kind)
    add = torch.randn(tokens, hidden, generator=g)
    kw = dict(gated=gated, activation=act)
    got = moe.moe_experts(x, w1, w2, ids, weights, tiles=TILES, add=add, **kw)
    want = _loop64(x, w1, w2, ids, weights, gated, act) + add.double()
    twin = moe.moe_experts_reference(x, w1, w2, ids, weights, add=add, **kw)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twin.double(), want, rtol=1e-5, atol=1e-5)


@interpreted
def _interpreter_dot_keeps_rows(bm: int, bk: int, bn: int, trials: int = 8) -> bool:
    """Whether the interpreter's ``tl.dot`` (NumPy's float32 matmul) gives a row of a
    ``[bm, bk] x [bk, bn]`` tile the same bits wherever the row sits and whatever the
    other rows hold. Not so on every host: on an AMD EPYC host NumPy's matmul rounds
    about a third of the rows of a 16 x 16 x 16 tile by their position."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(trials):
        a = rng.standard_normal((bm, bk)).astype(np.float32)
        b = rng.standard_normal((bk, bn)).astype(np.float32)
        full = a @ b
        for r in range(bm):
            alone = np.zeros_like(a)
            alone[0] = a[r]
            if not np.array_equal((alone @ b)[0], full[r]):
                return False
    return True


def _same_bits_alone_or_in_a_batch(device, dtype):
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, inter, experts, top_k = 13, 48, 40, 6, 2
    x, w1, w2 = (t.to(device) for t in _operands(g, tokens, hidden, inter, experts, True, dtype))
    ids, weights = (t.to(device) for t in _routing(g, tokens, experts, top_k, "random"))
    kw = dict(gated=True, activation="silu", tiles=TILES)
    full = moe.moe_experts(x, w1, w2, ids, weights, **kw)
    for i in (0, 7, 12):
        alone = moe.moe_experts(x[i : i + 1], w1, w2, ids[i : i + 1], weights[i : i + 1], **kw)
        assert torch.equal(alone[0], full[i]), i


@interpreted
def test_a_token_gets_the_same_bits_alone_or_in_a_batch():
    """Each row's products and its sum over its k experts run in a fixed order, whatever
    else the block holds: batch invariance, bit for bit (here, under the interpreter,
    where its matmul keeps a row's bits; the `gpu` test below compiles the kernels)."""
    if not _interpreter_dot_keeps_rows(16, 16, 16):
        pytest.skip("this host's NumPy matmul rounds a row by its place in the tile, so the "
                    "interpreter cannot show batch invariance: the gpu test does")
    _same_bits_alone_or_in_a_batch("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_token_gets_the_same_bits_alone_or_in_a_batch(dtype):
    """Batch invariance of the compiled kernels, bit for bit, at the same tiles."""
    _same_bits_alone_or_in_a_batch("cuda", dtype)


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
    assert [r.kernel for r in rec.reports] == [
        "_sort_kernel", "_grouped_up_kernel", "_grouped_down_kernel", "_combine_kernel"
    ]
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
        beside = torch.randn(5, 24)  # a dense MLP's output beside the block (Granite)
        torch.testing.assert_close(block(x, add=beside), loop + beside, rtol=1e-6, atol=1e-6)
        assert (len(kernel_calls), len(loop_calls)) == (0, 2)
        if INTERPRETED:
            adds = []
            real_combine = moe.combine

            def combine(out, top_k, dtype, add=None):
                adds.append(add is not None)
                return real_combine(out, top_k, dtype, add)

            monkeypatch.setattr(moe, "combine", combine)
            block.experts.kernels = "triton"  # what KernelPolicy(moe="triton") sets
            fused = block(x)
            assert (len(kernel_calls), len(loop_calls)) == (1, 2)
            assert adds == [True]  # the shared expert joined the kernels' final sum
            torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(block(x, add=beside), loop + beside, rtol=1e-5,
                                       atol=1e-5)
            assert (len(kernel_calls), len(loop_calls)) == (2, 2)
            # float64 has no kernel path: the loop.
            block64 = block.double()
            block64(x.double())
            assert (len(kernel_calls), len(loop_calls)) == (2, 3)
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
        # The compiled sort equals its torch twin; the step's tiles and the first
        # version's give the same outputs up to the rounding of h.
        for block_m in (16, 64):
            a, b = (f(ids, experts, block_m) for f in (moe.sort_by_expert,
                                                       moe.sort_by_expert_reference))
            assert torch.equal(a.rows, b.rows) and torch.equal(a.block_expert, b.block_expert)
        old = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act,
                              tiles=moe.legacy_tiles(tokens * top_k, x))
        diff = ((old.double() - got.double()).norm() / got.double().norm()).item()
        assert diff < (2e-2 if dtype == torch.bfloat16 else 1e-5), diff
        graph = torch.cuda.CUDAGraph()
        out = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act)
        with torch.cuda.graph(graph):
            out = moe.moe_experts(x, w1, w2, ids, weights, gated=gated, activation=act)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


def test_large_assignment_counts_take_the_torch_sort(monkeypatch):
    """Above ``COUNTING_SORT_MAX`` assignments (the counting sort's work grows as A^2) the
    torch sort runs: the same blocks, and the Triton sort is not launched."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (moe.COUNTING_SORT_MAX // 2 + 1, 2), generator=g)
    want = moe.sort_by_expert_reference(ids, 8, 16)

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the counting sort ran above COUNTING_SORT_MAX")

    monkeypatch.setattr(moe, "_sort_kernel", Refuse())
    got = moe.sort_by_expert(ids, 8, 16)
    assert torch.equal(got.rows, want.rows) and torch.equal(got.block_expert, want.block_expert)
    with pytest.raises(AssertionError, match="counting sort"):
        moe.sort_by_expert(ids[:8], 8, 16)
