"""Short-row graphs (``DecodeGraphs.replay_short``): a prompt's tail after a cached prefix
replayed from a CUDA graph of rows padded to a token bucket. On the CPU (no capture) the
same static-buffer step runs eagerly; these tests check it against the ordinary path (the
same tokens, the same cache entries written), the buffer's layout (padding tokens and
rows), and every fallback to eager. The capture itself is checked on CUDA (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import KernelPolicy
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.runner.cuda_graph import (
    GREEDY,
    DecodeGraphs,
    Sampling,
    ShortShape,
    _ShortStatic,
    short_tokens_bucket,
)
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.step import ScheduledRow, SchedulerOutput
from hybridserve.testing.tiny_models import make_tiny_checkpoint

# The short-row path with its torch twins: the path a cached prompt's tail takes on
# CUDA (with the Triton kernels), which the CPU's "auto" does not take.
SHORT = KernelPolicy(short_rows="reference")
# Gated DeltaNet models: their packed-rows path with the twins too (CUDA's "auto" takes
# it with the kernels).
GDN_SHORT = KernelPolicy(short_rows="reference", gdn_rows="reference")
# Mixture-of-experts models: the routed experts on the grouped kernels (the path CUDA
# takes and captures; the interpreter here), the rest on the twins.
MOE_SHORT = KernelPolicy(short_rows="reference", moe="triton")


@pytest.fixture(scope="module")
def tiny_nemotron_moe(tmp_path_factory):
    """A Nemotron-H with mixture-of-experts layers (Mamba2, MoE, attention, MoE)."""
    return make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron_moe"),
                                seed=6, layers="MEAE")


@pytest.fixture(scope="module")
def tiny_qwen3_5_moe(tmp_path_factory):
    """A Qwen3.5-MoE (Gated DeltaNet, attention; every MLP a mixture of experts). One
    Gated DeltaNet layer: its token-by-token kernel is the slowest under the interpreter."""
    return make_tiny_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_moe"), seed=8,
                                layers="MA")


# (fixture, policy) of the models every static-step test runs.
MODELS = [("tiny_nemotron", SHORT), ("tiny_qwen3_5", GDN_SHORT),
          ("tiny_nemotron_moe", MOE_SHORT)]


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _rebuild(llm: LLM, enforce_eager: bool) -> LLM:
    eng = llm.engine
    llm.engine = None
    llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                            eng.eos_token_ids, enforce_eager=enforce_eager,
                            async_scheduling=False)
    return llm


def _prefill_row(n, q, page, outs, blocks, tokens, samples=True, params=None):
    """A prefill row of ``q`` tokens after ``n`` computed ones; ``outs``: {p: page}."""
    req = Request("x", list(tokens), params or SamplingParams(temperature=0.0), 0)
    req.block_ids = list(blocks)
    return ScheduledRow(request=req, num_computed=n, num_tokens=q, num_drafts=0,
                        samples=samples, state_in_page=page, is_decode=False,
                        state_outputs=dict(outs))


def test_token_buckets():
    assert [short_tokens_bucket(n) for n in (2, 17, 32, 33, 100, 128, 129, 512)] == [
        32, 32, 32, 64, 128, 128, 256, 512]


def _graphs(path, policy=SHORT) -> DecodeGraphs:
    """Graphs for at most 8 rows and 8-block tables; scratch block 60, scratch page 90."""
    llm = LLM(path, kernel_policy=policy)
    return DecodeGraphs(llm.model, llm.engine.runner.caches, 16, 8, 8, 60, 90, "cpu",
                        capture=False)


def test_shape_and_fallbacks(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    model = graphs.model
    toks = list(range(3, 103))

    def row(**kw):
        args = dict(n=40, q=30, page=3, outs={70: 5}, blocks=(1, 2, 3, 4, 5), tokens=toks)
        args.update(kw)
        return _prefill_row(**args)

    def shape(*rows, m=model):
        return graphs.short_shape_of(SchedulerOutput(list(rows), []), m)

    assert shape(row()) == ShortShape(1, 1, 32, 8, SHORT)
    assert shape(row(), row(q=50, page=4, outs={90: 6}, blocks=(1, 2, 3, 4, 6, 7))) == (
        ShortShape(2, 2, 64, 8, SHORT))
    assert shape(row(page=-1, n=0, q=70, outs={70: 5})).tokens == 128  # a cold prompt too
    assert shape(row(samples=False)) is not None  # a middle chunk: its choice is dropped
    decode = row(q=1, outs={41: 5})
    decode.is_decode = True
    assert shape(decode) is None
    assert shape(row(q=1, outs={41: 5})) is None  # one token: the dt clamp exception
    assert shape(row(q=8, outs={48: 5}), row(q=8, page=4, outs={48: 6})) is None  # uniform
    assert shape(row(q=600, n=0, outs={600: 5}, tokens=range(3, 700))) is None  # too long
    assert shape(*[row(page=10 + i, outs={70: 20 + i}) for i in range(9)]) is None
    sampled = shape(row(params=SamplingParams(temperature=0.8, top_k=5, seed=3)))
    assert sampled.sampling == Sampling(any_sampled=True, top_k=8)
    assert sampled.key != shape(row()).key
    # A row that does not sample draws nothing: its parameters do not count.
    assert shape(row(params=SamplingParams(temperature=0.8), samples=False)).sampling == GREEDY
    assert shape(row(params=SamplingParams(temperature=0.8, presence_penalty=0.5))) is None
    assert shape(row(params=SamplingParams(temperature=0.0, logprobs=1))) is None
    assert shape(row(), row(page=5, outs={70: 6})) is None  # writes a page another reads
    assert shape(row(), row(page=4, outs={70: 5})) is None  # repeats an output page
    assert shape(row(outs={71: 5})) is None  # an output past the row
    assert shape(row(blocks=(1, 2, 3))) is None  # blocks missing for the context
    assert shape(row(n=200, blocks=range(20), tokens=range(3, 300))) is None  # too wide
    # The CPU's default policy plans these steps on the packed path: no short graphs.
    default = LLM(tiny_nemotron).model
    assert shape(row(), m=default) is None
    graphs.short_enabled = False
    assert shape(row()) is None


def test_gated_deltanet_models_take_short_graphs(tiny_qwen3_5):
    """A Gated DeltaNet model's short step qualifies where its layers run the packed-rows
    path from device values (the kernels or their twins), and not where that path plans
    from host values (the chunked prefill) or the per-row path runs."""
    row = _prefill_row(40, 30, 3, {70: 5}, (1, 2, 3, 4, 5), range(3, 103))
    sched = SchedulerOutput([row], [])
    for gdn_rows, want in (("reference", True), ("triton", True), ("chunked", False),
                           ("off", False), ("auto", False)):  # "auto": per row on the CPU
        policy = KernelPolicy(short_rows="reference", gdn_rows=gdn_rows)
        graphs = _graphs(tiny_qwen3_5, policy)
        shape = graphs.short_shape_of(sched, graphs.model)
        assert (shape == ShortShape(1, 1, 32, 8, policy)) is want, gdn_rows
        if not want:
            assert shape is None, gdn_rows


def test_moe_short_steps_on_the_expert_loop_are_not_captured(tiny_nemotron_moe):
    """Under capture, a MoE model's short step qualifies on the grouped expert kernels
    (routing on the device) and not on the per-expert loop (it reads the experts present
    back); without capture both qualify (the CPU runs the loop eagerly)."""
    row = _prefill_row(40, 30, 3, {70: 5}, (1, 2, 3, 4, 5), range(3, 103))
    sched = SchedulerOutput([row], [])
    for moe, captured in (("triton", True), ("reference", False), ("auto", False)):
        policy = KernelPolicy(short_rows="reference", prefill_attention="triton", moe=moe)
        graphs = _graphs(tiny_nemotron_moe, policy)
        assert graphs.short_shape_of(sched, graphs.model) is not None, moe
        graphs.capture = True  # only the choice: nothing runs
        assert (graphs.short_shape_of(sched, graphs.model) is not None) is captured, moe


def test_fill_pads_tokens_and_rows(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    toks = list(range(3, 103))
    rows = [_prefill_row(40, 20, 3, {48: 7, 60: 8}, (9, 8, 5, 4), toks),
            _prefill_row(0, 34, -1, {34: 11}, (6, 2, 1), toks)]
    sched = SchedulerOutput(rows, [])
    shape = graphs.short_shape_of(sched, graphs.model)
    assert shape == ShortShape(2, 2, 64, 8, SHORT)  # tables always the widest
    st = _ShortStatic(64, graphs.max_batch, graphs.max_blocks, 60, 90, 16, torch.device("cpu"))
    st.host[:] = 999  # stale values must be overwritten where the step reads them
    three = ShortShape(2, 4, 64, 8, SHORT)  # and a bucket of 4: two padding rows
    graphs.fill_short(st, sched, three)
    m = st.meta
    q, tab = 64, 4 * 64 + 1
    r0 = m[0].tolist()
    assert r0[:20] == toks[40:60] and r0[20:q] == [toks[59]] * 44  # padding repeats
    assert r0[q : q + 20] == list(range(40, 60)) and r0[q + 20 : 2 * q] == [59] * 44
    slots = [[9, 8, 5, 4][p // 16] * 16 + p % 16 for p in range(40, 60)]
    assert r0[2 * q : 2 * q + 20] == slots
    assert r0[2 * q + 20 : 3 * q] == [60 * 16 + t % 16 for t in range(20, 64)]  # scratch
    outs = [-1] * q
    outs[7], outs[19] = 7, 8  # the states after positions 47 and 59
    assert r0[3 * q] == 3 and r0[3 * q + 1 : 4 * q + 1] == outs
    assert r0[tab : tab + 8] == [9, 8, 5, 4, -1, -1, -1, -1] and r0[st.last] == 19
    r1 = m[1].tolist()
    assert r1[:34] == toks[:34] and r1[3 * q] == -1 and r1[3 * q + 34] == 11
    assert r1[tab : tab + 8] == [6, 2, 1] + [-1] * 5 and r1[st.last] == 33
    for r in (2, 3):  # padding rows: position 0, the scratch block and page, no state
        pad = m[r].tolist()
        assert pad[q : 2 * q] == [0] * q and pad[3 * q] == 90
        assert pad[3 * q + 1 : 4 * q + 1] == [-1] * q
        assert pad[tab] == 60 and pad[st.last] == 0
    assert st.context_lens == [60, 34, 1, 1]


# Mamba2's short rows on the Triton kernels (the interpreter): the recurrence's walk
# (prefetch, chunks) comes from the policy in eager and captured steps alike.
KERNELS = ("tiny_nemotron", KernelPolicy(short_rows="triton"))


@pytest.mark.parametrize("fixture,policy", [*MODELS, KERNELS],
                         ids=[m[0] for m in MODELS] + ["tiny_nemotron_kernels"])
def test_static_step_matches_the_eager_step(request, fixture, policy, monkeypatch):
    """One short-row step over random caches (three rows with cached prefixes, one a cold
    start; a bucket of 4 with a padding row; rows padded from 37, 20 and 50 tokens to 64):
    the static-buffer step gives the eager step's tokens and writes the same entries, and
    its Mamba2 recurrence walks the rows as the eager step's does (the policy's
    prefetch and chunks). Mamba2, Gated DeltaNet and mixture-of-experts models."""
    from hybridserve.kernels import mamba_decode

    walks = []
    ssm_update = mamba_decode.ssm_update

    def recorded(*args, **kw):
        walks.append((kw.get("prefetch", False), kw.get("chunk", 0)))
        return ssm_update(*args, **kw)

    monkeypatch.setattr(mamba_decode, "ssm_update", recorded)
    g = torch.Generator().manual_seed(_seed())
    path = request.getfixturevalue(fixture)
    runner = LLM(path, kernel_policy=policy, max_num_seqs=8).engine.runner
    caches = runner.caches
    scratch_block, scratch_page = caches.kv[next(iter(caches.kv))][0].shape[0] - 1, 103
    tensors = [(t, scratch_page) for t in [*caches.conv.values(), *caches.ssm.values()]]
    tensors += [(t, scratch_block) for kv in caches.kv.values() for t in kv]
    for t, _ in tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    pages = torch.randperm(100, generator=g).tolist()
    blocks = torch.randperm(200, generator=g).tolist()
    rows = []
    for i, (n, q) in enumerate([(70, 37), (0, 20), (33, 50)]):
        toks = torch.randint(3, 256, (n + q,), generator=g).tolist()
        outs = {n + q: pages[10 + 2 * i]}
        if q > 16:
            outs[n + 16] = pages[11 + 2 * i]
        rows.append(_prefill_row(n, q, pages[i] if n else -1, outs,
                                 blocks[8 * i : 8 * i + 8], toks, samples=i != 1))
    sched = SchedulerOutput(rows, [])

    def snapshot():
        out = []
        for t, scratch in tensors:
            c = t.clone()
            c[scratch] = 0  # padding writes the scratch block
            out.append(c)
        return out

    start = [t.clone() for t, _ in tensors]
    before = snapshot()
    want = [r.new_tokens for r in runner.execute(sched).rows]
    eager = snapshot()
    eager_walks, walks[:] = list(walks), []
    for (t, _), s in zip(tensors, start):
        t.copy_(s)
    graphs = runner.enable_decode_graphs(8, scratch_block, scratch_page)
    got = [r.new_tokens for r in runner.execute(sched).rows]
    assert set(walks) == set(eager_walks)
    if policy.short_rows == "triton":
        assert eager_walks and set(eager_walks) == {(True, 16)}
    assert graphs.counters["short_graph_steps"] == 1 and graphs.counters["eager_steps"] == 0
    assert got == want and got[1] == [] and len(got[0]) == 1
    for a, b, s in zip(snapshot(), eager, before):
        assert torch.equal(a != s, b != s)  # the same entries written
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # The scratch page is read by the padding row, never written (graphs zero it).
    states = len(caches.conv) + len(caches.ssm)
    for t, _ in tensors[:states]:
        assert not t[scratch_page].any()


def _cached_prompts(g, prefix_len, tails):
    prefix = torch.randint(3, 256, (prefix_len,), generator=g).tolist()
    return prefix, [prefix + torch.randint(3, 256, (t,), generator=g).tolist() for t in tails]


@pytest.mark.parametrize("fixture,policy", [
    ("tiny_nemotron", SHORT), ("tiny_granite", SHORT), ("tiny_qwen3_5", GDN_SHORT),
    ("tiny_qwen3_5_moe", GDN_SHORT), ("tiny_nemotron_moe", SHORT),
])
def test_cached_prefix_generation_same_tokens(request, fixture, policy):
    """Prompts over a cached prefix (checkpoints every 16 tokens): the first token of each
    comes from a short-row graph step, then decode graphs; every token equals the eager
    engine's. Mamba2, Gated DeltaNet and mixture-of-experts models (the experts on the
    per-expert loop here: no capture on the CPU)."""
    path = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(_seed())
    prefix, prompts = _cached_prompts(g, 96, (40, 23, 61))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kw = dict(kernel_policy=policy, enable_prefix_caching=True, state_interval=16,
              max_num_seqs=4)

    def run(enforce_eager):
        llm = _rebuild(LLM(path, **kw), enforce_eager)
        llm.generate([prefix + [5, 6, 7]], params, use_tqdm=False)  # caches the prefix
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert all(o.num_cached_tokens == 96 for o in outs)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.graphs

    want, _ = run(True)
    got, graphs = run(False)
    assert got == want
    assert graphs.counters["short_graph_steps"] >= len(prompts), graphs.counters


def test_sampled_first_tokens_are_the_eager_draws(tiny_nemotron):
    """Seeded sampled requests over a cached prefix (temperature, top-k, top-p, min-p,
    a greedy one beside them, in one step): the short-row graph step draws exactly the
    eager step's first tokens (one counter-based stream)."""
    g = torch.Generator().manual_seed(_seed())
    prefix, prompts = _cached_prompts(g, 64, (40, 23, 61, 35, 50))
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=13, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.05, seed=14, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    ]
    kw = dict(kernel_policy=SHORT, enable_prefix_caching=True, state_interval=16,
              max_num_seqs=8)

    def run(enforce_eager):
        llm = _rebuild(LLM(tiny_nemotron, **kw), enforce_eager)
        llm.generate([prefix + [5, 6, 7]], params[-1], use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.num_cached_tokens == 64 for o in outs)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.graphs

    want, _ = run(True)
    got, graphs = run(False)
    assert got == want
    assert graphs.counters["short_graph_steps"] >= 1, graphs.counters
    assert any(k[0] == "short" and k[-1].any_sampled for k in graphs._graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_nemotron", "tiny_qwen3_5", "tiny_qwen3_5_moe",
                                     "tiny_nemotron_moe"])
def test_captured_short_steps_match_eager_on_cuda(request, fixture):
    """On CUDA: the cached prompts' first tokens replay from captured short-row graphs
    (the Triton short-row path, short-row graphs asked for) and every token equals the
    eager engine's: Mamba2, Gated DeltaNet (its packed-rows kernels) and
    mixture-of-experts (the grouped kernels) models."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(_seed())
    prefix, prompts = _cached_prompts(g, 160, (128, 100, 37))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(device="cuda", enable_prefix_caching=True, state_interval=16, max_num_seqs=4,
              kernel_policy=KernelPolicy(short_graphs="on"))

    def run(enforce_eager):
        llm = _rebuild(LLM(path, **kw), enforce_eager)
        llm.generate([prefix + [5, 6, 7]], params, use_tqdm=False)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert all(o.num_cached_tokens == 160 for o in outs)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.graphs

    want, _ = run(True)
    got, graphs = run(False)
    assert not graphs.capture_errors, graphs.capture_errors
    assert graphs.counters["short_captures"] >= 1, graphs.counters
    assert graphs.counters["short_graph_steps"] >= len(prompts), graphs.counters
    assert got == want


def test_prefill_attention_reuses_a_tile_cache():
    """The tile-map cache a short-row graph passes: filled on the first call, then read
    instead of recomputing (an empty map there runs no program: the output is untouched),
    with the same result as without a cache."""
    from hybridserve.kernels.paged_attention_prefill import paged_attention_prefill_triton

    g = torch.Generator().manual_seed(_seed())
    k = torch.randn(4, 16, 1, 16, generator=g)
    v = torch.randn(4, 16, 1, 16, generator=g)
    q = torch.randn(7, 2, 16, generator=g)
    tables = torch.tensor([[2, 0], [3, -1]], dtype=torch.int32)
    positions = torch.tensor([17, 18, 19, 20, 3, 4, 5])
    args = (q, k, v, [0, 4, 7], [17, 3], tables, positions, 0.25)
    want = paged_attention_prefill_triton(*args)
    cache: dict[int, torch.Tensor] = {}
    got = paged_attention_prefill_triton(*args, tile_cache=cache)
    assert torch.equal(got, want) and len(cache) == 1
    assert torch.equal(paged_attention_prefill_triton(*args, tile_cache=cache), want)
    per_tile = next(iter(cache))
    cache[per_tile] = cache[per_tile][:0]
    out = torch.full_like(q, 7.0)
    paged_attention_prefill_triton(*args, tile_cache=cache, out=out)
    assert (out == 7.0).all()


def test_a_repeated_static_step_uploads_no_tile_map(tiny_nemotron, monkeypatch):
    """With the Triton prefill attention (the interpreter here; what a CUDA capture
    records), the static short-row step computes the prefill attention's tile map once, on its first
    run (the warm-up before a capture), and a second run of the same shape (the capture)
    reads it from the buffer's cache: nothing is computed or uploaded inside a capture.
    Both runs give the same tokens. An eager step computes one map for all its attention
    layers as well."""
    from hybridserve.kernels import paged_attention_prefill

    # The attention on its Triton kernel; the Mamba layers on their twins (faster here).
    policy = KernelPolicy(short_rows="reference", prefill_attention="triton")
    graphs = _graphs(tiny_nemotron, policy)
    calls = []
    real = paged_attention_prefill.prefill_tiles
    monkeypatch.setattr(paged_attention_prefill, "prefill_tiles",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    toks = torch.randint(3, 256, (40,)).tolist()
    row = _prefill_row(20, 20, 3, {40: 5}, (1, 2, 3), toks)
    sched = SchedulerOutput([row], [])
    shape = graphs.short_shape_of(sched, graphs.model)
    assert shape is not None and shape.tokens == 32
    st = _ShortStatic(32, graphs.max_batch, graphs.max_blocks, 60, 90, 16, torch.device("cpu"))
    graphs.fill_short(st, sched, shape)
    first = graphs._short_forward(st, shape, graphs.model)
    attention_layers = len(graphs.caches.kv)
    assert attention_layers and len(calls) == 1  # one map for every attention layer
    second = graphs._short_forward(st, shape, graphs.model)
    assert len(calls) == 1
    assert torch.equal(first[: shape.rows], second[: shape.rows])
    # And the eager step's token (the same caches: the step rewrites what it writes),
    # whose attention layers share one tile map too.
    assert attention_layers >= 2
    runner = ModelRunner(graphs.model, graphs.caches, 16, 8)
    assert runner.execute(sched).rows[0].new_tokens == first[:1].tolist()
    assert len(calls) == 2


@pytest.mark.parametrize("splits_policy", ["auto", "on", "off"])
def test_only_graph_steps_split_the_prefill_attention(tiny_nemotron, monkeypatch, splits_policy):
    """The prefill attention's key split (``prefill_splits``) is asked for in the static
    short-row step (a captured step's launch) and, under ``attention_splits="auto"``,
    never in the eager step of the same rows, whose attention stays unsplit; "on" asks
    for it in both, "off" in neither. Every mode gives the same token."""
    from hybridserve.kernels import paged_attention_prefill

    policy = KernelPolicy(short_rows="reference", prefill_attention="triton",
                          attention_splits=splits_policy)
    graphs = _graphs(tiny_nemotron, policy)
    asked = []
    real = paged_attention_prefill.paged_attention_prefill_triton

    def spy(*args, **kwargs):
        asked.append(kwargs.get("splits"))
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention_prefill, "paged_attention_prefill_triton", spy)
    toks = torch.randint(3, 256, (40,)).tolist()
    row = _prefill_row(20, 20, 3, {40: 5}, (1, 2, 3), toks)
    sched = SchedulerOutput([row], [])
    shape = graphs.short_shape_of(sched, graphs.model)
    st = _ShortStatic(32, graphs.max_batch, graphs.max_blocks, 60, 90, 16, torch.device("cpu"))
    graphs.fill_short(st, sched, shape)
    token = graphs._short_forward(st, shape, graphs.model)[:1].tolist()
    layers = len(graphs.caches.kv)
    assert asked == [1 if splits_policy == "off" else None] * layers
    asked.clear()
    runner = ModelRunner(graphs.model, graphs.caches, 16, 8)
    assert runner.execute(sched).rows[0].new_tokens == token
    assert asked == [None if splits_policy == "on" else 1] * layers


def test_short_graphs_policy_turns_short_graphs_on_and_off(tiny_nemotron):
    """``short_graphs``: "auto" and "on" replay short steps from graphs, captured or
    not; "off" turns them off."""
    llm = LLM(tiny_nemotron)
    caches = llm.engine.runner.caches
    for mode, capture, want in (("auto", False, True), ("off", False, False), ("on", False, True)):
        model = LLM(tiny_nemotron, kernel_policy=KernelPolicy(short_graphs=mode)).model
        graphs = DecodeGraphs(model, caches, 16, 8, 8, 60, 90, "cpu", capture=capture)
        assert graphs.short_enabled is want, mode
    with pytest.raises(ValueError, match="short_graphs"):
        KernelPolicy(short_graphs="yes")


# Tensor methods that read device values on the host (a CUDA graph cannot replay them).
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__",
              "__index__")


def _host_reads(monkeypatch, fn, *args):
    """Run ``fn(*args)``; return its result, every host read of a tensor value made from the
    package's code during it, and the plans its Gated DeltaNet layers got."""
    import sys
    from pathlib import Path

    import hybridserve
    from hybridserve.models.layers import gated_deltanet

    package = str(Path(hybridserve.__file__).parent)
    reads, plans = [], []
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def spy(self, *a, _real=real, _name=name, **k):
                frame = sys._getframe(1)
                if frame.f_code.co_filename.startswith(package):
                    reads.append(f"{_name} at {frame.f_code.co_filename}:{frame.f_lineno}")
                return _real(self, *a, **k)

            patch.setattr(torch.Tensor, name, spy)
        real_rows = gated_deltanet.GatedDeltaNet._packed_rows
        patch.setattr(gated_deltanet.GatedDeltaNet, "_packed_rows",
                      lambda self, *a, **k: plans.append(a[3]) or real_rows(self, *a, **k))
        out = fn(*args)
    return out, reads, plans


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_moe", "tiny_nemotron_moe"])
def test_static_short_step_reads_nothing_back(request, fixture, monkeypatch):
    """The static short-row step of Gated DeltaNet and mixture-of-experts models on the
    Triton kernels (the interpreter here; what CUDA captures): no package code reads a
    tensor's value on the host during the step, and its Gated DeltaNet plans hold device
    tensors and no host pages. The same step on the twins (which read their index tensors
    back, as the per-expert loop reads the experts present), over the same random caches,
    gives the same tokens and shows the spy sees such reads."""
    kernels = dict(short_rows="triton", gdn_rows="triton", moe="triton",
                   prefill_attention="triton")
    path = request.getfixturevalue(fixture)
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, 256, (45,), generator=g).tolist()
    rows = [_prefill_row(20, 25, 3, {32: 5, 45: 6}, (1, 2, 3), toks),
            _prefill_row(0, 18, -1, {18: 7}, (4, 5), toks)]
    sched = SchedulerOutput(rows, [])
    tokens = []
    for twins in (False, True):
        policy = KernelPolicy(**{**kernels, **(
            dict(short_rows="reference", gdn_rows="reference", moe="reference",
                 prefill_attention="auto") if twins else {})})
        graphs = _graphs(path, policy)
        g = torch.Generator().manual_seed(seed)
        caches = graphs.caches
        for t in [*caches.state_tensors(), *(x for kv in caches.kv.values() for x in kv)]:
            t.copy_(torch.randn(t.shape, generator=g))
        shape = graphs.short_shape_of(sched, graphs.model)
        assert shape == ShortShape(2, 2, 32, 8, policy)
        st = _ShortStatic(32, graphs.max_batch, graphs.max_blocks, 60, 90, 16,
                          torch.device("cpu"))
        graphs.fill_short(st, sched, shape)
        got, reads, plans = _host_reads(monkeypatch, graphs._short_forward, st, shape,
                                        graphs.model)
        tokens.append(got[: shape.rows].tolist())
        if twins:
            assert reads, "the twins' host reads went unseen"
            continue
        assert reads == []
        assert len(plans) == len(graphs.model.cache_spec.gdn_layers)
        for plan in plans:
            assert plan.token_out_pages_host is None
            for field in ("query_start", "in_pages", "token_out_pages", "token_row"):
                assert isinstance(getattr(plan, field), torch.Tensor)
    assert tokens[0] == tokens[1]
