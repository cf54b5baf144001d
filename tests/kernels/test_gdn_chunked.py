"""The chunked gated delta rule and its chunk-state orchestration (the twin of the planned
fla-core prefill) against the token recurrence, float64, rows of any length with zero and
paged initial states and states requested on and off the chunk grid."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.gdn import gated_delta_rule_reference, l2_normalize
from hybridserve.kernels.gdn_chunked import (
    chunk_gated_delta_rule_reference,
    gdn_prefill_reference,
)
from hybridserve.kernels.gdn_varlen import gdn_varlen_update_reference


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _seq(g, length, hk, hv, dk, dv):
    q = l2_normalize(torch.randn(length, hk, dk, generator=g, dtype=torch.float64)) * dk**-0.5
    k = l2_normalize(torch.randn(length, hk, dk, generator=g, dtype=torch.float64))
    v = torch.randn(length, hv, dv, generator=g, dtype=torch.float64)
    gd = -torch.rand(length, hv, generator=g, dtype=torch.float64)
    beta = torch.rand(length, hv, generator=g, dtype=torch.float64)
    return q, k, v, gd, beta


@pytest.mark.parametrize("length,chunk", [(1, 8), (8, 8), (29, 8), (70, 64), (5, 64)])
@pytest.mark.parametrize("initial", [False, True])
def test_chunked_form_equals_token_recurrence(length, chunk, initial):
    g = torch.Generator().manual_seed(_seed())
    q, k, v, gd, beta = _seq(g, length, 2, 4, 8, 6)
    init = torch.randn(4, 8, 6, generator=g, dtype=torch.float64) if initial else None
    o, chunk_states = chunk_gated_delta_rule_reference(q, k, v, gd, beta, init, chunk)
    offsets = [t - 1 for t in range(chunk, length + 1, chunk)] + [length - 1]
    want_o, want_states = gated_delta_rule_reference(q, k, v, gd, beta, init, offsets)
    assert (o - want_o).abs().max() < 1e-10
    # chunk_states[c] is the state before token c * chunk; the last, after the last token.
    for c in range(1, len(chunk_states) - 1):
        assert (chunk_states[c] - want_states[c - 1]).abs().max() < 1e-10
    assert (chunk_states[-1] - want_states[-1]).abs().max() < 1e-10
    if init is not None:
        assert torch.equal(chunk_states[0], init)


def test_prefill_orchestration_equals_token_by_token_path():
    g = torch.Generator().manual_seed(_seed())
    lengths = [1, 8, 0, 29, 17]
    t = sum(lengths)
    q, k, v, gd, beta = _seq(g, t, 2, 4, 8, 6)
    pages = 40
    cache = torch.randn(pages, 4, 8, 6, generator=g, dtype=torch.float64)
    in_pages = torch.tensor([3, -1, 5, -1, 7], dtype=torch.int32)
    out_pages = torch.full((t,), -1, dtype=torch.int32)
    free = iter(p for p in range(pages) if p not in (3, 5, 7))
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    for r, n in enumerate(lengths):
        # Every state on the chunk grid (8), a few off it, and the row end.
        for off in range(n):
            if (off + 1) % 8 == 0 or off in (0, 2, 11) or off == n - 1:
                out_pages[qs[r] + off] = next(free)
    cache[out_pages[out_pages >= 0].long()] = float("nan")
    query_start = torch.tensor(qs, dtype=torch.int32)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = gdn_varlen_update_reference(q, k, v, gd, beta, want_cache, query_start, in_pages,
                                       out_pages)
    got = gdn_prefill_reference(q, k, v, gd, beta, got_cache, query_start, in_pages, out_pages,
                                chunk_size=8)
    assert (got - want).abs().max() < 1e-10
    written = out_pages[out_pages >= 0].long()
    assert (got_cache[written] - want_cache[written]).abs().max() < 1e-10
    others = [p for p in range(pages) if p not in set(written.tolist())]
    assert torch.equal(got_cache[others], cache[others])
    with pytest.raises(ValueError, match="token-by-token"):
        gdn_prefill_reference(q, k, v, gd, beta, got_cache, query_start, in_pages, out_pages,
                              round_state=True)
