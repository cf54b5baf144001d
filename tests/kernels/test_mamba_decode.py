"""Batched Mamba2 decode over state pages: Triton kernels vs torch twins vs the per-row
reference (float64), output pages poisoned first, the race checker, the numerics of the
raw dt's discretisation (float32, in the kernel) over 256 steps, the fused conv +
recurrence (``conv_ssm_update``) against the two ops it replaces, and the mixer's fast
path against its per-row path on the same step."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.config import KernelPolicy
from hybridserve.kernels.conv1d import causal_conv1d_reference
from hybridserve.kernels.mamba_decode import (
    conv_decode_update,
    conv_decode_update_reference,
    conv_ssm_update,
    conv_ssm_update_reference,
    ssm_update,
    ssm_update_reference,
)
from hybridserve.kernels.ssd import discretize_dt, ssd_recurrent_reference
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.step_plan import StepKind, plan_states
from hybridserve.testing import numerics

if os.environ["TRITON_INTERPRET"] != "1":
    # Every test here runs kernels through the race checker, which needs the CPU
    # interpreter: a GPU run (TRITON_INTERPRET=0) skips the module.
    pytest.skip("needs TRITON_INTERPRET=1 (the race checker)", allow_module_level=True)

from hybridserve.testing import racecheck  # noqa: E402


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _pages(g: torch.Generator, rows: int, q: int, num_pages: int, holes: bool):
    """Distinct input and output pages; with ``holes`` some outputs are not requested."""
    perm = torch.randperm(num_pages, generator=g)
    in_pages = perm[:rows].to(torch.int32)
    out_pages = perm[rows : rows + rows * q].view(rows, q).to(torch.int32).clone()
    if holes and q > 1:
        drop = torch.rand(rows, q, generator=g) < 0.4
        drop[:, -1] = False  # the last token's state is always written, as the engine does
        out_pages[drop] = -1
    return in_pages, out_pages


def _dt_kwargs(g, heads, dtype, clamp):
    """The dt operands besides the raw dt: ``dt_bias`` and a clamp that bites on some
    tokens (or None, the single-token step's)."""
    return dict(
        dt_bias=torch.randn(heads, generator=g, dtype=dtype) * 0.5,
        time_step_limit=(0.15, 1.2) if clamp else None,
    )


def _ssm_inputs(g, rows, q, heads, head_dim, groups, d_state, num_pages, dtype, holes=True,
                clamp=True):
    """Operands of one step; the last item holds the keyword operands (dt_bias, clamp).
    ``dt`` is raw (the projection's): softplus(dt + dt_bias) spans about 0.05 .. 3."""
    t = rows * q
    x = torch.randn(t, heads, head_dim, generator=g, dtype=dtype)
    dt = torch.randn(t, heads, generator=g, dtype=dtype) * 1.5 - 0.5
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 4 + 0.5)
    B = torch.randn(t, groups, d_state, generator=g, dtype=dtype)
    C = torch.randn(t, groups, d_state, generator=g, dtype=dtype)
    D = torch.randn(heads, generator=g, dtype=dtype)
    cache = torch.randn(num_pages, heads, head_dim, d_state, generator=g, dtype=dtype)
    in_pages, out_pages = _pages(g, rows, q, num_pages, holes)
    cache[out_pages[out_pages >= 0].long()] = float("nan")  # poison every output page
    kw = _dt_kwargs(g, heads, dtype, clamp)
    return x, dt, A, B, C, D, cache, in_pages, out_pages, kw


def _conv_inputs(g, rows, q, channels, k, num_pages, dtype, holes=True):
    xbc = torch.randn(rows * q, channels, generator=g, dtype=dtype)
    weight = torch.randn(channels, k, generator=g, dtype=dtype)
    bias = torch.randn(channels, generator=g, dtype=dtype)
    cache = torch.randn(num_pages, channels, k - 1, generator=g, dtype=dtype)
    in_pages, out_pages = _pages(g, rows, q, num_pages, holes)
    cache[out_pages[out_pages >= 0].long()] = float("nan")
    return xbc, weight, bias, cache, in_pages, out_pages


@pytest.mark.parametrize("q,clamp", [(1, False), (1, True), (2, True), (4, True)])
def test_ssm_twin_matches_per_row_recurrence_float64(q, clamp):
    g = torch.Generator().manual_seed(_seed())
    rows, heads, head_dim, groups, d_state = 5, 6, 8, 3, 10
    x, dt, A, B, C, D, cache, in_pages, out_pages, kw = _ssm_inputs(
        g, rows, q, heads, head_dim, groups, d_state, 40, torch.float64, clamp=clamp
    )
    before = cache.clone()
    y = ssm_update_reference(x, dt, A, B, C, D, cache, in_pages, out_pages, **kw)
    dt_disc = discretize_dt(dt, kw["dt_bias"], kw["time_step_limit"])
    if clamp:  # the clamp does bite
        assert (dt_disc != discretize_dt(dt, kw["dt_bias"], None)).any()
    for r in range(rows):
        s = slice(r * q, (r + 1) * q)
        y_ref, states = ssd_recurrent_reference(
            x[s], dt_disc[s], A, B[s], C[s], D, before[int(in_pages[r])]
        )
        torch.testing.assert_close(y[s], y_ref, rtol=1e-12, atol=1e-12)
        for t in range(q):
            page = int(out_pages[r, t])
            if page >= 0:
                torch.testing.assert_close(cache[page], states[t], rtol=1e-12, atol=1e-12)
    written = set(out_pages[out_pages >= 0].tolist())
    untouched = [p for p in range(cache.shape[0]) if p not in written]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("q", [1, 3])
def test_conv_twin_matches_per_row_conv_float64(q):
    g = torch.Generator().manual_seed(_seed())
    rows, channels, k = 4, 7, 4
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, rows, q, channels, k, 30, torch.float64
    )
    before = cache.clone()
    out = conv_decode_update_reference(xbc, weight, bias, cache, in_pages, out_pages, "silu")
    for r in range(rows):
        s = slice(r * q, (r + 1) * q)
        offsets = [t for t in range(q) if out_pages[r, t] >= 0]
        o_ref, windows = causal_conv1d_reference(
            xbc[s], weight, bias, before[int(in_pages[r])], "silu", offsets
        )
        torch.testing.assert_close(out[s], o_ref, rtol=1e-12, atol=1e-12)
        for t, w in zip(offsets, windows):
            assert torch.equal(cache[int(out_pages[r, t])], w)
    written = set(out_pages[out_pages >= 0].tolist())
    untouched = [p for p in range(cache.shape[0]) if p not in written]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize(
    "rows,q,heads,head_dim,groups,d_state,clamp",
    [(3, 1, 4, 8, 2, 16, False), (2, 3, 4, 12, 1, 8, True), (4, 2, 6, 5, 3, 12, True),
     (2, 1, 4, 8, 2, 8, True)],
)
def test_ssm_kernel_matches_twin_race_free(rows, q, heads, head_dim, groups, d_state, clamp):
    g = torch.Generator().manual_seed(_seed())
    args = _ssm_inputs(g, rows, q, heads, head_dim, groups, d_state, 3 * rows * q, torch.float32,
                       clamp=clamp)
    x, dt, A, B, C, D, cache, in_pages, out_pages, kw = args
    want_cache = cache.clone()
    want = ssm_update_reference(x, dt, A, B, C, D, want_cache, in_pages, out_pages, **kw)
    with racecheck.record_launches() as rec:
        got = ssm_update(x, dt, A, B, C, D, cache, in_pages, out_pages, **kw)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Written pages equal the twin's; unwritten pages keep their (NaN or random) contents.
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5, equal_nan=True)
    written = out_pages[out_pages >= 0].long()
    assert not cache[written].isnan().any()


def test_ssm_kernel_bf16_state_pages_and_no_d():
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, _, cache, in_pages, out_pages, kw = _ssm_inputs(
        g, 3, 2, 4, 8, 2, 8, 20, torch.float32
    )
    cache = cache.to(torch.bfloat16)
    want_cache = cache.clone()
    want = ssm_update_reference(x, dt, A, B, C, None, want_cache, in_pages, out_pages, **kw)
    got = ssm_update(x, dt, A, B, C, None, cache, in_pages, out_pages, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        cache.float(), want_cache.float(), rtol=1e-2, atol=1e-2, equal_nan=True
    )


@pytest.mark.parametrize(
    "rows,q,channels,k,act,registers",
    [(3, 1, 40, 4, "silu", True), (2, 3, 9, 4, None, True), (2, 2, 300, 3, "silu", True),
     (3, 4, 33, 2, "silu", True), (2, 3, 20, 5, "silu", True), (3, 4, 300, 4, "silu", False),
     (2, 2, 9, 3, None, False)],
)
def test_conv_kernel_matches_twin_race_free(rows, q, channels, k, act, registers):
    """Both kernel forms (widths 2 to 4 in registers; width 5 and ``registers=False``
    the reload form) against the twin; one row starts without a page (zero window)."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, rows, q, channels, k, 3 * rows * q, torch.float32
    )
    in_pages[1] = -1
    want_cache = cache.clone()
    want = conv_decode_update_reference(xbc, weight, bias, want_cache, in_pages, out_pages, act)
    with racecheck.record_launches() as rec:
        got = conv_decode_update(xbc, weight, bias, cache, in_pages, out_pages, act,
                                 registers=registers)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Windows are copies of inputs: bit-identical.
    assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


def test_conv_twin_starts_a_row_without_a_page_from_zeros():
    """In-page -1: the window is zeros (the conv over the row alone, zero-padded), whatever
    the last page holds (a plain gather would read it)."""
    g = torch.Generator().manual_seed(_seed())
    rows, q, channels, k = 2, 3, 6, 4
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, rows, q, channels, k, 12, torch.float64
    )
    in_pages[0] = -1
    out = conv_decode_update_reference(xbc, weight, bias, cache, in_pages, out_pages, "silu")
    o_ref, _ = causal_conv1d_reference(xbc[:q], weight, bias, None, "silu")
    torch.testing.assert_close(out[:q], o_ref, rtol=1e-12, atol=1e-12)


def test_conv_kernel_half_inputs_float32_pages():
    """16-bit inputs over float32 window pages: the register form rounds the carried
    window to the inputs' dtype as the twin does (windows bit-identical), outputs to the
    inputs' rounding. float16, not bfloat16: the interpreter casts float32 to bfloat16 by
    truncation, the GPU and torch round to nearest."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, 3, 4, 48, 4, 40, torch.float32
    )
    xbc, weight, bias = xbc.half(), weight.half(), bias.half()
    want_cache = cache.clone()
    want = conv_decode_update_reference(xbc, weight, bias, want_cache, in_pages, out_pages)
    got = conv_decode_update(xbc, weight, bias, cache, in_pages, out_pages)
    # Both round a float32 sum to float16; summation orders differ: an ulp or two.
    torch.testing.assert_close(got.float(), want.float(), rtol=4e-3, atol=4e-3)
    assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


def test_conv_kernel_reads_rows_at_a_stride():
    """The mixer hands the kernel a column slice of the input projection (rows at a
    stride wider than the channels): the same result as a contiguous copy."""
    g = torch.Generator().manual_seed(_seed())
    rows, q, channels, k = 3, 2, 10, 4
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, rows, q, channels, k, 3 * rows * q, torch.float32
    )
    wide = torch.randn(rows * q, channels + 7, generator=g)
    wide[:, 3 : 3 + channels] = xbc
    strided = wide[:, 3 : 3 + channels]
    assert not strided.is_contiguous()
    want_cache = cache.clone()
    want = conv_decode_update_reference(xbc, weight, bias, want_cache, in_pages, out_pages, "silu")
    got = conv_decode_update(strided, weight, bias, cache, in_pages, out_pages, "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


def test_kernels_independent_of_program_order():
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, cache, in_pages, out_pages, kw = _ssm_inputs(
        g, 4, 2, 4, 8, 2, 8, 30, torch.float32
    )
    results = []
    for order in ("forward", "reversed", "shuffled"):
        c = cache.clone()
        with racecheck.record_launches(record=False, order=order, seed=3):
            y = ssm_update(x, dt, A, B, C, D, c, in_pages, out_pages, **kw)
        results.append((y, c))
    for y, c in results[1:]:
        assert torch.equal(y, results[0][0])
        assert torch.equal(c.nan_to_num(0.0), results[0][1].nan_to_num(0.0))


@pytest.mark.parametrize("kernel", [False, True], ids=["twin", "kernel"])
def test_decode_state_drift_at_bf16_rounding_stays_below_1e5(kernel):
    """256 decode steps of bfloat16-rounded inputs, each step one ``ssm_update`` launch from
    the previous step's page: the state's relative error against a float64 recurrence of
    the same inputs stays <= 1e-5 after 1 and after 256 steps (float32 dt, decay and
    state). The same inputs with dt discretised in bfloat16 (the arithmetic before dt
    moved into the kernel) drift far past the bound: it tells the two apart."""
    g = torch.Generator().manual_seed(_seed())
    steps, keep = 256, (1, 256)
    v = numerics.decode_at_bf16_rounding(g, steps, 1, 4, 16, 2, 32)
    got = numerics.decode_states(ssm_update if kernel else ssm_update_reference, v, steps, keep)
    exact_dt = discretize_dt(v["dt"].double(), v["dt_bias"].double(), None)
    want = numerics.reference_states(v, exact_dt, keep)
    first, last = (numerics.rel_err(got[t], want[t]) for t in keep)
    print(f"{'kernel' if kernel else 'twin'}: state relative error vs float64 after 1 step "
          f"{first:.2e}, after {steps} steps {last:.2e}")
    assert first <= 1e-5 and last <= 1e-5
    # dt discretised in bfloat16, everything else exact: the drift the bound must catch.
    old = numerics.reference_states(v, discretize_dt(v["dt"], v["dt_bias"], None), keep)
    assert numerics.rel_err(old[steps], want[steps]) > 1e-4


def _fused_inputs(g, rows, q, heads, head_dim, groups, d_state, k, num_pages, dtype,
                  bias=True, holes=True):
    """Operands of :func:`conv_ssm_update` (the last item the keyword ones), xbc and dt
    as column slices of one wider projection (the mixer's layout), every output page of
    both caches poisoned; row 1 starts without a page (zeros)."""
    t = rows * q
    channels = heads * head_dim + 2 * groups * d_state
    proj = torch.randn(t, 5 + channels + heads, generator=g, dtype=dtype)
    xbc = proj[:, 5 : 5 + channels]
    dt = proj[:, 5 + channels :] * 1.5 - 0.5
    proj[:, 5 + channels :] = dt
    dt = proj[:, 5 + channels :]
    weight = torch.randn(channels, k, generator=g, dtype=dtype) * 0.5
    conv_bias = torch.randn(channels, generator=g, dtype=dtype) if bias else None
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 4 + 0.5)
    D = torch.randn(heads, generator=g, dtype=dtype)
    conv_cache = torch.randn(num_pages, channels, k - 1, generator=g, dtype=dtype)
    ssm_cache = torch.randn(num_pages, heads, head_dim, d_state, generator=g, dtype=dtype)
    in_pages, out_pages = _pages(g, rows, q, num_pages, holes)
    if rows > 1:
        in_pages[1] = -1
    written = out_pages[out_pages >= 0].long()
    conv_cache[written] = float("nan")
    ssm_cache[written] = float("nan")
    kw = _dt_kwargs(g, heads, dtype, clamp=True)
    return xbc, dt, weight, conv_bias, A, D, conv_cache, ssm_cache, in_pages, out_pages, kw


@pytest.mark.parametrize("q,k", [(1, 4), (3, 4), (2, 3), (4, 2)])
def test_conv_ssm_twin_matches_per_row_conv_and_recurrence_float64(q, k):
    """The fused twin against the per-row conv and the token-by-token recurrence in
    float64: outputs, every window and state written, nothing else touched."""
    g = torch.Generator().manual_seed(_seed())
    rows, heads, head_dim, groups, d_state = 4, 6, 4, 3, 5
    (xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages,
     kw) = _fused_inputs(g, rows, q, heads, head_dim, groups, d_state, k, 40, torch.float64)
    conv_before, ssm_before = conv_cache.clone(), ssm_cache.clone()
    y = conv_ssm_update_reference(xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages,
                                  out_pages, "silu", **kw)
    inter, gs = heads * head_dim, groups * d_state
    dt_disc = discretize_dt(dt, kw["dt_bias"], kw["time_step_limit"])
    for r in range(rows):
        s = slice(r * q, (r + 1) * q)
        page = int(in_pages[r])
        offsets = [t for t in range(q) if out_pages[r, t] >= 0]
        conv, windows = causal_conv1d_reference(
            xbc[s], weight, bias, conv_before[page] if page >= 0 else None, "silu", offsets
        )
        x, B, C = conv.split([inter, gs, gs], dim=-1)
        y_ref, states = ssd_recurrent_reference(
            x.reshape(q, heads, head_dim), dt_disc[s], A, B.reshape(q, groups, d_state),
            C.reshape(q, groups, d_state), D, ssm_before[page] if page >= 0 else None,
        )
        torch.testing.assert_close(y[s], y_ref, rtol=1e-12, atol=1e-12)
        for t, w in zip(offsets, windows):
            out = int(out_pages[r, t])
            assert torch.equal(conv_cache[out], w)
            torch.testing.assert_close(ssm_cache[out], states[t], rtol=1e-12, atol=1e-12)
    written = set(out_pages[out_pages >= 0].tolist())
    untouched = [p for p in range(conv_cache.shape[0]) if p not in written]
    assert torch.equal(conv_cache[untouched], conv_before[untouched])
    assert torch.equal(ssm_cache[untouched], ssm_before[untouched])


@pytest.mark.parametrize(
    "rows,q,heads,head_dim,groups,d_state,k,bias",
    [(3, 1, 4, 8, 2, 16, 4, True), (2, 4, 4, 12, 1, 8, 4, True), (2, 2, 6, 5, 3, 12, 3, False),
     (3, 3, 8, 4, 2, 8, 2, True)],
)
def test_conv_ssm_kernel_matches_twin_race_free(rows, q, heads, head_dim, groups, d_state, k,
                                                bias):
    """The fused kernel against its twin on fresh random inputs (strided xbc and dt,
    poisoned output pages, a row without a page, several heads per group: the shared B
    and C windows have one writer), under the race checker."""
    g = torch.Generator().manual_seed(_seed())
    (xbc, dt, weight, conv_bias, A, D, conv_cache, ssm_cache, in_pages, out_pages,
     kw) = _fused_inputs(g, rows, q, heads, head_dim, groups, d_state, k, 3 * rows * q,
                         torch.float32, bias)
    want_conv, want_ssm = conv_cache.clone(), ssm_cache.clone()
    want = conv_ssm_update_reference(xbc, dt, weight, conv_bias, A, D, want_conv, want_ssm,
                                     in_pages, out_pages, "silu", **kw)
    with racecheck.record_launches() as rec:
        got = conv_ssm_update(xbc, dt, weight, conv_bias, A, D, conv_cache, ssm_cache,
                              in_pages, out_pages, "silu", **kw)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Windows are copies of inputs: bit-identical; states as the twin's.
    assert torch.equal(conv_cache.nan_to_num(7.0), want_conv.nan_to_num(7.0))
    torch.testing.assert_close(ssm_cache, want_ssm, rtol=1e-5, atol=1e-5, equal_nan=True)
    written = out_pages[out_pages >= 0].long()
    assert not conv_cache[written].isnan().any() and not ssm_cache[written].isnan().any()


def test_conv_ssm_kernel_bf16_activations_equal_the_two_launches():
    """bf16 activations and taps, float32 states: the fused kernel rounds the conv output
    to bf16 before the recurrence, as the separate conv launch stores it, so it agrees
    with ``conv_decode_update`` then ``ssm_update`` to float32 rounding (not bf16's)."""
    g = torch.Generator().manual_seed(_seed())
    (xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages,
     kw) = _fused_inputs(g, 2, 3, 4, 8, 2, 16, 4, 20, torch.float32)
    xbc, dt, weight, bias = (t.bfloat16() for t in (xbc, dt, weight, bias))
    conv_cache = conv_cache.bfloat16()
    two_conv, two_ssm = conv_cache.clone(), ssm_cache.clone()
    conv = conv_decode_update(xbc, weight, bias, two_conv, in_pages, out_pages)
    x, B, C = conv.split([32, 32, 32], dim=-1)
    want = ssm_update(x.reshape(-1, 4, 8), dt, A, B.reshape(-1, 2, 16), C.reshape(-1, 2, 16),
                      D, two_ssm, in_pages, out_pages, **kw)
    got = conv_ssm_update(xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages,
                          out_pages, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_cache.nan_to_num(7.0), two_conv.nan_to_num(7.0))
    torch.testing.assert_close(ssm_cache, two_ssm, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_conv_ssm_kernel_independent_of_program_order():
    """A 3-D grid (rows, heads, head-dim blocks: head_dim 32 over d_state 128 gives two
    blocks a head): outputs and every page bit-identical in any program order."""
    g = torch.Generator().manual_seed(_seed())
    (xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages,
     kw) = _fused_inputs(g, 2, 2, 4, 32, 2, 128, 4, 12, torch.float32)
    report = racecheck.run_launcher_in_orders(
        lambda xbc, dt, conv_cache, ssm_cache: conv_ssm_update(
            xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages, **kw
        ),
        lambda: (xbc, dt, conv_cache.nan_to_num(7.0), ssm_cache.nan_to_num(7.0)),
        seed=5,
    )
    assert report.consistent, str(report)


def test_conv_ssm_rejects_channels_that_do_not_split():
    g = torch.Generator().manual_seed(_seed())
    (xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages,
     kw) = _fused_inputs(g, 2, 1, 4, 8, 2, 8, 4, 12, torch.float32)
    with pytest.raises(ValueError, match="H \\* P \\+ 2 \\* G \\* N"):
        conv_ssm_update(xbc[:, 1:], dt, weight[1:], bias[1:], A, D, conv_cache[:, 1:],
                        ssm_cache, in_pages, out_pages, **kw)
    with pytest.raises(ValueError, match="width 2 to 4"):
        conv_ssm_update(xbc, dt, torch.randn(xbc.shape[1], 5), bias, A, D,
                        torch.randn(12, xbc.shape[1], 4), ssm_cache, in_pages, out_pages, **kw)


@pytest.mark.parametrize("act,registers", [("silu", True), (None, True), ("silu", False)])
def test_conv_kernel_independent_of_program_order(act, registers):
    """Several rows and channel blocks (a 2-D grid), both kernel forms: outputs and every
    window page are bit-identical whatever order the programs run in."""
    g = torch.Generator().manual_seed(_seed())
    rows, q = 4, 3
    xbc, weight, bias, cache, in_pages, out_pages = _conv_inputs(
        g, rows, q, 300, 4, 3 * rows * q, torch.float32
    )
    report = racecheck.run_launcher_in_orders(
        lambda xbc, weight, bias, cache, in_pages, out_pages: conv_decode_update(
            xbc, weight, bias, cache, in_pages, out_pages, act, registers=registers
        ),
        lambda: (xbc, weight, bias, cache.nan_to_num(7.0), in_pages, out_pages),
        seed=5,
    )
    assert report.consistent, str(report)


def _batch(q_lens, in_pages, outs):
    qs = [0]
    for q in q_lens:
        qs.append(qs[-1] + q)
    rows, offs, pages = [], [], []
    for r, o in enumerate(outs):
        for off, page in o:
            rows.append(r)
            offs.append(off)
            pages.append(page)
    t = qs[-1]
    return ForwardBatch(
        query_start=qs, num_computed=[5] * len(q_lens), positions=torch.arange(t),
        context_lens=[5 + q for q in q_lens], block_tables=torch.zeros(len(q_lens), 4,
                                                                       dtype=torch.int32),
        slot_mapping=torch.arange(t), state_in_page=in_pages, state_out_row=rows,
        state_out_offset=offs, state_out_page=pages,
    )


def test_decode_plan_qualifies_only_uniform_steps_from_stored_states():
    cpu = torch.device("cpu")
    policy = KernelPolicy(short_rows="off", packed_prefill="off")

    def kind(batch):
        return plan_states(batch, policy, cpu, torch.float64).kind

    plan = plan_states(_batch([2, 2], [3, 4], [[(1, 7)], [(0, 8), (1, 9)]]), policy, cpu,
                       torch.float64)
    assert plan.kind is StepKind.DECODE and plan.q == 2 and not plan.triton
    assert plan.in_pages.tolist() == [3, 4]
    assert plan.decode_out_pages.tolist() == [[-1, 7], [8, 9]]
    assert kind(_batch([1, 2], [3, 4], [[(0, 7)], [(1, 9)]])) is StepKind.ROWS  # mixed q
    assert kind(_batch([1, 1], [-1, 4], [[(0, 7)], [(0, 9)]])) is StepKind.ROWS  # zero state
    assert kind(_batch([1, 1], [3, 4], [[(0, 4)], [(0, 9)]])) is StepKind.ROWS  # reads a write
    assert kind(_batch([17], [3], [[(16, 5)]])) is StepKind.ROWS  # a prefill chunk
    # The policy can turn the batched decode ops off.
    off = KernelPolicy(uniform_decode=False, short_rows="off", packed_prefill="off")
    batch = _batch([2, 2], [3, 4], [[(1, 7)], [(0, 8), (1, 9)]])
    assert plan_states(batch, off, cpu, torch.float64).kind is StepKind.ROWS


@pytest.mark.parametrize("q", [1, 3])
def test_mixer_fast_path_matches_per_row_path(tmp_path, monkeypatch, q, mixer_paths):
    """A whole model step through the fast path equals the per-row path: logits and every
    written state page (rows continue from stored states; caches are NaN-poisoned)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver

    from hybridserve.models.loader import load_model
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=_seed() % 1000, layers="M*-M")
    g = torch.Generator().manual_seed(_seed())
    prompts = {i: torch.randint(3, 256, (5 + 3 * i,), generator=g).tolist() for i in range(3)}
    nxt = {i: torch.randint(3, 256, (q,), generator=g).tolist() for i in range(3)}
    results, paths = [], []
    for fast in (True, False):
        # Without the batched decode ops the step takes the per-row path.
        policy = KernelPolicy(uniform_decode=fast, short_rows="off", packed_prefill="off")
        model = load_model(path, dtype=torch.float64, policy=policy)
        d = PagedDriver(model)
        mixer_paths.clear()
        d.step([(i, p) for i, p in prompts.items()])
        logits, pages = d.step([(i, t) for i, t in nxt.items()], {0: [0]} if q > 1 else None)
        states = {
            (sid, off, layer): (d.conv_state(layer, page), d.ssm_state(layer, page))
            for sid, offs in pages.items()
            for off, page in offs.items()
            for layer in model.cache_spec.mamba_layers
        }
        results.append((logits, states))
        paths.append(dict(mixer_paths))
    # The prompts take the per-row path on the CPU either way; the uniform step takes the
    # decode kernels on the fast side only.
    layers = len(model.cache_spec.mamba_layers)
    assert paths == [{"per_row": 3 * layers, "decode": layers}, {"per_row": 6 * layers}], paths
    (fl, fs), (sl, ss) = results
    assert not fl.isnan().any()
    torch.testing.assert_close(fl, sl, rtol=1e-10, atol=1e-10)
    assert fs.keys() == ss.keys()
    for key in fs:
        assert torch.equal(fs[key][0], ss[key][0]), key
        torch.testing.assert_close(fs[key][1], ss[key][1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("q", [1, 3])
def test_mixer_decode_step_fused_launch_matches_two_launches_and_twins(q):
    """The mixer's uniform step on the Triton kernels (interpreted): fused
    (``conv_ssm_update``, one Mamba launch) against the two launches and against the
    twins: the layer's output and every written window and state page."""
    from dataclasses import replace

    from hybridserve.models.config import MambaParams
    from hybridserve.models.layers.mamba2 import Mamba2Mixer

    g = torch.Generator().manual_seed(_seed())
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=g)))
    p = MambaParams(n_heads=4, head_dim=8, n_groups=2, d_state=8, d_conv=4, expand=2,
                    chunk_size=8, conv_bias=True, proj_bias=False, activation="silu",
                    norm_eps=1e-5, time_step_limit=(0.0, float("inf")), time_step_min=0.001,
                    time_step_max=0.1)
    rows, pages, hidden = 3, 16, 16
    outs = [[(t, rows + r * q + t) for t in range(q) if t == q - 1 or (r + t) % 2]
            for r in range(rows)]
    batch = _batch([q] * rows, list(range(rows)), outs)
    policy = KernelPolicy(short_rows="off", packed_prefill="off")
    plan = plan_states(batch, policy, torch.device("cpu"), torch.float32)
    assert plan.kind is StepKind.DECODE and not plan.triton
    h = torch.randn(rows * q, hidden, generator=g)
    conv0 = torch.randn(pages, p.conv_dim, p.d_conv - 1, generator=g)
    ssm0 = torch.randn(pages, p.n_heads, p.head_dim, p.d_state, generator=g)
    written = [page for o in outs for _, page in o]
    conv0[written] = float("nan")
    ssm0[written] = float("nan")
    weights = Mamba2Mixer(hidden, p).state_dict()
    with torch.no_grad():
        for value in weights.values():
            value.copy_(torch.randn(value.shape, generator=g) * 0.5)
    results = {}
    for name, fused, triton_ in (("fused", True, True), ("two", False, True),
                                 ("twins", True, False)):
        mixer = Mamba2Mixer(hidden, p, replace(policy, fused_decode=fused))
        mixer.load_state_dict(weights)
        step = replace(batch, planned=True, states=replace(plan, triton=triton_))
        states = {"conv": conv0.clone(), "ssm": ssm0.clone()}
        with racecheck.record_launches() as rec, torch.no_grad():
            out = mixer(h, step, states)
        assert all(r.clean for r in rec.reports)
        results[name] = (out, states, rec.launches)
    # A step of more rows than fused_decode_max_rows takes the two launches, fused or not.
    mixer = Mamba2Mixer(hidden, p, replace(policy, fused_decode=True,
                                           fused_decode_max_rows=rows - 1))
    mixer.load_state_dict(weights)
    states = {"conv": conv0.clone(), "ssm": ssm0.clone()}
    with racecheck.record_launches() as rec, torch.no_grad():
        out = mixer(h, replace(batch, planned=True, states=replace(plan, triton=True)), states)
    results["many rows"] = (out, states, rec.launches)
    assert [results[n][2] for n in ("fused", "two", "twins", "many rows")] == [1, 2, 0, 2]
    want_out, want_states, _ = results["twins"]
    for name in ("fused", "two", "many rows"):
        out, states, _ = results[name]
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        assert torch.equal(states["conv"].nan_to_num(7.0), want_states["conv"].nan_to_num(7.0))
        torch.testing.assert_close(states["ssm"], want_states["ssm"], rtol=1e-5, atol=1e-5,
                                   equal_nan=True)
        assert not states["ssm"][written].isnan().any()


def test_policy_fused_decode_takes_a_bool():
    with pytest.raises(ValueError, match="kernel_policy.fused_decode must be a bool"):
        KernelPolicy(fused_decode="off")
    with pytest.raises(ValueError, match="fused_decode_max_rows"):
        KernelPolicy(fused_decode_max_rows=-1)
    assert KernelPolicy().fused_decode and not KernelPolicy(fused_decode=False).fused_decode
