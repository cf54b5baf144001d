"""The fused chunked SSD scans: their torch twin against a token-by-token float64
recurrence, the Triton scans (the one-launch ``ssd_scan_fused``, the two-pass
``ssd_scan_two_pass`` and the three-launch ``ssd_scan_chunk_states``, which share the
twin) against the twin (strided grouped inputs, raw dt, bf16 inputs cast in registers,
states of any dtype) under the race checker and in several program orders, and :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill` through
them against the per-row chunked reference (chunk states, tails, repeated requests, empty
rows).

GPU tests (``-m gpu``) compile the kernel: run them with ``TRITON_INTERPRET=0``.
"""

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridserve.kernels import ssd_chunk_states
from hybridserve.kernels import ssd_two_pass as ssd_two_pass_module
from hybridserve.kernels.ssd import ssd_chunked_reference, ssd_recurrent_reference
from hybridserve.kernels.ssd_chunk_states import (
    ssd_scan_chunk_states,
    ssd_scan_chunk_states_reference,
)
from hybridserve.kernels.ssd_chunked import (
    CHUNK,
    _dot_split,
    chunk_starts,
    ssd_scan_fused,
    ssd_scan_fused_reference,
)
from hybridserve.kernels.ssd_two_pass import ssd_scan_two_pass, ssd_scan_two_pass_reference
from hybridserve.kernels.ssd_varlen import discretize_dt_varlen, plan_segments, ssd_prefill

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs Triton's CPU interpreter")
if INTERPRETED:
    from hybridserve.testing import racecheck

LIMIT = (0.05, 0.9)
# The Triton scans (one twin for all) and the launches each makes; "..._128": the output
# pass over chunks of 128 tokens (the state passes still store every 64).
SCANS = {"fused": (ssd_scan_fused, 1), "two_pass": (ssd_scan_two_pass, 2),
         "two_pass_128": (functools.partial(ssd_scan_two_pass, out_chunk=2 * CHUNK), 2),
         # The same arithmetic in its other form: operands loaded in their chunk, the
         # scratch in float32 (the defaults: one chunk ahead, halves for 16-bit inputs).
         "two_pass_plain": (functools.partial(ssd_scan_two_pass, prefetch=False,
                                              halves=False), 2),
         "chunk_states": (ssd_scan_chunk_states, 3),
         "chunk_states_128": (functools.partial(ssd_scan_chunk_states, out_chunk=2 * CHUNK),
                              3)}
# The scans with a scratch of chunk states read by the two-pass scan's output pass.
SCRATCH_SCANS = {"two_pass": ssd_scan_two_pass, "chunk_states": ssd_scan_chunk_states,
                 "two_pass_plain": SCANS["two_pass_plain"][0]}
# The "_128" scans are their kernels on another tile: they run by default where the
# output tile is what the test is about, ``slow`` where they repeat their path.
slow = pytest.mark.slow


def _scans(default_128: bool = False) -> list:
    """SCANS' names as parameters, the "_128" ones ``slow`` unless ``default_128``."""
    return [pytest.param(n, marks=() if default_128 or not n.endswith("_128") else slow)
            for n in SCANS]


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _step(g, lens, heads=4, head_dim=6, groups=2, d_state=5, dtype=torch.float32):
    """Raw inputs of a packed step, ``x``, ``B``, ``C`` and ``dt`` strided as the mixer's
    split of its projection leaves them; initial states; unclamped flags on a few tokens."""
    t = sum(lens)
    width = heads * head_dim + 2 * groups * d_state + heads + 3
    proj = torch.randn(t, width, generator=g, dtype=dtype)
    x = proj[:, : heads * head_dim].view(t, heads, head_dim)
    o = heads * head_dim
    B = proj[:, o : o + groups * d_state].view(t, groups, d_state)
    C = proj[:, o + groups * d_state : o + 2 * groups * d_state].view(t, groups, d_state)
    dt = proj[:, o + 2 * groups * d_state : o + 2 * groups * d_state + heads]
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 2 + 0.2)
    bias = torch.randn(heads, generator=g, dtype=dtype) * 0.5
    D = torch.randn(heads, generator=g, dtype=dtype)
    init = torch.randn(len(lens), heads, head_dim, d_state, generator=g, dtype=dtype)
    unclamped = torch.rand(t, generator=g) < 0.2
    return x, dt, A, B, C, D, bias, init, unclamped


def _slots(g, lens):
    """Distinct random rows for a random subset of chunk states and final states, and
    distinct rows of a second buffer for another random subset of chunk states."""
    chunks = chunk_starts([0, *torch.tensor(lens).cumsum(0).tolist()])[-1]
    rows = torch.randperm(chunks + len(lens) + 3, generator=g)
    keep = torch.rand(chunks + len(lens), generator=g) < 0.7
    picked = torch.where(keep, rows[: chunks + len(lens)], -1)
    start_slot = torch.where(torch.rand(chunks, generator=g) < 0.5,
                             torch.randperm(chunks + 2, generator=g)[:chunks], -1)
    if (start_slot < 0).all():  # at least one, whatever the draw
        start_slot[0] = chunks + 1
    return picked[:chunks], picked[chunks:], chunks + len(lens) + 3, start_slot, chunks + 2


def _discretized(dt, bias, limit, unclamped):
    d = F.softplus(dt + bias)
    if limit is None:
        return d
    return torch.where(unclamped[:, None], d, d.clamp(*limit))


@pytest.mark.parametrize("lens", [[70, 1, 130], [64], [5, 129]])
@pytest.mark.parametrize("limit", [LIMIT, None])
def test_twin_matches_the_token_recurrence_float64(lens, limit):
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, bias, init, unclamped = _step(g, lens, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    chunk_slot, final_slot, rows, start_slot, start_rows = _slots(g, lens)
    states = torch.full((rows, *init.shape[1:]), float("nan"), dtype=torch.float64)
    starts = torch.full((start_rows, *init.shape[1:]), float("nan"), dtype=torch.float64)
    y, dt_out = ssd_scan_fused_reference(
        x, dt, A, B, C, D, bias, cu, init, chunk_slot, final_slot, states,
        time_step_limit=limit, unclamped=unclamped, start_slot=start_slot, starts=starts,
    )
    want_dt = _discretized(dt, bias, limit, unclamped)
    torch.testing.assert_close(dt_out, want_dt, rtol=1e-12, atol=1e-12)
    firsts = chunk_starts(cu.tolist())
    written = set()
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_ref, st = ssd_recurrent_reference(x[s:e], want_dt[s:e], A, B[s:e], C[s:e], D, init[i])
        torch.testing.assert_close(y[s:e], y_ref, rtol=1e-9, atol=1e-9)
        before = [init[i], *[st[t] for t in range(CHUNK - 1, e - s - 1, CHUNK)]]
        assert len(before) == firsts[i + 1] - firsts[i]
        for j, state in enumerate(before):
            slot = int(chunk_slot[firsts[i] + j])
            if slot >= 0:
                torch.testing.assert_close(states[slot], state, rtol=1e-9, atol=1e-9)
                written.add(slot)
            if start_slot[firsts[i] + j] >= 0:
                torch.testing.assert_close(starts[int(start_slot[firsts[i] + j])], state,
                                           rtol=1e-9, atol=1e-9)
        if final_slot[i] >= 0:
            torch.testing.assert_close(states[int(final_slot[i])], st[-1], rtol=1e-9, atol=1e-9)
            written.add(int(final_slot[i]))
    unwritten = [r for r in range(rows) if r not in written]
    assert states[unwritten].isnan().all()
    assert starts[sorted(set(range(start_rows)) - set(start_slot.tolist()))].isnan().all()


KERNEL_CASES = [
    # lens, heads, head_dim, groups, d_state, initial, D, limit, unclamped, block_p
    ([70, 1, 130], 4, 6, 2, 5, True, True, LIMIT, True, 16),
    ([64, 65], 2, 20, 1, 17, False, False, None, False, 16),
    ([3], 6, 4, 3, 8, True, True, LIMIT, False, 32),
    ([129, 2, 64], 4, 33, 4, 4, True, False, (0.0, float("inf")), True, 32),
]


def _atol(want: torch.Tensor) -> float:
    """Absolute tolerance of the float32 kernel: 1e-4, or 1e-5 of the largest entry where
    that is more (sums of large terms rounded to about 2^-16 each: the split products)."""
    return max(1e-4, 1e-5 * float(want.nan_to_num(0.0).abs().max()))


def _run_both(case, g, dtype=torch.float32):
    lens, heads, head_dim, groups, d_state, has_init, has_d, limit, has_unc, block_p = case
    x, dt, A, B, C, D, bias, init, unclamped = _step(g, lens, heads, head_dim, groups,
                                                     d_state, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    chunk_slot, final_slot, rows, start_slot, start_rows = _slots(g, lens)
    kwargs = dict(time_step_limit=limit, unclamped=unclamped if has_unc else None)
    if has_init:  # the second output in the cases with initial states only
        kwargs["start_slot"] = start_slot
        kwargs["starts"] = torch.full((start_rows, heads, head_dim, d_state), float("nan"))
    args = [x, dt, A, B, C, D if has_d else None, bias, cu, init if has_init else None,
            chunk_slot, final_slot]
    wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    want_states = torch.full((rows, heads, head_dim, d_state), float("nan"), dtype=torch.float64)
    wide_kwargs = {**kwargs}
    if has_init:
        wide_kwargs["starts"] = kwargs["starts"].double()
    want = ssd_scan_fused_reference(*wide, want_states, **wide_kwargs)
    if has_init:
        want = (*want, wide_kwargs["starts"])
    states = torch.full((rows, heads, head_dim, d_state), float("nan"))
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    return args, kwargs, block_p, states, want, want_states, before


def _tiles(name: str, block_p: int | None) -> dict:
    """Tile arguments of scan ``name``: the two-pass scan's state pass and the
    chunk-state scan's local-state and state-passing kernels take tiles of their own
    (16 x 16 here, and 16 entries of the flattened state: several blocks of a state even
    for tiny shapes)."""
    state = {}
    if name.startswith("two_pass"):
        state = {"state_block_p": 16, "state_block_n": 16}
    if name.startswith("chunk_states"):
        state = {"local_block_p": 16, "local_block_n": 16, "pass_block": 16}
    return {"block_p": block_p, **state}


@interpreted
@pytest.mark.parametrize("case,dtype,name", [
    pytest.param(c, dt, n, marks=slow if n.endswith("_128") and (c, dt) not in
                 {(0, torch.float32), (3, torch.float32)} else (),
                 id=f"{c}-{str(dt).removeprefix('torch.')}-{n}")
    for n in SCANS
    for c, dt in [*((c, torch.float32) for c in range(len(KERNEL_CASES))), (0, torch.bfloat16)]])
def test_kernel_matches_twin_race_free(case, dtype, name):
    """Against the twin in float64 on the same values; bf16 inputs take the split
    products."""
    scan, launches = SCANS[name]
    g = torch.Generator().manual_seed(_seed())
    args, kwargs, block_p, states, want, want_states, before = _run_both(KERNEL_CASES[case], g,
                                                                         dtype)
    with racecheck.record_launches() as rec:
        y, dt_out = scan(*args, states, **kwargs, **_tiles(name, block_p))
    assert len(rec.reports) == launches, [str(r) for r in rec.reports]
    assert all(r.clean for r in rec.reports), [str(r) for r in rec.reports]
    torch.testing.assert_close(dt_out.double(), want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), want[0], rtol=1e-4, atol=_atol(want[0]))
    # Exactly the slotted rows are written, and to the twin's values.
    assert torch.equal(states.isnan(), want_states.isnan())
    torch.testing.assert_close(states.double().nan_to_num(7.0), want_states.nan_to_num(7.0),
                               rtol=1e-4, atol=_atol(want_states))
    if "starts" in kwargs:
        starts = kwargs["starts"]
        assert torch.equal(starts.isnan(), want[2].isnan()) and not starts.isnan().all()
        torch.testing.assert_close(starts.double().nan_to_num(7.0), want[2].nan_to_num(7.0),
                                   rtol=1e-4, atol=_atol(want[2]))
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # inputs only read


@interpreted
@pytest.mark.parametrize("name", SCANS)
def test_kernel_casts_bf16_inputs_in_registers(name):
    """bf16 projections (x, B, C and the raw dt): the kernel computes in float32 from the
    bf16 values, so it matches the twin run in float64 on the same values."""
    g = torch.Generator().manual_seed(_seed())
    case = ([70, 3], 4, 16, 2, 16, True, True, LIMIT, True, 16)
    args, kwargs, block_p, states, want, want_states, _ = _run_both(case, g, torch.bfloat16)
    y, dt_out = SCANS[name][0](*args, states, **kwargs, **_tiles(name, block_p))
    assert y.dtype == torch.float32 and dt_out.dtype == torch.float32
    torch.testing.assert_close(dt_out.double(), want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), want[0], rtol=1e-4, atol=_atol(want[0]))
    torch.testing.assert_close(states.double().nan_to_num(7.0), want_states.nan_to_num(7.0),
                               rtol=1e-4, atol=_atol(want_states))


@interpreted
@pytest.mark.parametrize("states_dtype", [torch.float32, torch.bfloat16])
def test_two_pass_forms_give_the_same_bits(states_dtype):
    """bf16 inputs: the default two-pass scan (operands one chunk ahead, the scratch as
    16-bit halves; float32 pages read from their slots) computes what the plain form
    does, bit for bit: the same products of the same halves."""
    g = torch.Generator().manual_seed(_seed())
    case = ([130, 3, 64], 4, 16, 2, 16, True, True, LIMIT, True, 16)
    args, kwargs, block_p, states, _, _, _ = _run_both(case, g, torch.bfloat16)
    states = states.to(states_dtype)
    tiles = _tiles("two_pass", block_p)
    got = {}
    for form in ({}, {"prefetch": False, "halves": False}, {"halves": False}):
        out = states.clone()
        y, dt_out = ssd_scan_two_pass(*args, out, **kwargs, **tiles, **form)
        got[str(form)] = (y, dt_out, out.nan_to_num(7.0))
    first, *rest = got.values()
    for other in rest:
        assert all(torch.equal(a, b) for a, b in zip(first, other))


@interpreted
@pytest.mark.parametrize("name", _scans())
def test_kernel_independent_of_program_order(name):
    g = torch.Generator().manual_seed(_seed())
    case = ([66, 1, 9], 4, 20, 2, 5, True, True, LIMIT, True, 16)
    args, kwargs, _, states, _, _, _ = _run_both(case, g, torch.bfloat16)  # split products
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "cu_seqlens", "initial_states",
             "chunk_slot", "final_slot")
    scan = SCANS[name][0]

    def launch(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot,
               final_slot, states, starts):
        return scan(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states,
                    chunk_slot, final_slot, states, **{**kwargs, "starts": starts},
                    **_tiles(name, 16))

    report = racecheck.run_launcher_in_orders(
        launch, lambda: {**dict(zip(names, args)), "states": states.clone(),
                         "starts": kwargs["starts"].clone()}
    )
    assert report.consistent, str(report)


@interpreted
@pytest.mark.parametrize("name", SCRATCH_SCANS)
@pytest.mark.parametrize("states_dtype,out_chunk", [
    pytest.param(dt, c, marks=() if (dt, c) in {(torch.bfloat16, CHUNK),
                                                (torch.float64, 2 * CHUNK)} else slow,
                 id=f"{str(dt).removeprefix('torch.')}-{c}")
    for dt in (torch.bfloat16, torch.float64) for c in (CHUNK, 2 * CHUNK)])
def test_scratch_scan_states_of_any_dtype(states_dtype, out_chunk, name):
    """States that are not float32 (bf16 pages, say): the output pass cannot read the
    chunk states back from their slots, so every chunk's goes through the scratch; the
    outputs stay those of float32 and the states are the twin's, rounded to the dtype."""
    g = torch.Generator().manual_seed(_seed())
    case = ([70, 1, 130], 4, 6, 2, 5, True, True, LIMIT, True, 16)
    args, kwargs, block_p, _, want, want_states, _ = _run_both(case, g, torch.bfloat16)
    states = torch.full(want_states.shape, float("nan"), dtype=states_dtype)
    with racecheck.record_launches() as rec:
        y, _ = SCRATCH_SCANS[name](*args, states, **kwargs, out_chunk=out_chunk,
                                   **_tiles(name, block_p))
    assert len(rec.reports) == SCANS[name][1] and all(r.clean for r in rec.reports)
    torch.testing.assert_close(y.double(), want[0], rtol=1e-4, atol=_atol(want[0]))
    assert torch.equal(states.isnan(), want_states.isnan())
    rounded = want_states.to(states_dtype).double().nan_to_num(7.0)
    tol = 1e-2 if states_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(states.double().nan_to_num(7.0), rounded, rtol=tol,
                               atol=tol * max(1.0, float(want_states.nan_to_num(0).abs().max())))


@interpreted
@pytest.mark.parametrize("name", SCRATCH_SCANS)
@pytest.mark.parametrize("every,out_chunk", [
    pytest.param(e, c, marks=() if (e, c) in {(True, CHUNK), (False, 2 * CHUNK)} else slow)
    for e in (True, False) for c in (CHUNK, 2 * CHUNK)])
def test_scratch_scan_reads_chunk_states_from_their_slots_or_the_scratch(every, out_chunk,
                                                                         name):
    """Every chunk state asked for (the output pass reads each from its slot) or none
    (each from the scratch): the same outputs as the twin either way, with output chunks
    of 64 or 128 tokens (rows of 5, 63, 64 and 129 tokens: odd chunk counts too)."""
    g = torch.Generator().manual_seed(_seed())
    case = ([64, 5, 129, 63], 4, 8, 2, 40, True, True, LIMIT, False, 16)
    lens = case[0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, dt, A, B, C, D, bias, init, _ = _step(g, lens, *case[1:5], dtype=torch.bfloat16)
    chunks = chunk_starts(cu.tolist())[-1]
    chunk_slot = (torch.randperm(chunks, generator=g) if every
                  else torch.full((chunks,), -1, dtype=torch.int64))
    final_slot = torch.arange(chunks, chunks + len(lens))
    args = (x, dt, A, B, C, D, bias, cu, init, chunk_slot, final_slot)
    want_states = torch.full((chunks + len(lens), *init.shape[1:]), float("nan"),
                             dtype=torch.float64)
    want = ssd_scan_fused_reference(*(a.double() if a.is_floating_point() else a for a in args),
                                    want_states, time_step_limit=LIMIT)
    states = torch.full(want_states.shape, float("nan"))
    y, dt_out = SCRATCH_SCANS[name](*args, states, time_step_limit=LIMIT, out_chunk=out_chunk,
                                    **_tiles(name, 16))
    torch.testing.assert_close(dt_out.double(), want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), want[0], rtol=1e-4, atol=_atol(want[0]))
    assert torch.equal(states.isnan(), want_states.isnan())
    torch.testing.assert_close(states.double().nan_to_num(7.0), want_states.nan_to_num(7.0),
                               rtol=1e-4, atol=_atol(want_states))


@triton.jit
def _local_state_half_decay(bv, xf, cum, total, d, SPLIT: tl.constexpr,
                            PRECISION: tl.constexpr, DOT16: tl.constexpr):
    # A planted bug: each token's input decayed by half the exponent to the chunk's end.
    w = tl.exp(0.5 * (total - cum)) * d
    return _dot_split(tl.trans(bv), xf * w[:, None], SPLIT, PRECISION, DOT16)


@interpreted
def test_chunk_state_scan_fails_the_twin_with_a_wrong_decay_exponent(monkeypatch):
    """The twin check that the chunk-state scan passes fails once its local states take
    a wrong decay exponent (planted: the interpreter calls the module's helper by name),
    in the states and the outputs after the first chunk of each row."""
    g = torch.Generator().manual_seed(_seed())
    args, kwargs, block_p, states, want, want_states, _ = _run_both(KERNEL_CASES[0], g)
    tiles = _tiles("chunk_states", block_p)

    def errors(got_y, got_states):
        ok = ~want_states.isnan()
        return (float((got_y.double() - want[0]).abs().max()),
                float((got_states.double()[ok] - want_states[ok]).abs().max()))

    y, _ = ssd_scan_chunk_states(*args, states, **kwargs, **tiles)
    good = errors(y, states)
    # The real scan passes the tolerances every scan of this file is held to.
    torch.testing.assert_close(y.double(), want[0], rtol=1e-4, atol=_atol(want[0]))
    torch.testing.assert_close(states.double().nan_to_num(7.0), want_states.nan_to_num(7.0),
                               rtol=1e-4, atol=_atol(want_states))
    monkeypatch.setattr(ssd_chunk_states, "_local_state", _local_state_half_decay)
    bad_states = torch.full_like(states, float("nan"))
    y, _ = ssd_scan_chunk_states(*args, bad_states, **kwargs, **tiles)
    bad = errors(y, bad_states)
    assert bad[0] > 100 * _atol(want[0]) and bad[1] > 100 * _atol(want_states), (good, bad)


def test_rejects_bad_inputs():
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, bias, init, _ = _step(g, [5, 3])
    cu = torch.tensor([0, 5, 8])
    slots = (torch.tensor([0, 1]), torch.tensor([2, 3]))
    states = torch.empty(4, *init.shape[1:])
    assert ssd_scan_two_pass_reference is ssd_scan_fused_reference
    assert ssd_scan_chunk_states_reference is ssd_scan_fused_reference
    for fn in (ssd_scan_fused, *SCRATCH_SCANS.values(), ssd_scan_fused_reference):
        with pytest.raises(ValueError, match="dt must be"):
            fn(x, dt[:, :2], A, B, C, D, bias, cu, init, *slots, states)
        with pytest.raises(ValueError, match="initial_states must be"):
            fn(x, dt, A, B, C, D, bias, cu, init[:1], *slots, states)
        with pytest.raises(ValueError, match="G dividing"):
            fn(x, dt, A, B[:, :1].expand(-1, 3, -1), C[:, :1].expand(-1, 3, -1), D, bias,
               cu, init, *slots, states)
    for fn in (ssd_scan_fused, *SCRATCH_SCANS.values()):
        for bad in ("bf16", "bf16x3"):  # bf16x3 was wrong on the H200: not offered
            with pytest.raises(ValueError, match="precision"):
                fn(x, dt, A, B, C, D, bias, cu, init, *slots, states, precision=bad)
    for fn in SCRATCH_SCANS.values():
        with pytest.raises(ValueError, match="out_chunk"):
            fn(x, dt, A, B, C, D, bias, cu, init, *slots, states, out_chunk=96)
        with pytest.raises(ValueError, match="one entry per chunk"):
            fn(x, dt, A, B, C, D, bias, cu, init, torch.tensor([0, 1, -1]), slots[1], states)
    with pytest.raises(ValueError, match="pass_block"):
        ssd_scan_chunk_states(x, dt, A, B, C, D, bias, cu, init, *slots, states, pass_block=24)


# --------------------------------------------------------------------------------------
# ssd_prefill through the fused scans
# --------------------------------------------------------------------------------------


def _prefill_case(g, dtype):
    lens = [2 * CHUNK + 17, CHUNK, 0, 1, CHUNK + 1, 5]
    x, dt, A, B, C, D, bias, init, unclamped = _step(g, lens, 4, 3, 2, 4, dtype)
    init[3] = 0.0
    rows, offs = [], []
    for r, q in enumerate(lens):
        grid = list(range(CHUNK - 1, q, CHUNK)) + ([q - 1] if q else [])
        rows += [r] * len(grid)
        offs += grid
    # Tails (inside the first chunk too), a repeated chunk state, a repeated row end and a
    # repeated tail.
    extra = [(0, 40), (0, CHUNK), (0, 2 * CHUNK + 3), (4, 0), (4, CHUNK - 2), (5, 2),
             (5, 2), (0, CHUNK - 1), (1, CHUNK - 1)]
    rows += [r for r, _ in extra]
    offs += [o for _, o in extra]
    perm = torch.randperm(len(rows), generator=g).tolist()
    rows, offs = [rows[i] for i in perm], [offs[i] for i in perm]
    qs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return lens, qs, rows, offs, (x, dt, A, B, C, D, bias, init, unclamped)


def _assert_per_row(y, states, inputs, qs, rows, offs, tol):
    x, dt, A, B, C, D, bias, init, unclamped = (t.double() for t in inputs)
    d = discretize_dt_varlen(dt, bias, LIMIT, unclamped != 0)
    for i in range(len(qs) - 1):
        s, e = qs[i], qs[i + 1]
        if e == s:
            continue
        mine = [j for j, r in enumerate(rows) if r == i]
        y_ref, st = ssd_chunked_reference(
            x[s:e], d[s:e], A, B[s:e], C[s:e], 8, D, init[i], [offs[j] for j in mine]
        )
        torch.testing.assert_close(y[s:e].double(), y_ref, rtol=tol, atol=tol)
        for n, j in enumerate(mine):
            torch.testing.assert_close(states[j].double(), st[n], rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", [None, *(pytest.param(n, marks=[interpreted, *p.marks])
                                             for n, p in zip(SCANS, _scans()))])
def test_ssd_prefill_through_the_fused_scan_matches_per_row(kernel):
    g = torch.Generator().manual_seed(_seed())
    dtype = torch.float32 if kernel else torch.float64
    lens, qs, rows, offs, inputs = _prefill_case(g, dtype)
    x, dt, A, B, C, D, bias, init, unclamped = inputs
    segments = plan_segments(qs, rows, offs, chunk=CHUNK)
    assert segments.tail_request.numel() and segments.dup_request.numel()
    scan = SCANS[kernel][0] if kernel else ssd_scan_fused_reference
    y, states = ssd_prefill(x, dt, A, B, C, D, init, segments, scan, dt_bias=bias,
                            time_step_limit=LIMIT, unclamped=unclamped)
    assert states.shape == (len(rows), *init.shape[1:])
    _assert_per_row(y, states, inputs, qs, rows, offs, 1e-4 if kernel else 1e-10)


@pytest.mark.parametrize("kernel", [None, *(pytest.param(n, marks=[interpreted, *p.marks])
                                             for n, p in zip(SCANS, _scans()))])
def test_ssd_prefill_stores_states_straight_into_pages(kernel):
    """With ``out_cache`` every requested state lands on its page (row ends and chunk
    states from the scan, tails and repeats after it), the others stay untouched."""
    g = torch.Generator().manual_seed(_seed())
    dtype = torch.float32 if kernel else torch.float64
    lens, qs, rows, offs, inputs = _prefill_case(g, dtype)
    x, dt, A, B, C, D, bias, init, unclamped = inputs
    segments = plan_segments(qs, rows, offs, chunk=CHUNK)
    scan = SCANS[kernel][0] if kernel else ssd_scan_fused_reference
    kw = dict(dt_bias=bias, time_step_limit=LIMIT, unclamped=unclamped)
    y_ref, want = ssd_prefill(x, dt, A, B, C, D, init, segments, scan, **kw)
    cache = torch.full((len(rows) + 7, *init.shape[1:]), float("nan"), dtype=dtype)
    pages = torch.randperm(cache.shape[0], generator=g)[: len(rows)]
    y, none = ssd_prefill(x, dt, A, B, C, D, init, segments, scan, **kw, out_cache=cache,
                          out_pages=pages)
    assert none is None
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(cache[pages], want, rtol=0, atol=0)
    others = sorted(set(range(cache.shape[0])) - set(pages.tolist()))
    assert cache[others].isnan().all()


@interpreted
@pytest.mark.parametrize("every,halves", [(None, None), (CHUNK, False)])
def test_ssd_prefill_takes_the_float32_scratch_where_most_chunk_states_go_to_pages(
        every, halves, monkeypatch):
    """bf16 inputs into float32 pages: a checkpoint on every chunk (a cold prompt's
    grid) makes ``ssd_prefill`` ask the two-pass scan for its float32 scratch (the output
    pass then reads those chunks' states from their pages), row ends alone leave it the
    halves; the outputs are the same bits either way."""
    g = torch.Generator().manual_seed(_seed())
    lens = [200, 70]
    qs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    rows, offs = [], []
    for r, n in enumerate(lens):
        grid = list(range(every - 1, n - 1, every)) if every else []
        rows += [r] * (len(grid) + 1)
        offs += [*grid, n - 1]
    x, dt, A, B, C, D, bias, init, unclamped = _step(g, lens, heads=4, head_dim=16, groups=2,
                                                      d_state=16, dtype=torch.bfloat16)
    A, D, bias, init = A.float(), D.float(), bias.float(), init.float()
    segments = plan_segments(qs, rows, offs, chunk=CHUNK)
    seen = []
    real = ssd_two_pass_module.ssd_scan_two_pass

    def spy(*args, **kwargs):
        seen.append(kwargs.get("halves"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssd_two_pass_module, "ssd_scan_two_pass", spy)
    cache = torch.zeros(len(rows) + 2, *init.shape[1:])
    pages = torch.arange(2, len(rows) + 2)
    kw = dict(dt_bias=bias, time_step_limit=LIMIT, out_cache=cache, out_pages=pages)
    y, _ = ssd_prefill(x, dt, A, B, C, D, init, segments, spy, **kw)
    assert seen == [halves]
    monkeypatch.setattr(ssd_two_pass_module, "ssd_scan_two_pass", real)
    y_other, _ = ssd_prefill(x, dt, A, B, C, D, init, segments,
                             functools.partial(real, halves=halves is False), **kw)
    assert torch.equal(y, y_other)


def test_ssd_prefill_fused_needs_the_raw_dt_and_the_chunk_plan():
    g = torch.Generator().manual_seed(_seed())
    lens, qs, rows, offs, inputs = _prefill_case(g, torch.float64)
    x, dt, A, B, C, D, bias, init, _ = inputs
    with pytest.raises(ValueError, match="dt_bias"):
        ssd_prefill(x, dt, A, B, C, D, init, plan_segments(qs, rows, offs, chunk=CHUNK),
                    ssd_scan_fused_reference)
    with pytest.raises(ValueError, match="chunk=64"):
        ssd_prefill(x, dt, A, B, C, D, init, plan_segments(qs, rows, offs),
                    ssd_scan_fused_reference, dt_bias=bias)


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("name", SCANS)
@pytest.mark.parametrize("precision", ["auto", "tf32", "ieee"])
def test_gpu_kernel_matches_float64_twin(precision, name, record_property):
    """bf16 inputs: ``auto`` takes the split 16-bit products (expected near 1e-5),
    ``tf32`` / ``ieee`` float32 operands."""
    g = torch.Generator().manual_seed(_seed())
    case = ([4096, 1, 700, 64, 2000], 16, 64, 2, 128, True, True, LIMIT, True, None)
    args, kwargs, _, states, want, want_states, _ = _run_both(case, g, torch.bfloat16)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    states = states.cuda()
    y, _ = SCANS[name][0](*args, states, **kwargs, precision=precision)
    ry = ((y.double().cpu() - want[0]).norm() / want[0].norm()).item()
    ok = ~want_states.isnan()
    rs = ((states.double().cpu()[ok] - want_states[ok]).norm() / want_states[ok].norm()).item()
    record_property(f"ssd_{name}_{precision}_rel_err_y", ry)
    record_property(f"ssd_{name}_{precision}_rel_err_state", rs)
    print(f"{name} scan ({precision}): relative error y {ry:.3e}, states {rs:.3e}")
    assert ry < 2e-3 and rs < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("name", SCRATCH_SCANS)
def test_gpu_scratch_scan_prefill_replays_from_a_cuda_graph(name):
    """The two-pass and chunk-state scans make no host read inside ``ssd_prefill``
    (scratch sized from host shapes, the chunk -> row map on the device): the step
    captures in a CUDA graph, and a replay on new inputs of the same plan gives the eager
    results."""
    g = torch.Generator().manual_seed(_seed())
    lens, qs, rows, offs, inputs = _prefill_case(g, torch.float32)
    x, dt, A, B, C, D, bias, init, unclamped = (t.cuda() for t in inputs)
    segments = plan_segments(qs, rows, offs, device="cuda", chunk=CHUNK)
    cache = torch.zeros(len(rows) + 3, *init.shape[1:], device="cuda")
    pages = torch.arange(3, len(rows) + 3, device="cuda")
    kw = dict(dt_bias=bias, time_step_limit=LIMIT, unclamped=unclamped, out_cache=cache,
              out_pages=pages)

    def step():
        return ssd_prefill(x, dt, A, B, C, D, init, segments, SCRATCH_SCANS[name], **kw)[0]

    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step()
    for t in (x, dt, B, C, init):
        t.copy_(torch.randn(t.shape, generator=g).to(t.device, t.dtype))
    graph.replay()
    got_y, got_states = y_graph.clone(), cache[pages].clone()
    cache.zero_()
    want_y = step()
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(got_states, cache[pages], rtol=0, atol=0)


def test_ssd_prefill_into_pages_without_requests():
    """A step that asks for no state: outputs only, no page written."""
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, bias, init, _ = _step(g, [70, 3], dtype=torch.float64)
    segments = plan_segments([0, 70, 73], [], [], chunk=CHUNK)
    cache = torch.full((4, *init.shape[1:]), float("nan"), dtype=torch.float64)
    y, none = ssd_prefill(x, dt, A, B, C, D, init, segments, ssd_scan_fused_reference,
                          dt_bias=bias, out_cache=cache, out_pages=torch.empty(0, dtype=torch.int64))
    assert none is None and cache.isnan().all()
    d = discretize_dt_varlen(dt, bias, (0.0, float("inf")))
    want, _ = ssd_chunked_reference(x[:70], d[:70], A, B[:70], C[:70], 8, D, init[0])
    torch.testing.assert_close(y[:70], want, rtol=1e-10, atol=1e-10)
