"""Batched paged attention for uniform steps against the per-row reference: NaN-poisoned
caches (unwritten slots must never leak), variable context lengths, shared and scattered
blocks, verify rows of several tokens, grouped-query heads."""

import pytest
import torch

from hybridserve.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_reference,
)
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.layers.attention import paged_attention_reference


def _step(g, rows, q, heads, num_kv, dim, block_size, dtype):
    num_blocks = 64
    k_cache = torch.full((num_blocks, block_size, num_kv, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    ctx = [int(torch.randint(q, 40, (), generator=g)) for _ in range(rows)]
    width = max(-(-c // block_size) for c in ctx)
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
    want = paged_attention_reference(queries, k_cache, v_cache, batch, 0.3)
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
