"""The chunked gated delta rule and its chunk-state orchestration (the twin of the planned
fla-core prefill) against the token recurrence, float64, rows of any length with zero and
paged initial states and states requested on and off the chunk grid."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from hybridserve.kernels.gdn import gated_delta_rule_reference, gdn_gates, l2_normalize
from hybridserve.kernels.gdn_chunked import (
    chunk_gated_delta_rule_reference,
    chunk_scan_fla,
    chunk_scan_reference,
    fla_chunk_scan_available,
    gdn_prefill,
)
from hybridserve.kernels.gdn_varlen import VarlenPlan, gdn_varlen_update_reference


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
    q, k, v, _, _ = _seq(g, t, 2, 4, 8, 6)
    # The raw gate inputs (the projections'), as the packed path hands them over.
    a = torch.randn(t, 4, generator=g, dtype=torch.float64) * 1.5
    b = torch.randn(t, 4, generator=g, dtype=torch.float64) * 2
    kw = dict(A_log=torch.randn(4, generator=g, dtype=torch.float64) * 0.5,
              dt_bias=torch.randn(4, generator=g, dtype=torch.float64) * 0.5)
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
    want = gdn_varlen_update_reference(q, k, v, a, b, want_cache, query_start, in_pages,
                                       out_pages, **kw)
    plan = VarlenPlan(num_rows=len(lengths), query_start=query_start, in_pages=in_pages,
                      token_out_pages=out_pages, token_row=torch.empty(0),
                      query_start_host=tuple(qs), token_out_pages_host=tuple(out_pages.tolist()))
    got = gdn_prefill(q, k, v, a, b, got_cache, plan, chunk=8, **kw)
    assert (got - want).abs().max() < 1e-10
    # The gates went in as the formula gives them (float64 here, compute dtype).
    gd, beta = gdn_gates(a, b, kw["A_log"], kw["dt_bias"])
    assert gd.dtype == torch.float64 and (gd < 0).all() and ((beta > 0) & (beta < 1)).all()
    written = out_pages[out_pages >= 0].long()
    assert (got_cache[written] - want_cache[written]).abs().max() < 1e-10
    others = [p for p in range(pages) if p not in set(written.tolist())]
    assert torch.equal(got_cache[others], cache[others])
    # The next layer of the step (the same plan, its layout planned once): the same again;
    # a plan of other rows is planned afresh.
    again = cache.clone()
    assert torch.equal(gdn_prefill(q, k, v, a, b, again, plan, chunk=8, **kw), got)
    assert torch.equal(again, got_cache)
    n = qs[2]
    first = dataclasses.replace(  # the first two rows only
        plan, num_rows=2, query_start=query_start[:3], in_pages=in_pages[:2],
        token_out_pages=out_pages[:n], query_start_host=tuple(qs[:3]),
        token_out_pages_host=tuple(out_pages[:n].tolist()))
    want_first = gdn_varlen_update_reference(
        q[:n], k[:n], v[:n], a[:n], b[:n], cache.clone(), query_start[:3], in_pages[:2],
        out_pages[:n], **kw)
    got_first = gdn_prefill(q[:n], k[:n], v[:n], a[:n], b[:n], cache.clone(), first, chunk=8,
                            **kw)
    assert (got_first - want_first).abs().max() < 1e-10


# --------------------------------------------------------------------------------------
# fla-core's chunked scan (chunk_scan_fla) against the twin
# --------------------------------------------------------------------------------------

# The fla-core modules whose kernels the scan's pieces launch.
_FLA_KERNEL_MODULES = (
    "fla.ops.common.chunk_delta_h",
    "fla.ops.common.chunk_o",
    "fla.ops.common.chunk_scaled_dot_kkt",
    "fla.ops.gated_delta_rule.chunk_fwd",
    "fla.ops.gated_delta_rule.wy_fast",
    "fla.ops.utils.cumsum",
    "fla.ops.utils.solve_tril",
)


class _LoopIndex(int):
    """A loop index that also answers ``.to(dtype)``, as a Triton scalar does."""

    def to(self, *args, **kwargs):
        return self


@pytest.fixture
def fla_on_the_interpreter(monkeypatch):
    """fla-core's kernels on the CPU through Triton's interpreter, with two shims for
    what the interpreter lacks (neither touches what the kernels compute): autotuned
    kernels keep their first config (benchmarking the configs needs a GPU), and the
    index of a ``range`` loop inside a kernel, a plain int under the interpreter,
    answers ``.to(tl.int64)`` (fla-core's state pass calls it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs fla-core's kernels on the CPU: TRITON_INTERPRET=1")
    import importlib

    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs",
                        lambda self, *a, **kw: prune(self, *a, **kw)[:1])

    def loop_range(*bounds):
        return (_LoopIndex(i) for i in range(*(int(b) for b in bounds)))

    for name in _FLA_KERNEL_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "range", loop_range, raising=False)


def _rows(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _check_fla_scan(device, dtype, bound, lengths, hk, hv, dk, dv):
    """chunk_scan_fla against the twin in float64 (outputs and every chunk and final
    state), the inputs as the mixer hands them over (float32)."""
    g = torch.Generator().manual_seed(_seed())
    q, k, v, gd, beta = _seq(g, sum(lengths), hk, hv, dk, dv)
    init = torch.randn(len(lengths), hv, dk, dv, generator=g, dtype=torch.float64)
    cu = _rows(lengths)
    want_o, want_chunks, want_final = chunk_scan_reference(q, k, v, gd, beta, cu, init, 64)
    # The twin's layout: every row's chunk-start states in order (the first its initial
    # state), then one final state per row.
    assert want_chunks.shape[0] == sum(-(-n // 64) for n in lengths)
    assert torch.equal(want_chunks[0], init[0])
    args = [x.float().to(device) for x in (q, k, v, gd, beta)]
    o, chunks, final = chunk_scan_fla(*args, cu, init.float().to(device), 64, dtype=dtype)
    assert o.dtype == final.dtype == torch.float32 and chunks.dtype == dtype
    assert (o.shape, chunks.shape, final.shape) == (want_o.shape, want_chunks.shape,
                                                     want_final.shape)

    def rel(got, want):
        return ((got.cpu().double() - want).abs().max() / want.abs().max()).item()

    err_o, err_s = rel(o, want_o), max(rel(chunks, want_chunks), rel(final, want_final))
    assert err_o < bound and err_s < bound, (err_o, err_s)


def _check_fla_prefill(device, dtype, bound, lengths, tail_rule):
    """gdn_prefill on fla-core's scan against the token recurrence's twin in float64:
    outputs, every requested state (on the 64-token grid, off it, row ends) in its page,
    no other page touched; rows from pages and from zeros, an empty row."""
    g = torch.Generator().manual_seed(_seed())
    hk, hv, dk, dv = 2, 4, 64, 32
    t = sum(lengths)
    q, k, v, _, _ = _seq(g, t, hk, hv, dk, dv)
    a = torch.randn(t, hv, generator=g, dtype=torch.float64) * 1.5
    b = torch.randn(t, hv, generator=g, dtype=torch.float64) * 2
    kw = dict(A_log=torch.randn(hv, generator=g, dtype=torch.float64) * 0.5,
              dt_bias=torch.randn(hv, generator=g, dtype=torch.float64) * 0.5)
    rows = len(lengths)
    qs = _rows(lengths)
    in_pages = torch.tensor([r if r % 2 == 0 else -1 for r in range(rows)], dtype=torch.int32)
    out_pages = torch.full((t,), -1, dtype=torch.int32)
    free = iter(range(rows, 10 * rows + t))
    for r, n in enumerate(lengths):
        for off in range(n):
            if (off + 1) % 64 == 0 or off in (0, 5, 70) or off == n - 1:
                out_pages[qs[r] + off] = next(free)
    pages = int(out_pages.max()) + 2
    cache = torch.randn(pages, hv, dk, dv, generator=g, dtype=torch.float64)
    cache[out_pages[out_pages >= 0].long()] = float("nan")
    query_start = torch.tensor(qs, dtype=torch.int32)
    want_cache = cache.clone()
    want = gdn_varlen_update_reference(q, k, v, a, b, want_cache, query_start, in_pages,
                                       out_pages, **kw)
    plan = VarlenPlan(num_rows=rows, query_start=query_start.to(device),
                      in_pages=in_pages.to(device), token_out_pages=out_pages.to(device),
                      token_row=torch.empty(0), query_start_host=tuple(qs),
                      token_out_pages_host=tuple(out_pages.tolist()))
    got_cache = cache.float().to(device)
    scan = functools.partial(chunk_scan_fla, dtype=dtype)
    ops = [x.float().to(device) for x in (q, k, v, a, b)]
    gate = {n: x.float().to(device) for n, x in kw.items()}
    fresh = got_cache.clone()
    got = gdn_prefill(*ops, got_cache, plan, scan, tail_rule, 64, **gate)
    # The next layer of the step: the step's layout and fla-core's row tensors reused.
    assert torch.equal(gdn_prefill(*ops, fresh, plan, scan, tail_rule, 64, **gate), got)
    assert torch.equal(fresh.nan_to_num(), got_cache.nan_to_num())
    got_cache = got_cache.cpu().double()
    assert ((got.cpu().double() - want).abs().max() / want.abs().max()).item() < bound
    written = out_pages[out_pages >= 0].long()
    err = (got_cache[written] - want_cache[written]).abs().max() / want_cache[written].abs().max()
    assert err.item() < bound
    others = [p for p in range(pages) if p not in set(written.tolist())]
    assert torch.equal(got_cache[others], cache[others].float().double())


@pytest.mark.skipif(not fla_chunk_scan_available(), reason="needs fla-core")
@pytest.mark.parametrize("lengths,dk", [([130, 64, 1, 70], 32), ([65, 3], 128)])
def test_fla_chunk_scan_matches_the_twin_on_the_cpu(fla_on_the_interpreter, lengths, dk):
    """fla-core's kernels run as written (float32, the interpreter's exact dots): equal to
    the twin to float32 rounding, grouped keys (2 key heads, 4 value heads), rows of one,
    part of and whole chunks, a key dim over fla-core's 64-wide state blocks."""
    _check_fla_scan("cpu", torch.float32, 1e-5, lengths, 2, 4, dk, 16)


@pytest.mark.skipif(not fla_chunk_scan_available(), reason="needs fla-core")
def test_fla_prefill_matches_the_token_recurrence_on_the_cpu(fla_on_the_interpreter):
    _check_fla_prefill("cpu", torch.float32, 1e-5, [150, 0, 64, 7], gdn_varlen_update_reference)


_ON_GPU_WITH_FLA = pytest.mark.skipif(
    not torch.cuda.is_available() or not fla_chunk_scan_available(), reason="needs CUDA and fla-core"
)


@pytest.mark.gpu
@_ON_GPU_WITH_FLA
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_fla_chunk_scan_matches_the_twin(dtype, bound):
    """fla-core's pieces against the twin (float64) on the GPU: TF32 dots for float32
    inputs; the bf16 level for bfloat16 (docs/design-notes.md, "Kernel choices":
    3e-3 / 2e-3 relative on the output / final state of the public call)."""
    _check_fla_scan("cuda", dtype, bound, [200, 64, 1, 130], 2, 4, 128, 64)


@pytest.mark.gpu
@_ON_GPU_WITH_FLA
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_fla_prefill_matches_the_token_recurrence(dtype, bound):
    """The engine's fla path: gdn_prefill on chunk_scan_fla with the token kernel's tails."""
    from hybridserve.kernels.gdn_varlen import gdn_varlen_update

    _check_fla_prefill("cuda", dtype, bound, [700, 0, 64, 129], gdn_varlen_update)
