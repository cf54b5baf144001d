"""Variable-length causal conv over packed rows: the Triton kernel against its twin and the
per-row reference, NaN-poisoned outputs and unread pages, the race checker and three
program orders; the windows written to output pages bit for bit against the per-row
reference, by both window writers (the slab writer over the window tokens' list, the
full-grid writer of graph steps); checkpoints every 64 tokens through the model and through
the engine with prefix caching.

GPU tests (``-m gpu``) compile the kernel: run them with ``TRITON_INTERPRET=0``.
"""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton

from hybridserve.kernels.conv1d import causal_conv1d_reference
from hybridserve.kernels.conv_varlen import (
    conv_varlen,
    conv_varlen_reference,
    token_rows,
    window_token_list,
)

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"

if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _step(g, lens, channels, k, dtype, num_pages=None, cache_dtype=None, with_pages=0.6):
    """A packed step: random inputs, rows of ``lens`` tokens, scattered initial pages (some
    rows start from zeros) and every page no row reads poisoned with NaN, page 0 included."""
    rows = len(lens)
    num_pages = num_pages or 3 * rows + 2
    qs = [0]
    for q in lens:
        qs.append(qs[-1] + q)
    xbc = torch.randn(qs[-1], channels, generator=g, dtype=dtype)
    weight = torch.randn(channels, k, generator=g, dtype=dtype)
    bias = torch.randn(channels, generator=g, dtype=dtype)
    # NaN guard pages either side: a read through page -1 (or past the end) shows up.
    guarded = torch.full((num_pages + 2, channels, k - 1), float("nan"), dtype=cache_dtype or dtype)
    cache = guarded[1:-1]
    cache.copy_(torch.randn(cache.shape, generator=g, dtype=cache.dtype))
    # Page 0 is never an input: rows without a page must not read it (it is NaN).
    perm = (torch.randperm(num_pages - 1, generator=g) + 1)[:rows]
    has = torch.rand(rows, generator=g) < with_pages
    filled = [r for r, q in enumerate(lens) if q > 0]
    if with_pages < 1 and len(filled) > 1:  # both kinds of row, whatever the draw
        has[filled[0]], has[filled[-1]] = False, True
    in_pages = torch.where(has, perm, torch.full_like(perm, -1))
    unread = torch.ones(num_pages, dtype=torch.bool)
    unread[in_pages[in_pages >= 0]] = False
    cache[unread] = float("nan")
    return xbc, weight, bias, cache, torch.tensor(qs), in_pages


LENS = [
    [0, 1, 2, 5, 3, 0, 9],  # empty rows, rows shorter than K - 1
    [13],
    [1, 1, 1, 1],
    [7, 0, 0, 4, 21, 2],
]


def _out_pages(g, lens, cache, in_pages, share=0.5, ends=True):
    """A page for every row's last token (as the engine asks; not when ``ends`` is False)
    and about ``share`` of the other tokens, distinct and never an input page; -1 for the
    rest."""
    free = [p for p in range(cache.shape[0]) if p not in set(in_pages.tolist())]
    free = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
    last = set(torch.tensor(lens).cumsum(0)[torch.tensor(lens) > 0].sub(1).tolist())
    if not ends:
        last = set()
    return torch.tensor([
        free.pop() if t in last or bool(torch.rand((), generator=g) < share) else -1
        for t in range(sum(lens))
    ], dtype=torch.int64)


def _window_tokens(out_pages):
    """The step plan's ``[W]`` list of the tokens that have an output page."""
    return torch.tensor(window_token_list(out_pages.tolist()), dtype=torch.int32)


def _per_row(xbc, weight, bias, before, qs, in_pages, out_pages, act="silu"):
    """The per-row reference: outputs, and ``{page: window}`` for every requested token."""
    out, windows = [], {}
    for r in range(len(in_pages)):
        s, e = int(qs[r]), int(qs[r + 1])
        if s == e:
            continue
        page = int(in_pages[r])
        offsets = [t - s for t in range(s, e) if out_pages[t] >= 0]
        o, w = causal_conv1d_reference(
            xbc[s:e], weight, bias, before[page] if page >= 0 else None, act, offsets
        )
        out.append(o)
        windows.update({int(out_pages[s + off]): w_j for off, w_j in zip(offsets, w)})
    return torch.cat(out), windows


WRITERS = [
    "twin",
    pytest.param("slabs", marks=interpreted),  # the window tokens' list (planned steps)
    pytest.param("grid", marks=interpreted),  # no list (graph steps)
]
WINDOW_KERNELS = {"slabs": "_conv_window_slabs_kernel", "grid": "_conv_windows_kernel"}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("lens,k", [(LENS[0], 4), (LENS[3], 3), ([2, 0, 1], 4), (LENS[1], 2)])
def test_out_pages_get_the_windows_bit_for_bit(writer, lens, k):
    """With ``out_pages`` the conv also writes the window after each token that has a
    page: bit for bit the per-row reference's windows, in the page dtype; no other page
    changes, and the kernels stay race-free, with the window tokens' list (the twin
    checks it) or without it."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, qs, in_pages = _step(
        g, lens, 9, k, torch.float32, num_pages=3 * sum(lens) + 4
    )
    out_pages = _out_pages(g, lens, cache, in_pages)
    before = cache.clone()
    want, windows = _per_row(xbc, weight, bias, before, qs, in_pages, out_pages)
    listed = _window_tokens(out_pages) if writer != "grid" else None
    if writer != "twin":
        with racecheck.record_launches() as rec:
            got = conv_varlen(xbc, weight, bias, cache, qs.to(torch.int32), in_pages, "silu",
                              out_pages=out_pages.to(torch.int32), window_tokens=listed,
                              block_t=4, block_c=8, window_block=8)
        # The conv of inner tokens, of rows' first tokens, and the windows.
        assert len(rec.reports) == 3 and all(r.clean for r in rec.reports), rec.reports
        assert rec.reports[2].kernel.endswith(WINDOW_KERNELS[writer]), rec.reports[2].kernel
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        got = conv_varlen_reference(xbc, weight, bias, cache, qs, in_pages, "silu",
                                    out_pages=out_pages, window_tokens=listed)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert windows
    for page, window in windows.items():
        assert torch.equal(cache[page], window), page
    unwritten = torch.ones(cache.shape[0], dtype=torch.bool)
    unwritten[list(windows)] = False
    assert torch.equal(cache[unwritten].nan_to_num(7.0), before[unwritten].nan_to_num(7.0))


# (share of the other tokens, row ends) of every mode the engine asks for.
MODES = {"every token": (1.0, True), "row ends": (0.0, True), "none": (0.0, False),
         "some, no ends": (0.4, False)}


@interpreted
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "lens,channels,k,window_block",
    [
        (LENS[0], 9, 4, 8),  # empty rows, rows shorter than K - 1; blocks straddle channels
        (LENS[3], 5, 3, 4),
        ([1, 0, 2, 6, 1], 16, 4, 64),  # one block a page
        (LENS[2], 7, 2, 2),
    ],
)
def test_slab_writer_covers_only_window_tokens(lens, channels, k, window_block, mode):
    """The slab writer, in every mode (windows at every token, at row ends, none, some
    inside rows only): one program per (window token, block of page entries), none at
    all without a window; the windows bit for bit the per-row reference's, on steps of
    rows with and without initial pages; no other page changes; race-free."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, qs, in_pages = _step(
        g, lens, channels, k, torch.float32, num_pages=3 * sum(lens) + 4
    )
    share, ends = MODES[mode]
    out_pages = _out_pages(g, lens, cache, in_pages, share=share, ends=ends)
    listed = _window_tokens(out_pages)
    before = cache.clone()
    want, windows = _per_row(xbc, weight, bias, before, qs, in_pages, out_pages)
    with racecheck.record_launches() as rec:
        got = conv_varlen(xbc, weight, bias, cache, qs.to(torch.int32), in_pages, "silu",
                          out_pages=out_pages.to(torch.int32), window_tokens=listed,
                          block_t=4, block_c=8, window_block=window_block)
    assert all(r.clean for r in rec.reports), rec.reports
    kernels = [r.kernel.rsplit(".", 1)[-1] for r in rec.reports]
    if listed.numel():
        assert kernels[2:] == ["_conv_window_slabs_kernel"], kernels
        blocks = -(-channels * (k - 1) // min(window_block, triton.next_power_of_2(
            channels * (k - 1))))
        assert tuple(rec.reports[2].grid)[:2] == (listed.numel(), blocks)
    else:
        assert len(kernels) == 2, kernels  # no window: no writer launched
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(windows) == listed.numel()
    for page, window in windows.items():
        assert torch.equal(cache[page], window), page
    unwritten = torch.ones(cache.shape[0], dtype=torch.bool)
    unwritten[list(windows)] = False
    assert torch.equal(cache[unwritten].nan_to_num(7.0), before[unwritten].nan_to_num(7.0))


def test_twin_rejects_a_window_list_that_is_not_the_pages():
    """The twin checks the list the slab writer trusts: every token with a page, ascending,
    once; and the list needs ``out_pages``."""
    g = torch.Generator().manual_seed(_seed())
    lens = [3, 0, 4]
    xbc, weight, bias, cache, qs, in_pages = _step(g, lens, 4, 4, torch.float32,
                                                   num_pages=3 * sum(lens) + 4)
    out_pages = _out_pages(g, lens, cache, in_pages, share=0.5)
    good = window_token_list(out_pages.tolist())
    for bad in (good[:-1], good[::-1] if len(good) > 1 else good * 2, good + good[-1:]):
        with pytest.raises(ValueError, match="window_tokens"):
            conv_varlen_reference(xbc, weight, bias, cache.clone(), qs, in_pages, "silu",
                                  out_pages=out_pages, window_tokens=torch.tensor(bad))
    with pytest.raises(ValueError, match="window_tokens"):
        conv_varlen_reference(xbc, weight, bias, cache, qs, in_pages, "silu",
                              window_tokens=torch.tensor(good))


@interpreted
@pytest.mark.parametrize("slabs", [False, True])
def test_kernel_windows_take_initial_entries_through_the_input_dtype(slabs):
    """bf16 inputs over float32 window pages: a window's entries from before the row go
    through bf16, as the per-row reference's concatenation does; both writers. The page
    values carry low bits under half a bf16 ulp: the interpreter's truncating cast and the
    GPU's rounding one agree on them, and a writer that skipped the cast would keep them."""
    g = torch.Generator().manual_seed(_seed())
    lens = [1, 2, 6]
    xbc, weight, bias, cache, qs, in_pages = _step(
        g, lens, 5, 4, torch.bfloat16, num_pages=3 * sum(lens) + 4,
        cache_dtype=torch.float32, with_pages=1.0,
    )
    bits = cache.view(torch.int32)
    bits.copy_((bits & -65536) | 0x1234)  # the bf16 bits, then 0x1234 below them
    assert not torch.equal(cache, cache.to(torch.bfloat16).to(torch.float32))
    out_pages = _out_pages(g, lens, cache, in_pages, share=1.0)
    before = cache.clone()
    _, windows = _per_row(xbc, weight, bias, before, qs, in_pages, out_pages)
    conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu", out_pages=out_pages,
                window_tokens=_window_tokens(out_pages) if slabs else None,
                block_t=4, block_c=8, window_block=4)
    for page, window in windows.items():
        assert window.dtype == torch.bfloat16
        assert torch.equal(cache[page], window.to(torch.float32)), page


def test_token_rows_skip_empty_rows():
    qs = torch.tensor([0, 0, 3, 3, 4, 6, 6])
    assert token_rows(qs, 6).tolist() == [1, 1, 1, 3, 4, 4]


@interpreted
@pytest.mark.parametrize(
    "lens,channels,k,act,block_t,block_c",
    [
        (LENS[0], 12, 4, "silu", 4, 8),
        (LENS[3], 9, 4, None, 8, 4),
        (LENS[2], 20, 3, "silu", 2, 16),
        ([3, 0, 5], 7, 2, "silu", 4, 4),
    ],
)
def test_kernel_matches_twin_race_free(lens, channels, k, act, block_t, block_c):
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, qs, in_pages = _step(g, lens, channels, k, torch.float32)
    before = cache.clone()
    want = conv_varlen_reference(xbc, weight, bias, cache, qs, in_pages, act)
    out = torch.full_like(xbc, float("nan"))
    with racecheck.record_launches() as rec:
        got = conv_varlen(
            xbc, weight, bias, cache, qs, in_pages, act, out=out, block_t=block_t, block_c=block_c
        )
    assert len(rec.reports) == 2 and all(r.clean for r in rec.reports), rec.reports
    assert got is out and not got.isnan().any()  # every output written
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0))


@interpreted
def test_kernel_without_bias_int32_indices_and_bf16():
    # bf16 window pages: the interpreter's float32 -> bfloat16 cast truncates where the GPU
    # rounds, so the float32-page case (a cast inside the kernel) is left to the GPU test.
    g = torch.Generator().manual_seed(_seed())
    lens = [4, 1, 0, 6]
    xbc, weight, _, cache, qs, in_pages = _step(g, lens, 10, 4, torch.bfloat16)
    want = conv_varlen_reference(xbc, weight, None, cache, qs, in_pages, "silu")
    out = torch.full_like(xbc, float("nan"))
    got = conv_varlen(
        xbc, weight, None, cache, qs.to(torch.int32), in_pages.to(torch.int32), "silu",
        token_row=token_rows(qs, xbc.shape[0]).to(torch.int32), out=out, block_t=4, block_c=8,
    )
    assert not got.isnan().any()
    # Both accumulate in float32; the outputs may differ by the last bit of their rounding.
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-5)


@interpreted
@pytest.mark.parametrize("windows,walk", [(None, "tiles"), ("grid", "tiles"),
                                          ("slabs", "tiles"), ("slabs", "tokens")])
def test_kernel_independent_of_program_order(windows, walk):
    g = torch.Generator().manual_seed(_seed())
    lens = [5, 0, 1, 9, 2]
    xbc, weight, bias, cache, qs, in_pages = _step(g, lens, 10, 4, torch.float32,
                                                   num_pages=3 * sum(lens) + 4)
    out_pages = _out_pages(g, lens, cache, in_pages) if windows else None
    listed = _window_tokens(out_pages) if windows == "slabs" else None

    def launch(xbc, weight, bias, conv_cache, query_start, in_pages, out):
        return conv_varlen(xbc, weight, bias, conv_cache, query_start, in_pages, "silu",
                           out=out, out_pages=out_pages, window_tokens=listed,
                           block_t=4, block_c=4, window_block=8, walk=walk)

    report = racecheck.run_launcher_in_orders(
        launch,
        lambda: dict(xbc=xbc, weight=weight, bias=bias, conv_cache=cache.clone(),
                     query_start=qs, in_pages=in_pages, out=torch.full_like(xbc, float("nan"))),
    )
    assert report.consistent, str(report)
    assert not report.outputs["forward"]["return"].isnan().any()


@interpreted
@pytest.mark.parametrize("lens,channels,span,block_c,bias", [
    (LENS[0], 10, 4, 8, True),  # spans across rows, rows shorter than K - 1
    (LENS[3], 20, 8, 16, False),  # a partial last channel block, no bias
    ([13], 7, 64, 256, True),  # one span for the step, blocks wider than the channels
])
def test_token_walk_gives_the_tiles_bits_race_free(lens, channels, span, block_c, bias):
    """``walk="tokens"``: every output bit for bit the tile walk's (the taps summed in
    the same order), every output written, the windows untouched, race-free."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, b, cache, qs, in_pages = _step(g, lens, channels, 4, torch.float32)
    b = b if bias else None
    before = cache.clone()
    want = conv_varlen(xbc, weight, b, cache, qs, in_pages, "silu", walk="tiles",
                       block_t=4, block_c=4)
    out = torch.full_like(xbc, float("nan"))
    with racecheck.record_launches() as rec:
        got = conv_varlen(xbc, weight, b, cache, qs, in_pages, "silu", out=out,
                          walk="tokens", block_t=span, block_c=block_c)
    assert len(rec.reports) == 2 and all(r.clean for r in rec.reports), rec.reports
    assert got is out and not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0))
    twin = conv_varlen_reference(xbc, weight, b, cache, qs, in_pages, "silu")
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


def test_token_walk_takes_k_4_only_and_refuses_other_walks():
    """Another kernel width falls back to the tiles; an unknown walk is refused."""
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, qs, in_pages = _step(g, [5, 3], 6, 3, torch.float32)
    want = conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu", walk="tiles")
    got = conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu", walk="tokens")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="walk"):
        conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu", walk="rows")


def test_rejects_in_place_output():
    g = torch.Generator().manual_seed(_seed())
    xbc, weight, bias, cache, qs, in_pages = _step(g, [3, 2], 4, 4, torch.float32)
    with pytest.raises(ValueError, match="never in place"):
        conv_varlen_reference(xbc, weight, bias, cache, qs, in_pages, "silu", out=xbc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_twin(dtype, record_property):
    g = torch.Generator().manual_seed(_seed())
    lens = [4096, 1, 0, 2, 777, 1500, 3]
    # Window pages in float32 under bf16 inputs: the kernel casts them as the reference does.
    xbc, weight, bias, cache, qs, in_pages = _step(g, lens, 2304, 4, dtype,
                                                   cache_dtype=torch.float32, num_pages=40)
    args = [t.cuda() for t in (xbc, weight, bias, cache, qs, in_pages)]
    want = conv_varlen_reference(*args, "silu")
    got = conv_varlen(*args, "silu", out=torch.full_like(args[0], float("nan")))
    assert not got.isnan().any()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    record_property("conv_varlen_rel_err", rel)
    print(f"conv_varlen {dtype}: relative error {rel:.3e}")
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2)
    # The token walk, compiled: the tiles' bits.
    for walk in ("tiles", "tokens"):
        tiles = conv_varlen(*args, "silu", walk="tiles")
        assert torch.equal(conv_varlen(*args, "silu", walk=walk), tiles), walk


@pytest.mark.parametrize("kind", ["short", "packed", "packed, no state asked"])
def test_plan_uploads_the_window_tokens_with_its_index_tensors(kind):
    """The step plan's ``window_tokens``: every token with an output page, ascending, in
    the same host-to-device copy as the plan's other index tensors (views of one
    storage); the varlen plan (Gated DeltaNet's) carries the same tensor. A step that asks
    for no state has an empty list (the conv then launches no window writer)."""
    from hybridserve.config import KernelPolicy
    from hybridserve.models.batch import ForwardBatch
    from hybridserve.models.step_plan import StepKind, plan_states

    lens, in_pages = [3, 0, 1, 5], [4, -1, 5, -1]
    requests = [] if kind.endswith("no state asked") else [(0, 2, 7), (2, 0, 9), (3, 1, 10),
                                                          (3, 4, 11), (0, 0, 12)]
    qs = [0, 3, 3, 4, 9]
    batch = ForwardBatch(
        query_start=qs, num_computed=[5] * 4, positions=torch.arange(9),
        context_lens=[5 + q for q in lens], block_tables=torch.zeros(4, 4, dtype=torch.int32),
        slot_mapping=torch.arange(9), state_in_page=in_pages,
        state_out_row=[r for r, _, _ in requests], state_out_offset=[o for _, o, _ in requests],
        state_out_page=[p for _, _, p in requests],
    )
    short = kind == "short"
    policy = KernelPolicy(short_rows="reference" if short else "off",
                          packed_prefill="off" if short else "reference")
    plan = plan_states(batch, policy, torch.device("cpu"), torch.float32, varlen=True)
    assert plan.kind is (StepKind.SHORT if short else StepKind.PACKED)
    want = [] if not requests else [0, 2, 3, 5, 8]
    assert plan.window_tokens.tolist() == want
    assert want == window_token_list(plan.token_out_pages.tolist())
    assert plan.window_tokens.dtype == torch.int32
    assert (plan.window_tokens.untyped_storage().data_ptr()
            == plan.query_start.untyped_storage().data_ptr())
    assert plan.varlen.window_tokens is plan.window_tokens
    # With the slab writer off (KernelPolicy.conv_window_slabs="off") the plan carries no
    # list: the conv takes the full-grid writer.
    import dataclasses

    off = plan_states(batch, dataclasses.replace(policy, conv_window_slabs="off"),
                      torch.device("cpu"), torch.float32, varlen=True)
    assert off.window_tokens is None and off.varlen.window_tokens is None
    assert off.token_out_pages.tolist() == plan.token_out_pages.tolist()


def test_path_fields_default_to_their_path():
    """``conv_window_slabs`` / ``attention_splits`` default to "auto", which takes the
    path on every device, CUDA included (its kernels passed their `gpu` tests: the plan
    test above takes the slab writer under the default policy); the policy refuses
    values other than "auto" / "on" / "off"."""
    from hybridserve.config import KernelPolicy

    for field in ("conv_window_slabs", "attention_splits"):
        assert getattr(KernelPolicy(), field) == "auto"
        with pytest.raises(ValueError, match=field):
            KernelPolicy(**{field: "yes"})


@interpreted
def test_checkpoint_windows_every_64_tokens_through_the_model(tmp_path, monkeypatch):
    """Prefix-cache checkpoints through a model step on the short-row path, its conv the
    Triton kernel (writing through the slab writer): a fresh 150-token prompt with the
    state after every 64th token, beside a one-token row and a two-token row (shorter
    than the conv's window); then a row resumed from the checkpoint after token 127 beside
    the short rows continued from their pages (windows partly from their initial ones).
    The first Mamba layer's windows (copies of its inputs) are bit for bit the per-row
    path's and every layer's states match; the resumed row gives the cold run's logits
    for the tokens after the checkpoint. The
    recurrence runs through its twin (its kernel is tests/kernels/test_mamba_short.py's;
    under the interpreter it would take most of a minute here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver, Sequence

    from hybridserve.config import KernelPolicy
    from hybridserve.kernels import mamba_decode
    from hybridserve.models.layers import mamba2
    from hybridserve.models.loader import load_model
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    seed = _seed()
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=seed % 1000, layers="M*-M")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 250, (150,), generator=g).tolist()
    short = {1: torch.randint(3, 250, (1,), generator=g).tolist(),
             2: torch.randint(3, 250, (2,), generator=g).tolist()}
    more = {1: torch.randint(3, 250, (1,), generator=g).tolist(),
            2: torch.randint(3, 250, (2,), generator=g).tolist()}
    lists = []
    real = mamba2.conv_varlen

    def spy(*args, window_tokens=None, **kwargs):
        lists.append(None if window_tokens is None else window_tokens.tolist())
        return real(*args, window_tokens=window_tokens, **kwargs)

    monkeypatch.setattr(mamba2, "conv_varlen", spy)
    monkeypatch.setattr(mamba_decode, "ssm_update", mamba_decode.ssm_update_reference)
    runs = {}
    for mode in ("triton", "off"):
        model = load_model(path, dtype=torch.float32,
                           policy=KernelPolicy(short_rows=mode, packed_prefill="off"))
        layers = model.cache_spec.mamba_layers
        d = PagedDriver(model)
        lists.clear()
        cold, pages = d.step([(0, prompt), *short.items()], {0: [63, 127]})
        states = {(1, sid, off, layer): (d.conv_state(layer, page), d.ssm_state(layer, page))
                  for sid, offs in pages.items() for off, page in offs.items()
                  for layer in layers}
        # A prefix-cache hit: the first 128 tokens' KV blocks and the checkpoint's page.
        bs = d.block_size
        d.seqs[3] = Sequence(tokens=prompt[:128], blocks=d.seqs[0].blocks[: 128 // bs],
                             state_page=pages[0][127])
        resumed, pages = d.step([(3, prompt[128:]), *more.items()])
        states.update({
            (2, sid, off, layer): (d.conv_state(layer, page), d.ssm_state(layer, page))
            for sid, offs in pages.items() for off, page in offs.items() for layer in layers
        })
        runs[mode] = (cold, resumed[:22], states)
        if mode == "triton":
            # Every conv took the slab writer, over the requested tokens only.
            want = [[63, 127, 149, 150, 152]] * len(layers) + [[21, 22, 24]] * len(layers)
            assert lists == want, lists
    (tc, tr, ts), (oc, orr, os_) = runs["triton"], runs["off"]
    assert ts.keys() == os_.keys() and not tc.isnan().any()
    for key in ts:
        if key[3] == layers[0]:
            assert torch.equal(ts[key][0], os_[key][0]), key
        torch.testing.assert_close(ts[key][0], os_[key][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ts[key][1], os_[key][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tc, oc, rtol=1e-4, atol=1e-4)
    # The checkpoint resumes the cold run: the same logits after token 127, on each path.
    torch.testing.assert_close(tr, tc[128:150], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(orr, oc[128:150], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slabs", [True, False])
def test_gpu_windows_bit_for_bit(slabs, cache_dtype):
    """Both window writers compiled, at the 8B conv width: windows every 64 tokens and at
    row ends beside rows shorter than the window, bit for bit the twin's (bf16 inputs;
    float32 pages take the initial entries through bf16 on both sides: their values carry
    low bits under half a bf16 ulp, which the cast drops whichever way it rounds)."""
    g = torch.Generator().manual_seed(_seed())
    lens = [4096, 1, 0, 2, 777, 1500, 3]
    xbc, weight, bias, cache, qs, in_pages = _step(g, lens, 10240, 4, torch.bfloat16,
                                                   cache_dtype=cache_dtype, num_pages=200,
                                                   with_pages=0.9)
    if cache_dtype == torch.float32:
        bits = cache.view(torch.int32)
        bits.copy_((bits & -65536) | 0x1234)
    # Pages: every 64th token of each row and its last one, never an input page.
    free = [p for p in range(cache.shape[0]) if p not in set(in_pages.tolist())]
    out_pages = torch.full((sum(lens),), -1, dtype=torch.int64)
    for r, n in enumerate(lens):
        for off in sorted({*range(63, n, 64), n - 1} if n else set()):
            out_pages[int(qs[r]) + off] = free.pop()
    args = [t.cuda() for t in (xbc, weight, bias, cache, qs, in_pages)]
    twin = args[3].clone()
    want = conv_varlen_reference(*args[:3], twin, *args[4:], "silu", out_pages=out_pages.cuda())
    listed = _window_tokens(out_pages).cuda() if slabs else None
    got = conv_varlen(*args, "silu", out_pages=out_pages.cuda(), window_tokens=listed)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 1e-2
    written = out_pages[out_pages >= 0].cuda()
    assert torch.equal(args[3][written], twin[written])


@interpreted
def test_engine_checkpoints_on_the_64_token_grid_are_exact(tmp_path, monkeypatch):
    """Through the engine with prefix caching (checkpoints every 64 tokens, a later prompt
    resuming from one), the short-row path's conv the Triton kernel with the slab writer:
    every live checkpoint's conv window and state equal a cold run's through the per-row
    path (an oracle that shares no kernel with the engine's path), and the resumed prompt's
    greedy tokens the per-row engine's. The recurrence runs through its twin (its kernel
    has its own tests; under the interpreter it would take minutes here)."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.cache.block_pool import block_hashes
    from hybridserve.config import KernelPolicy
    from hybridserve.kernels import mamba_decode
    from hybridserve.models.layers import mamba2
    from hybridserve.models.loader import with_kernel_policy
    from hybridserve.testing.reference import reference_state
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    seed = _seed()
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=seed % 1000, layers="M*-M")
    g = torch.Generator().manual_seed(seed)
    root = torch.randint(3, 250, (150,), generator=g).tolist()
    prompts = [root + torch.randint(3, 250, (5,), generator=g).tolist(),
               root[:133] + torch.randint(3, 250, (9,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    lists = []
    real = mamba2.conv_varlen

    def spy(*args, window_tokens=None, **kwargs):
        lists.append(None if window_tokens is None else window_tokens.numel())
        return real(*args, window_tokens=window_tokens, **kwargs)

    monkeypatch.setattr(mamba2, "conv_varlen", spy)
    monkeypatch.setattr(mamba_decode, "ssm_update", mamba_decode.ssm_update_reference)
    outputs = {}
    for mode in ("triton", "off"):
        llm = LLM(path, dtype="float32", state_interval=64, max_num_batched_tokens=256,
                  kernel_policy=KernelPolicy(short_rows=mode, packed_prefill="off"))
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert outs[1].num_cached_tokens >= 128  # resumed from the checkpoint at 128
        outputs[mode] = [o.outputs[0].token_ids for o in outs]
        if mode == "triton":
            engine = llm
    assert outputs["triton"] == outputs["off"]
    # The slab writer took every conv; one step wrote the grid's windows inside a row.
    assert lists and None not in lists and max(lists) >= 3, lists
    # Every live checkpoint against a cold run on the per-row path.
    oracle = with_kernel_policy(engine.model, KernelPolicy(short_rows="off", packed_prefill="off"))
    sched, caches = engine.engine.scheduler, engine.engine.runner.caches
    prefixes = {}
    for seq in [p + o for p, o in zip(prompts, outputs["triton"])] + prompts:
        for i, h in enumerate(block_hashes(seq, sched.block_size)):
            prefixes.setdefault(h, seq[: (i + 1) * sched.block_size])
    lengths = set()
    for key, ckpt in sched.states.checkpoints.items():
        conv, ssm = reference_state(oracle, prefixes[key], ckpt.length)
        for layer in conv:
            torch.testing.assert_close(caches.conv[layer][ckpt.page], conv[layer],
                                       rtol=0, atol=1e-5)
            # Two float32 recurrences in different orders (token by token, the per-row
            # path): states reach ~20, so the bound is relative too (the file's 1e-5).
            torch.testing.assert_close(caches.ssm[layer][ckpt.page], ssm[layer],
                                       rtol=1e-5, atol=1e-5)
        lengths.add(ckpt.length)
    assert {64, 128} <= lengths, lengths
