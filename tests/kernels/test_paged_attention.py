"""Batched paged attention for uniform steps against the per-row reference: NaN-poisoned
caches (unwritten slots must never leak), variable context lengths, shared and scattered
blocks, verify rows of several tokens, grouped-query heads. The Triton kernel against
its torch twin and the per-row reference, under the race checker and in every program
order, and the attention layer with the kernel against the layer with the twin."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.config import KernelPolicy
from hybridserve.kernels import paged_attention
from hybridserve.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_decode_triton,
)
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.layers.attention import paged_attention_reference


def _ref_args(batch):
    """The per-row twin's step arguments from a batch."""
    return batch.query_start, batch.context_lens, batch.block_tables, batch.positions


def _tile_args(batch):
    """The prefill kernel's step arguments from a batch."""
    return batch.query_start, batch.num_computed, batch.block_tables, batch.positions

def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _step(g, rows, q, heads, num_kv, dim, block_size, dtype, max_ctx=40, extra_width=0):
    """A uniform step over a NaN-poisoned cache: ``rows`` rows of ``q`` tokens with random
    contexts (at least ``q``, below ``max_ctx``) in scattered blocks; block tables
    ``extra_width`` blocks wider than the longest row needs (-1 padded, as a replayed
    graph's are)."""
    num_blocks = 64 + rows * (-(-max_ctx // block_size))
    k_cache = torch.full((num_blocks, block_size, num_kv, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    ctx = [int(torch.randint(q, max_ctx, (), generator=g)) for _ in range(rows)]
    width = max(-(-c // block_size) for c in ctx) + extra_width
    tables = torch.full((rows, width), -1, dtype=torch.int32)
    positions, slots = [], []
    for r, c in enumerate(ctx):
        n_blocks = -(-c // block_size)
        blocks = [perm.pop() for _ in range(n_blocks)]
        tables[r, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(c):  # only the row's context is ever written
            slot = blocks[pos // block_size] * block_size + pos % block_size
            k_cache.view(-1, num_kv, dim)[slot] = torch.randn(num_kv, dim, generator=g).to(dtype)
            v_cache.view(-1, num_kv, dim)[slot] = torch.randn(num_kv, dim, generator=g).to(dtype)
        for pos in range(c - q, c):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    qs = list(range(0, rows * q + 1, q))
    batch = ForwardBatch(
        query_start=qs, num_computed=[c - q for c in ctx], positions=torch.tensor(positions),
        context_lens=ctx, block_tables=tables, slot_mapping=torch.tensor(slots),
        state_in_page=[-1] * rows, state_out_row=[], state_out_offset=[], state_out_page=[],
    )
    queries = torch.randn(rows * q, heads, dim, generator=g).to(dtype)
    return queries, k_cache, v_cache, batch


@pytest.mark.parametrize("rows,q,heads,num_kv", [(5, 1, 4, 2), (3, 4, 6, 3), (1, 1, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_matches_per_row_reference(rows, q, heads, num_kv, dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    queries, k_cache, v_cache, batch = _step(g, rows, q, heads, num_kv, 8, 4, dtype)
    want = paged_attention_reference(queries, k_cache, v_cache, *_ref_args(batch), 0.3)
    got = paged_attention_decode_reference(
        queries, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.positions, 0.3
    )
    assert not got.isnan().any()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    fused = paged_attention_decode(
        queries, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.positions, 0.3
    )
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)


def _triton(queries, k_cache, v_cache, batch, scale, block_n=None, dtype=None, splits=None):
    out = torch.full_like(queries, float("nan"))  # every element must be written
    got = paged_attention_decode_triton(
        queries, k_cache, v_cache, batch.block_tables, batch.positions, scale,
        block_n=block_n, out=out, splits=splits,
    )
    assert got is out
    assert not got.isnan().any()
    return got


@pytest.mark.parametrize(
    "rows,q,heads,num_kv,dim,block_size,block_n",
    [
        (5, 1, 8, 2, 8, 4, 16),  # decode, 4 query heads per KV head, several key tiles
        (3, 4, 6, 3, 16, 4, 16),  # verify rows (q = 1 + 3): causal among the new tokens
        (4, 3, 4, 4, 12, 8, None),  # no grouping, head dim not a power of two, one tile
        (1, 1, 2, 1, 8, 16, 16),  # one row
    ],
)
def test_triton_matches_twin_and_per_row_reference_race_free(
    rows, q, heads, num_kv, dim, block_size, block_n
):
    from hybridserve.testing import racecheck

    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(
        g, rows, q, heads, num_kv, dim, block_size, torch.float32, max_ctx=45, extra_width=2
    )
    scale = dim**-0.5
    want = paged_attention_reference(queries, k_cache, v_cache, *_ref_args(batch), scale)
    twin = paged_attention_decode_reference(
        queries, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.positions, scale
    )
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with racecheck.record_launches() as rec:
        got = _triton(queries, k_cache, v_cache, batch, scale, block_n)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
    # The kernel only reads the caches.
    assert torch.equal(k_cache.nan_to_num(7.0), k_before.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_before.nan_to_num(7.0))


def test_triton_bf16_cache_against_float64_reference():
    """bf16 queries and cache (the model's dtype on the GPU): the 16-bit score product."""
    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(g, 4, 2, 8, 2, 32, 4, torch.bfloat16)
    want = paged_attention_reference(
        queries.double(), k_cache.double(), v_cache.double(), *_ref_args(batch), 0.2
    )
    got = _triton(queries, k_cache, v_cache, batch, 0.2, block_n=16)
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-2, err


@pytest.mark.parametrize("q", [1, 3])
def test_triton_reads_strided_positions_and_tables(q):
    """Positions and block tables as a replayed decode graph passes them: column slices
    of one wider int64 buffer (positions with a stride, tables cast to int32)."""
    g = torch.Generator().manual_seed(_seed())
    rows, heads, num_kv, dim, bs = 4, 4, 2, 8, 4
    queries, k_cache, v_cache, batch = _step(g, rows, q, heads, num_kv, dim, bs, torch.float32)
    width = batch.block_tables.shape[1]
    meta = torch.randint(0, 10**6, (rows + 3, 2 * q + width + 5), dtype=torch.int64)
    meta[:rows, q : 2 * q] = batch.positions.view(rows, q)
    meta[:rows, 2 * q + 5 :] = batch.block_tables
    m = meta[:rows]
    positions = m[:, q : 2 * q].reshape(-1)
    tables = m[:, 2 * q + 5 :].to(torch.int32)
    if q == 1:
        assert positions.stride(0) == meta.shape[1]  # the case a contiguous read gets wrong
    out = torch.full_like(queries, float("nan"))
    got = paged_attention_decode_triton(
        queries, k_cache, v_cache, tables, positions, 0.3, block_n=16, out=out
    )
    want = paged_attention_reference(queries, k_cache, v_cache, *_ref_args(batch), 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_graph_step_with_triton_attention_matches_eager(tiny_nemotron, monkeypatch, count_calls):
    """Generation through the decode-graph step (its static buffer, run without capture
    on the CPU) with the attention layer on the Triton kernel gives the tokens of the
    eager step on the torch twin: the kernel reads the graph's inputs as laid out."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.engine.engine_core import EngineCore

    g = torch.Generator().manual_seed(_seed())
    prompts = [torch.randint(3, 256, (5 + 4 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    calls = count_calls(paged_attention, "paged_attention_decode_triton")
    results = {}
    for name, graphs, on in (("graph_triton", True, True), ("eager_twin", False, False)):
        policy = KernelPolicy(decode_attention="triton" if on else "reference")
        llm = LLM(tiny_nemotron, kernel_policy=policy)
        if graphs:
            eng = llm.engine
            llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                                    eng.eos_token_ids, enforce_eager=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
        if graphs:
            assert llm.engine.runner.graphs.counters["graph_steps"] > 0
            assert calls  # the kernel ran inside the graph step
            launched = len(calls)
    assert len(calls) == launched  # ... and never on the eager twin's side
    assert results["graph_triton"] == results["eager_twin"]


@pytest.mark.parametrize(
    "rows,q,heads,num_kv,dim,block_size,splits",
    [
        (3, 1, 8, 2, 8, 4, 2),  # decode, grouped heads
        (2, 4, 6, 3, 16, 4, 3),  # verify rows: a split's tile may hold no key a line sees
        (4, 1, 2, 2, 8, 8, 7),  # more splits than short rows have tiles: empty splits
    ],
)
def test_split_keys_match_unsplit_and_reference_race_free(
    rows, q, heads, num_kv, dim, block_size, splits
):
    """Keys split across programs (flash-decoding) and merged by a second launch: the
    same attention as one program per (row, KV head), up to float32 summation order;
    both launches race free."""
    from hybridserve.testing import racecheck

    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(
        g, rows, q, heads, num_kv, dim, block_size, torch.float32, max_ctx=70, extra_width=1
    )
    scale = dim**-0.5
    want = paged_attention_reference(queries, k_cache, v_cache, *_ref_args(batch), scale)
    whole = _triton(queries, k_cache, v_cache, batch, scale, block_n=16, splits=1)
    with racecheck.record_launches() as rec:
        got = _triton(queries, k_cache, v_cache, batch, scale, block_n=16, splits=splits)
    assert len(rec.reports) == 2 and all(r.clean for r in rec.reports), str(rec.reports)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


def test_split_keys_independent_of_program_order():
    from hybridserve.testing import racecheck

    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(g, 3, 2, 4, 2, 8, 4, torch.float32, max_ctx=60)
    results = []
    for order in ("forward", "reversed", "shuffled"):
        with racecheck.record_launches(record=False, order=order, seed=3):
            results.append(_triton(queries, k_cache, v_cache, batch, 0.35, block_n=16, splits=3))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_decode_splits_rule(monkeypatch):
    """Splits only where (row, KV head) programs leave multiprocessors idle, each split
    walking at least MIN_SPLIT_KEYS keys; never off CUDA."""
    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda", 0)
    keys = paged_attention.MIN_SPLIT_KEYS
    assert paged_attention.decode_splits(1, 8, 32768, cuda) == 33  # two programs an SM
    assert paged_attention.decode_splits(1, 8, 4 * keys, cuda) == 4  # short context
    assert paged_attention.decode_splits(1, 8, keys - 1, cuda) == 1
    assert paged_attention.decode_splits(64, 8, 32768, cuda) == 1  # the chip is full
    assert paged_attention.decode_splits(16, 8, 32768, cuda) == 2  # half full or more
    assert paged_attention.decode_splits(16, 8, keys - 1, cuda) == 1
    assert paged_attention.decode_splits(17, 8, 32768, cuda) == 1  # full
    assert paged_attention.decode_splits(8, 8, 32768, cuda) == 5  # 64 of 132: splits
    assert paged_attention.decode_splits(1, 8, 32768, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="splits"):
        g = torch.Generator().manual_seed(0)
        queries, k_cache, v_cache, batch = _step(g, 1, 1, 2, 2, 8, 4, torch.float32)
        _triton(queries, k_cache, v_cache, batch, 0.3, splits=0)


def test_triton_independent_of_program_order():
    from hybridserve.testing import racecheck

    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(g, 4, 2, 4, 2, 8, 4, torch.float32)
    results = []
    for order in ("forward", "reversed", "shuffled"):
        with racecheck.record_launches(record=False, order=order, seed=5):
            results.append(_triton(queries, k_cache, v_cache, batch, 0.35, block_n=16))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_triton_padding_rows_on_a_scratch_block():
    """Rows shaped as a replayed graph pads them: positions 0 .. q - 1 on a zeroed scratch
    block, the rest of the table -1. They attend to their own keys only; real rows are
    unaffected by them."""
    g = torch.Generator().manual_seed(_seed())
    rows, q, heads, num_kv, dim, bs = 3, 2, 4, 2, 8, 4
    queries, k_cache, v_cache, batch = _step(g, rows, q, heads, num_kv, dim, bs, torch.float32)
    used = set(batch.block_tables[batch.block_tables >= 0].tolist())
    scratch = next(b for b in range(k_cache.shape[0] - 1, -1, -1) if b not in used)
    k_cache[scratch] = 0.0
    v_cache[scratch] = 0.0
    k_cache[scratch, :q] = torch.randn(q, num_kv, dim, generator=g)
    v_cache[scratch, :q] = torch.randn(q, num_kv, dim, generator=g)
    pad = 2
    tables = torch.full((rows + pad, batch.block_tables.shape[1]), -1, dtype=torch.int32)
    tables[:rows] = batch.block_tables
    tables[rows:, 0] = scratch
    positions = torch.cat([batch.positions, torch.arange(q).repeat(pad)])
    padded_q = torch.cat([queries, torch.randn(pad * q, heads, dim, generator=g)])
    out = torch.full_like(padded_q, float("nan"))
    got = paged_attention_decode_triton(
        padded_q, k_cache, v_cache, tables, positions, 0.3, block_n=16, out=out
    )
    assert not got.isnan().any()
    want = paged_attention_reference(queries, k_cache, v_cache, *_ref_args(batch), 0.3)
    torch.testing.assert_close(got[: rows * q], want, rtol=1e-5, atol=1e-5)
    twin = paged_attention_decode_reference(
        padded_q, k_cache, v_cache, tables, [*batch.context_lens, *[q] * pad], positions, 0.3
    )
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q", [1, 3])
def test_attention_layer_triton_path_matches_twin_path(tmp_path, monkeypatch, q, count_calls):
    """A whole model step (attention and Mamba layers, float32) with the attention
    layer's uniform path on the Triton kernel equals the step on the torch twin."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver

    from hybridserve.models.loader import load_model, with_kernel_policy
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=_seed() % 1000, layers="M*-*")
    model = load_model(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(_seed())
    prompts = {i: torch.randint(3, 256, (5 + 7 * i,), generator=g).tolist() for i in range(3)}
    nxt = {i: torch.randint(3, 256, (q,), generator=g).tolist() for i in range(3)}
    calls = count_calls(paged_attention, "paged_attention_decode_triton")
    results = []
    for on in (True, False):
        policy = KernelPolicy(decode_attention="triton" if on else "reference")
        d = PagedDriver(with_kernel_policy(model, policy))
        d.step([(i, p) for i, p in prompts.items()])
        logits, _ = d.step([(i, t) for i, t in nxt.items()], {0: [0]} if q > 1 else None)
        results.append(logits)
    assert len(calls) == 2  # two attention layers, one uniform step, kernel on
    assert not results[0].isnan().any()
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("rows,q", [(1, 1), (2, 4)])
def test_gpu_split_keys_at_long_context(rows, q, record_property):
    """Compiled on CUDA at the 8B attention shape (32 query heads over 8 KV heads of 128)
    with bf16 caches and 5,000-key contexts: the automatic split count is above one, and
    the split result is as close to a float64 evaluation as the unsplit one."""
    g = torch.Generator().manual_seed(_seed())
    queries, k_cache, v_cache, batch = _step(
        g, rows, q, 32, 8, 128, 16, torch.bfloat16, max_ctx=5000)
    args = [t.cuda() for t in (queries, k_cache, v_cache, batch.block_tables, batch.positions)]
    splits = paged_attention.decode_splits(rows, 8, args[3].shape[1] * 16, args[0].device)
    assert splits > 1
    ref = paged_attention_reference(
        queries.double(), k_cache.double(), v_cache.double(), *_ref_args(batch), 128**-0.5)
    errs = {}
    for name, n in (("split", None), ("unsplit", 1)):
        got = paged_attention_decode_triton(*args[:5], 128**-0.5, splits=n).double().cpu()
        errs[name] = ((got - ref).norm() / ref.norm()).item()
        record_property(f"{name}_rel_err", errs[name])
    print(f"{splits} splits: {errs}")
    assert errs["split"] < 1e-2 and errs["split"] <= 1.5 * errs["unsplit"] + 1e-6
