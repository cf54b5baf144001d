"""Short rows of a packed step: the recurrence (:func:`~hybridserve.kernels.mamba_decode.ssm_update`
over rows of any length) against its twin and the per-token
float64 reference, NaN-poisoned pages, the race checker and three program orders; the
plan; and the mixer's short-row path against its per-row path on whole model steps.

GPU tests (``-m gpu``) compile the kernel: run them with ``TRITON_INTERPRET=0``.
"""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest
import torch

from hybridserve.config import KernelPolicy
from hybridserve.kernels.mamba_decode import ssm_update, ssm_update_reference
from hybridserve.kernels.ssd import ssd_recurrent_reference
from hybridserve.kernels.ssd_varlen import discretize_dt_varlen
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.step_plan import StepKind, plan_states, short_walk

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"

if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _step(g, lens, heads, head_dim, groups, d_state, dtype, cache_dtype=None):
    """Random inputs for rows of ``lens`` tokens: some rows start from a page, some from
    zeros; some tokens request their state. Every page but the input pages is NaN, page 0
    included (no input), so a read of anything else shows up. ``dt`` is raw (the
    projection's); the last item holds the keyword operands: ``dt_bias``, a clamp that
    bites on some tokens, and some tokens that skip it (``unclamped``)."""
    rows = len(lens)
    qs = [0]
    for q in lens:
        qs.append(qs[-1] + q)
    t = qs[-1]
    num_pages = 1 + rows + t
    x = torch.randn(t, heads, head_dim, generator=g, dtype=dtype)
    dt = torch.randn(t, heads, generator=g, dtype=dtype) * 1.5 - 0.5
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 4 + 0.5)
    B = torch.randn(t, groups, d_state, generator=g, dtype=dtype)
    C = torch.randn(t, groups, d_state, generator=g, dtype=dtype)
    D = torch.randn(heads, generator=g, dtype=dtype)
    cache = torch.full((num_pages, heads, head_dim, d_state), float("nan"),
                       dtype=cache_dtype or dtype)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    in_pages = [perm.pop() if bool(torch.rand((), generator=g) < 0.7) else -1 for _ in lens]
    if rows > 1:  # both kinds of row, whatever the draw
        in_pages[0] = -1
        in_pages[-1] = in_pages[-1] if in_pages[-1] >= 0 else perm.pop()
    for p in in_pages:
        if p >= 0:
            cache[p] = torch.randn(cache.shape[1:], generator=g).to(cache.dtype)
    out_pages = [perm.pop() if bool(torch.rand((), generator=g) < 0.4) else -1 for _ in range(t)]
    for r in range(rows):  # every non-empty row writes its last state, as the engine does
        if lens[r] and out_pages[qs[r + 1] - 1] < 0:
            out_pages[qs[r + 1] - 1] = perm.pop()
    as_int = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kw = dict(
        dt_bias=torch.randn(heads, generator=g, dtype=dtype) * 0.5,
        time_step_limit=(0.15, 1.2),
        unclamped=torch.rand(t, generator=g) < 0.3,
    )
    return x, dt, A, B, C, D, cache, as_int(qs), as_int(in_pages), as_int(out_pages), kw


LENS = [[5, 0, 1, 9, 2], [17], [1, 1, 1], [0, 3, 0, 12]]


@pytest.mark.parametrize("lens", LENS)
def test_twin_matches_per_token_reference_float64(lens):
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, cache, qs, in_pages, out_pages, kw = _step(
        g, lens, 6, 4, 3, 8, torch.float64
    )
    before = cache.clone()
    y = ssm_update_reference(x, dt, A, B, C, D, cache, in_pages, out_pages, qs, **kw)
    dt = discretize_dt_varlen(dt, kw["dt_bias"], kw["time_step_limit"], kw["unclamped"])
    for r in range(len(lens)):
        s, e = int(qs[r]), int(qs[r + 1])
        if s == e:
            continue
        page = int(in_pages[r])
        y_ref, states = ssd_recurrent_reference(
            x[s:e], dt[s:e], A, B[s:e], C[s:e], D, before[page] if page >= 0 else None
        )
        torch.testing.assert_close(y[s:e], y_ref, rtol=1e-12, atol=1e-12)
        for t in range(s, e):
            if out_pages[t] >= 0:
                torch.testing.assert_close(cache[int(out_pages[t])], states[t - s],
                                           rtol=1e-12, atol=1e-12)
    written = set(out_pages[out_pages >= 0].tolist())
    untouched = [p for p in range(cache.shape[0]) if p not in written]
    assert torch.equal(cache[untouched].nan_to_num(7.0), before[untouched].nan_to_num(7.0))


# How the kernel walks rows of any length: token by token, token by token with the next
# token's operands loaded ahead, in chunks of 16 or 32 tokens.
WALKS = [dict(prefetch=False), dict(prefetch=True), dict(chunk=16), dict(chunk=32)]
WALK_IDS = ["tokens", "prefetch", "chunks16", "chunks32"]


@interpreted
@pytest.mark.parametrize("walk", WALKS, ids=WALK_IDS)
@pytest.mark.parametrize(
    "lens,heads,head_dim,groups,d_state",
    [(LENS[0], 4, 8, 2, 16), (LENS[1], 2, 12, 1, 8), (LENS[3], 6, 5, 3, 12), (LENS[2], 4, 4, 4, 4)],
)
def test_kernel_matches_twin_race_free(lens, heads, head_dim, groups, d_state, walk):
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, cache, qs, in_pages, out_pages, kw = _step(
        g, lens, heads, head_dim, groups, d_state, torch.float32
    )
    want_cache = cache.clone()
    want = ssm_update_reference(x, dt, A, B, C, D, want_cache, in_pages, out_pages, qs, **kw)
    with racecheck.record_launches() as rec:
        got = ssm_update(x, dt, A, B, C, D, cache, in_pages, out_pages, qs, **kw, **walk)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Written pages equal the twin's; every other page keeps its (NaN or random) contents.
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert not cache[out_pages[out_pages >= 0].long()].isnan().any()


@interpreted
@pytest.mark.parametrize("walk", [WALKS[0], WALKS[2]], ids=["tokens", "chunks16"])
def test_kernel_bf16_state_pages_and_no_d(walk):
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, _, cache, qs, in_pages, out_pages, kw = _step(
        g, [3, 4], 4, 8, 2, 8, torch.float32, cache_dtype=torch.bfloat16
    )
    want_cache = cache.clone()
    want = ssm_update_reference(x, dt, A, B, C, None, want_cache, in_pages, out_pages, qs, **kw)
    got = ssm_update(x, dt, A, B, C, None, cache, in_pages, out_pages, qs, **kw, **walk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=1e-2, atol=1e-2,
                               equal_nan=True)


@interpreted
@pytest.mark.parametrize("walk", WALKS, ids=WALK_IDS)
def test_kernel_independent_of_program_order(walk):
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, D, cache, qs, in_pages, out_pages, kw = _step(
        g, [4, 0, 2, 6], 4, 8, 2, 8, torch.float32
    )

    def launch(x, dt, A, B, C, D, ssm_cache, query_start, in_pages, out_pages):
        return ssm_update(x, dt, A, B, C, D, ssm_cache, in_pages, out_pages, query_start, **kw,
                          **walk)

    report = racecheck.run_launcher_in_orders(
        launch,
        lambda: dict(x=x, dt=dt, A=A, B=B, C=C, D=D, ssm_cache=cache.clone(), query_start=qs,
                     in_pages=in_pages, out_pages=out_pages),
    )
    assert report.consistent, str(report)


@interpreted
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunks_on_a_state_grid_match_float64(chunk):
    """The chunked walk where its chunks are full: long rows that start from pages at
    offsets off the chunk grid, states asked for on a grid of 24 tokens and at each row's
    end (as the engine asks on its grid), decode rows beside them. Outputs and written
    states in float32 against the float64 twin, and against the token walk."""
    g = torch.Generator().manual_seed(_seed())
    lens, offsets, interval = [100, 1, 0, 45, 1, 33], [7, 40, 0, 0, 3, 61], 24
    x, dt, A, B, C, D, cache, qs, in_pages, _, kw = _step(g, lens, 4, 20, 2, 24,
                                                          torch.float64)
    outs, page = [], cache.shape[0]
    for r, n in enumerate(lens):
        for i in range(n):
            asked = (offsets[r] + i + 1) % interval == 0 or i == n - 1
            outs.append(page if asked else -1)
            page += 1 if asked else 0
    cache = torch.cat([cache, cache.new_full((page - cache.shape[0], *cache.shape[1:]),
                                             float("nan"))])
    out_pages = torch.tensor(outs, dtype=torch.int32)
    want_cache = cache.clone()
    want = ssm_update_reference(x, dt, A, B, C, D, want_cache, in_pages, out_pages, qs, **kw)
    f32 = lambda v: v.float() if v.is_floating_point() else v  # noqa: E731
    got_cache, walk_cache = f32(cache), f32(cache)
    args = [f32(v) for v in (x, dt, A, B, C, D)]
    kw32 = {k: f32(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = ssm_update(*args, got_cache, in_pages, out_pages, qs, **kw32, chunk=chunk)
    walk = ssm_update(*args, walk_cache, in_pages, out_pages, qs, **kw32)
    written = out_pages[out_pages >= 0].long()

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    y_err, y_walk = rel(got, want), rel(walk, want)
    s_err = rel(got_cache[written], want_cache[written])
    s_walk = rel(walk_cache[written], want_cache[written])
    assert y_err < 5e-7 and s_err < 5e-7, (y_err, s_err)
    # As close to the float64 twin as the token walk (1e-7 here); decays taken as
    # differences of cumulative sums were 3-30x further off on these fast-decaying heads.
    assert y_err < 2 * y_walk and s_err < 2 * s_walk, (y_err, y_walk, s_err, s_walk)
    assert not got_cache[written].isnan().any()
    untouched = [p for p in range(cache.shape[0]) if p not in set(written.tolist())]
    assert got_cache[untouched].isnan().equal(cache[untouched].isnan())


def test_chunk_must_be_a_power_of_two_of_at_least_16():
    g = torch.Generator().manual_seed(0)
    x, dt, A, B, C, D, cache, qs, in_pages, out_pages, kw = _step(g, [3], 2, 4, 1, 4,
                                                                  torch.float32)
    for bad in (8, 24):
        with pytest.raises(ValueError, match="chunk"):
            ssm_update(x, dt, A, B, C, D, cache, in_pages, out_pages, qs, **kw, chunk=bad)


def test_short_row_chunks_policy_and_plan():
    """``KernelPolicy.short_row_chunks`` "auto" and "on" walk short rows in chunks (on
    CUDA too: its `gpu` test has passed), "off" token by token; a short step's plan
    carries the chunk; the twin walks token by token; the policy refuses other values."""
    with pytest.raises(ValueError, match="short_row_chunks"):
        KernelPolicy(short_row_chunks="16")
    batch = _batch([3, 1], [4, -1], [[(2, 6)], [(0, 7)]])
    for mode, want in (("auto", 16), ("on", 16), ("off", 0)):
        policy = KernelPolicy(short_rows="triton", short_row_chunks=mode)
        plan = plan_states(batch, policy, torch.device("cpu"), torch.float32)
        assert plan.kind is StepKind.SHORT and plan.chunk == want
    plan = plan_states(batch, KernelPolicy(short_rows="reference"), torch.device("cpu"),
                       torch.float32)
    assert plan.kind is StepKind.SHORT and plan.chunk == 0
    cuda = torch.device("cuda")
    for mode, want in (("auto", 16), ("on", 16), ("off", 0)):
        assert short_walk(KernelPolicy(short_row_chunks=mode), cuda, True)["chunk"] == want
    assert short_walk(KernelPolicy(), cuda, False)["chunk"] == 0


@interpreted
def test_prefetch_gives_the_same_bits():
    """Loading a token's operands one token ahead moves loads, not arithmetic: outputs
    and written pages equal the plain loop's bit for bit, over rows of 0, 1 and many
    tokens (the prefetch past a row's end reads nothing), with bf16 pages, no D, and
    single-token rows that skip the clamp."""
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, C, _, cache, qs, in_pages, out_pages, kw = _step(
        g, [5, 0, 1, 9, 1, 2], 4, 8, 2, 16, torch.float32, cache_dtype=torch.bfloat16
    )
    lens = (qs[1:] - qs[:-1]).tolist()
    kw["unclamped"] = torch.tensor([n == 1 for n in lens for _ in range(n)])
    runs = []
    for prefetch in (False, True):
        pages = cache.clone()
        y = ssm_update(x, dt, A, B, C, None, pages, in_pages, out_pages, qs, **kw,
                       prefetch=prefetch)
        runs.append((y, pages))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1].nan_to_num(7.0), runs[1][1].nan_to_num(7.0))


def test_prefetch_is_the_default_and_rides_on_the_plan():
    """``KernelPolicy.token_prefetch`` "auto" takes the prefetching loop on every device
    (its `gpu` test passed on the H200); a short step's plan carries the choice; the policy
    refuses other values."""
    from hybridserve.config import KernelPolicy
    from hybridserve.models.step_plan import StepKind, plan_states

    with pytest.raises(ValueError, match="token_prefetch"):
        KernelPolicy(token_prefetch="yes")
    batch = _batch([3, 1], [4, -1], [[(2, 6)], [(0, 7)]])
    for mode, want in (("auto", True), ("on", True), ("off", False)):
        policy = KernelPolicy(short_rows="triton", token_prefetch=mode)
        plan = plan_states(batch, policy, torch.device("cpu"), torch.float32)
        assert plan.kind is StepKind.SHORT and plan.prefetch is want
    plan = plan_states(batch, KernelPolicy(short_rows="reference"), torch.device("cpu"),
                       torch.float32)
    assert plan.kind is StepKind.SHORT and not plan.prefetch  # the twin loads nothing ahead


def _batch(lens, in_pages, outs):
    qs = [0]
    for q in lens:
        qs.append(qs[-1] + q)
    rows = [r for r, o in enumerate(outs) for _ in o]
    offs = [off for o in outs for off, _ in o]
    pages = [page for o in outs for _, page in o]
    t = qs[-1]
    return ForwardBatch(
        query_start=qs, num_computed=[5] * len(lens), positions=torch.arange(t),
        context_lens=[5 + q for q in lens],
        block_tables=torch.zeros(len(lens), 4, dtype=torch.int32),
        slot_mapping=torch.arange(t), state_in_page=in_pages, state_out_row=rows,
        state_out_offset=offs, state_out_page=pages,
    )


def test_plan_lays_out_pages_per_token_and_qualifies_short_steps():
    cpu = torch.device("cpu")

    def short_plan(batch, limit=512):
        policy = KernelPolicy(short_rows="reference", packed_prefill="off",
                              max_short_tokens=limit)
        plan = plan_states(batch, policy, cpu, torch.float32)
        return plan if plan.kind is StepKind.SHORT else None

    plan = short_plan(_batch([3, 1, 2], [4, 5, -1], [[(0, 7), (2, 8)], [(0, 9)], [(1, 10)]]))
    assert plan is not None and plan.num_rows == 3 and not plan.triton
    assert plan.query_start.tolist() == [0, 3, 4, 6]
    assert plan.in_pages.tolist() == [4, 5, -1]
    assert plan.token_out_pages.tolist() == [7, -1, 8, 9, -1, 10]
    assert plan.token_row.tolist() == [0, 0, 0, 1, 2, 2]
    # Only the one-token row that continues from a page skips the dt clamp.
    assert plan.unclamped.tolist() == [False, False, False, True, False, False]
    assert short_plan(_batch([2, 2], [-1, 3], [[(1, 7)], [(1, 8)]])).unclamped is None
    assert short_plan(_batch([4, 1], [1, 2], [[(3, 7)], [(0, 8)]]), limit=4) is not None
    assert short_plan(_batch([5, 1], [1, 2], [[(4, 7)], [(0, 8)]]), limit=4) is None
    # Steps that break the page rule are left to the per-row path.
    assert short_plan(_batch([2, 1], [1, 2], [[(1, 2)], [(0, 8)]])) is None  # reads a write
    assert short_plan(_batch([2, 1], [1, 2], [[(1, 8)], [(0, 8)]])) is None  # one page twice


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=interpreted)])
def test_mixer_short_rows_match_per_row_path(tmp_path, kernels, mixer_paths):
    """Whole model steps of short rows (fresh prompts, continuations of several tokens and
    of one token, rows with extra state requests) through the short-row path equal the
    per-row path: logits and every written state page. The twins in float64 (tight), the
    Triton kernels under the interpreter in float32."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver

    from hybridserve.models.loader import load_model
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    seed = _seed()
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=seed % 1000, layers="M*-M")
    dtype = torch.float32 if kernels else torch.float64
    g = torch.Generator().manual_seed(seed)
    prompts = {i: torch.randint(3, 256, (3 + 4 * i,), generator=g).tolist() for i in range(3)}
    more = {0: torch.randint(3, 256, (6,), generator=g).tolist(),
            1: torch.randint(3, 256, (1,), generator=g).tolist(),
            2: torch.randint(3, 256, (9,), generator=g).tolist()}
    results, paths = [], []
    # "triton": the interpreter runs the CUDA path's kernels on the CPU.
    for mode in ("triton" if kernels else "reference", "off"):
        policy = KernelPolicy(short_rows=mode, packed_prefill="off")
        model = load_model(path, dtype=dtype, policy=policy)
        mixer_paths.clear()
        d = PagedDriver(model)
        first, pages1 = d.step([(i, p) for i, p in prompts.items()], {2: [0, 4]})
        second, pages2 = d.step([(i, t) for i, t in more.items()], {0: [2], 2: [0, 5]})
        states = {
            (step, sid, off, layer): (d.conv_state(layer, page), d.ssm_state(layer, page))
            for step, pages in ((1, pages1), (2, pages2))
            for sid, offs in pages.items()
            for off, page in offs.items()
            for layer in model.cache_spec.mamba_layers
        }
        results.append((torch.cat([first, second]), states))
        paths.append(dict(mixer_paths))
    # Neither step is a uniform decode step: two short-row calls per layer, or rows
    # through the per-row path (three a step, per layer).
    layers = len(model.cache_spec.mamba_layers)
    assert paths == [{"short": 2 * layers}, {"per_row": 6 * layers}], paths
    (fl, fs), (sl, ss) = results
    assert not fl.isnan().any()
    tol = 1e-4 if kernels else 1e-10
    torch.testing.assert_close(fl, sl, rtol=tol, atol=tol)
    assert fs.keys() == ss.keys()
    first_layer = model.cache_spec.mamba_layers[0]
    for key in fs:
        # Windows are copies of the layer's inputs: bit for bit where those inputs are (the
        # first Mamba layer); later layers' inputs carry the paths' rounding differences.
        if key[3] == first_layer:
            assert torch.equal(fs[key][0], ss[key][0]), key
        torch.testing.assert_close(fs[key][0], ss[key][0], rtol=tol, atol=tol)
        torch.testing.assert_close(fs[key][1], ss[key][1], rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("walk", WALKS, ids=WALK_IDS)
def test_gpu_kernel_matches_twin(record_property, walk):
    """8B shapes: a 128-token row from a page (the tail after a cached prefix) beside decode
    rows and a fresh short prompt."""
    g = torch.Generator().manual_seed(_seed())
    *args, kw = _step(g, [128, 1, 1, 37], 128, 64, 8, 128, torch.float32)
    args = [a.cuda() for a in args]
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    want_cache = args[6].clone()
    want = ssm_update_reference(*args[:6], want_cache, *args[8:], args[7], **kw)
    got = ssm_update(*args[:7], *args[8:], args[7], **kw, **walk)
    rel = ((got - want).norm() / want.norm()).item()
    written = args[9][args[9] >= 0].long()
    rel_state = ((args[6][written] - want_cache[written]).norm()
                 / want_cache[written].norm()).item()
    record_property("ssm_short_rel_err", rel)
    print(f"ssm_short: relative error {rel:.3e}, states {rel_state:.3e}")
    assert rel < 1e-5 and rel_state < 1e-5


def test_engine_with_prefix_caching_gives_the_same_tokens_on_the_short_row_path(
    tmp_path, count_calls
):
    """Through the whole engine (chunked prefill, prefix-cache checkpoints on a grid and at
    prompt ends, cache hits that leave short tails, decode): the short-row path's greedy
    tokens equal the per-row path's, and short steps do take it."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.models.layers import mamba2
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    seed = _seed()
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=seed % 1000, layers="M*-M")
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 250, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 11, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # The short path's conv (the packed path, which shares it, is off on the CPU).
    calls = count_calls(mamba2, "conv_varlen_reference")
    outputs = {}
    for mode in ("reference", "off"):
        llm = LLM(path, dtype="float64", kv_block_size=4, state_interval=8,
                  max_num_batched_tokens=24, kernel_policy=KernelPolicy(short_rows=mode))
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)  # hits on the shared prefix
        assert all(r.num_cached_tokens >= 32 for r in rest)
        outputs[mode] = [o.outputs[0].token_ids for o in first + rest]
        if mode == "reference":
            assert calls, "no step took the short-row path"
            taken = len(calls)
    assert len(calls) == taken  # "off" never takes it
    assert outputs["reference"] == outputs["off"]
