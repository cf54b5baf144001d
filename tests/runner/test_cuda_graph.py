"""Decode graphs (hybridserve.runner.cuda_graph) on the CPU: capture needs CUDA, so these
run the same static-buffer step eagerly (``enforce_eager=False`` off CUDA) and check it
against the ordinary path: the same tokens, padding rows that write only the scratch
block, bucket selection, the static buffer's contents and every fallback to eager."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledRow, SchedulerOutput
from hybridserve.runner.cuda_graph import (
    DecodeGraphs,
    Sampling,
    StepShape,
    _Static,
    batch_bucket,
    blocks_bucket,
)


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def graph_llm(path, async_scheduling=False, **kw) -> LLM:
    """An LLM whose engine takes the decode-graph path (without capture on the CPU);
    every step read back before the next unless ``async_scheduling``."""
    llm = LLM(path, **kw)
    eng = llm.engine
    llm.engine = None
    llm.engine = EngineCore(
        llm.config, llm.model, llm.tokenizer, eng.vocab_size, eng.eos_token_ids,
        enforce_eager=False, async_scheduling=async_scheduling,
    )
    return llm


def test_buckets():
    buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [batch_bucket(n, buckets) for n in (1, 2, 3, 5, 16, 17, 200, 256)] == [
        1, 2, 4, 8, 16, 32, 256, 256]
    assert batch_bucket(257, buckets) is None
    assert [blocks_bucket(n, 256) for n in (1, 2, 3, 17, 32, 33, 48, 49, 250)] == [
        1, 2, 4, 32, 32, 48, 48, 64, 256]
    assert blocks_bucket(40, 36) == 36


def test_default_off_on_cpu_and_capture_needs_cuda(tiny_nemotron):
    llm = LLM(tiny_nemotron)
    assert llm.engine.runner.graphs is None
    with pytest.raises(ValueError, match="CUDA"):
        llm.engine.runner.enable_decode_graphs(8, 0, 0, capture=True)


def _graphs_against_eager(path, params, spec) -> dict:
    """Five prompts (the bucket of 8 has three padding rows), repetitive so n-gram drafts
    get accepted (verify rows of several tokens): the graph path's tokens must equal the
    eager path's. Returns the graph counters."""
    g = torch.Generator().manual_seed(_seed())
    prompts = [(torch.randint(3, 256, (5,), generator=g).tolist() * 4)[: 9 + 2 * i]
               for i in range(5)]
    kw = dict(max_num_seqs=8, speculative_config=spec)
    want = [o.outputs[0].token_ids for o in
            LLM(path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = graph_llm(path, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    counters = llm.engine.runner.graphs.counters
    assert counters["graph_steps"] > 0, counters
    return counters


@pytest.mark.parametrize("fixture", ["tiny_granite", "tiny_nemotron", "tiny_bamba", "tiny_qwen3_5"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2}])
def test_same_tokens_as_eager(request, fixture, spec):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    counters = _graphs_against_eager(request.getfixturevalue(fixture), params, spec)
    assert counters["eager_steps"] > 0, counters  # the prefill steps


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def test_padding_rows_write_only_the_scratch_block(tiny_granite):
    llm = graph_llm(tiny_granite, max_num_seqs=8)
    eng = llm.engine
    runner = eng.runner
    graphs = runner.graphs
    g = torch.Generator().manual_seed(_seed())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):  # three rows: one padding row in the bucket of 4
        eng.add_request(f"r{i}", torch.randint(3, 256, (7 + i,), generator=g).tolist(), params)
    caches = runner.caches
    bs = runner.block_size
    scratch = graphs.scratch_block
    checked = []
    original = runner.execute

    def spy(sched, *args):
        pages = {p for row in sched.rows for p in row.state_outputs.values()}
        # The step's output pages are fresh: poison them, so a write shows even where it
        # stores the bits the page held (a repeated token gives the first layer's conv
        # window the same contents on every step).
        for name in ("conv", "ssm"):
            for t in getattr(caches, name).values():
                t[sorted(pages)] = float("nan")
        before = {
            "kv": {k: (a.clone(), b.clone()) for k, (a, b) in caches.kv.items()},
            "conv": {k: v.clone() for k, v in caches.conv.items()},
            "ssm": {k: v.clone() for k, v in caches.ssm.items()},
        }
        slots = {
            row.request.block_ids[pos // bs] * bs + pos % bs
            for row in sched.rows
            for pos in range(row.num_computed, row.num_computed + row.num_tokens)
        }
        steps = graphs.counters["graph_steps"]
        out = original(sched, *args)
        if graphs.counters["graph_steps"] == steps:
            return out
        assert len(sched.rows) == 3
        scratch_slots = set(range(scratch * bs, (scratch + 1) * bs))
        for layer, (k, v) in caches.kv.items():
            for now, old in zip((k, v), before["kv"][layer]):
                changed = (_bits(now) != _bits(old)).reshape(now.shape[0] * bs, -1).any(-1)
                where = set(changed.nonzero().flatten().tolist())
                assert where - scratch_slots == slots
        for name in ("conv", "ssm"):
            for layer, now in getattr(caches, name).items():
                old = before[name][layer]
                changed = (_bits(now) != _bits(old)).reshape(now.shape[0], -1).any(-1)
                assert set(changed.nonzero().flatten().tolist()) == pages
                assert not now[sorted(pages)].isnan().any()
                # The scratch page is read, never written: still zeros.
                assert not now[graphs.scratch_page].any()
        checked.append(len(sched.rows))
        return out

    runner.execute = spy
    while eng.has_unfinished_requests():
        eng.step()
    assert len(checked) >= 3


class _Row:
    """A ScheduledRow over a bare request, for plan() and fill()."""

    @staticmethod
    def make(n=20, q=1, page=3, outs=None, blocks=(5, 6), params=None, samples=True, drafts=None):
        req = Request("x", list(range(10, 10 + n + 1)),
                      params or SamplingParams(temperature=0.0), 0)
        req.block_ids = list(blocks)
        req.draft_token_ids = list(drafts if drafts is not None else range(200, 200 + q - 1))
        outs = outs if outs is not None else [100 + page * 16 + t for t in range(q)]
        return ScheduledRow(
            request=req, num_computed=n, num_tokens=q, num_drafts=q - 1, samples=samples,
            state_in_page=page, is_decode=True,
            state_outputs={n + 1 + t: p for t, p in enumerate(outs)},
        )


def _graphs(tiny_nemotron) -> DecodeGraphs:
    """Graphs for at most 8 rows and 4-block tables; scratch block 30, scratch page 40."""
    llm = LLM(tiny_nemotron)
    return DecodeGraphs(llm.model, llm.engine.runner.caches, 16, 8, 4, 30, 40, "cpu",
                        capture=False)


def test_plan_buckets_and_fallbacks(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    assert graphs.buckets == (1, 2, 4, 8)
    rows = [_Row.make(page=p) for p in range(3)]
    assert graphs.shape_of(SchedulerOutput(rows, [])) == StepShape(3, 4, 1, 2)
    verify = [_Row.make(q=3, page=p) for p in range(2)]
    assert graphs.shape_of(SchedulerOutput(verify, [])) == StepShape(2, 2, 3, 2)
    assert graphs.shape_of(SchedulerOutput([_Row.make(n=40, blocks=(1, 2, 3))], [])).width == 4

    def falls_back(rows):
        return graphs.shape_of(SchedulerOutput(rows, [])) is None

    assert falls_back([])
    assert falls_back([_Row.make(page=p) for p in range(9)])  # more rows than any bucket
    # Rows with different draft counts run as one step of the longest row's count.
    mixed = [_Row.make(), _Row.make(q=3, page=4, outs=[20, 21, 22])]
    assert graphs.shape_of(SchedulerOutput(mixed, [])) == StepShape(2, 2, 3, 2)
    odd = _Row.make(q=3, page=4, outs=[20, 21, 22])
    odd.num_drafts = 1  # a row's token count must be its drafts plus one
    assert falls_back([_Row.make(), odd])
    assert falls_back([_Row.make(q=17)])  # a prefill chunk
    assert falls_back([_Row.make(samples=False)])
    assert falls_back([_Row.make(page=-1)])  # no stored state
    # Sampled rows draw inside the graph; the draw's needs are part of the key.
    sampled = graphs.shape_of(SchedulerOutput(
        [_Row.make(params=SamplingParams(temperature=0.8, top_k=5, seed=1)),
         _Row.make(page=4, params=SamplingParams(temperature=0.5, top_p=0.9))], []))
    assert sampled.sampling == Sampling(any_sampled=True, top_k=8, any_top_p=True)
    assert sampled.key == (2, 1, 2, sampled.sampling)
    assert falls_back([_Row.make(params=SamplingParams(temperature=0.8, presence_penalty=0.5))])
    assert falls_back([_Row.make(params=SamplingParams(temperature=0.0, logprobs=1))])
    assert falls_back([_Row.make(params=SamplingParams(temperature=0.0, repetition_penalty=1.1))])
    assert falls_back([_Row.make(page=3), _Row.make(page=5, outs=[3])])  # writes a page read
    assert falls_back([_Row.make(q=2, outs=[7])])  # a missing output page
    assert falls_back([_Row.make(n=80, blocks=tuple(range(6)))])  # wider than the tables
    assert falls_back([_Row.make(n=40, blocks=(1, 2))])  # blocks missing for the context
    graphs.enabled = False
    assert falls_back([_Row.make()])


def test_a_failed_sampled_capture_keeps_greedy_graphs(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    graphs.capture = True  # every capture fails on the CPU
    st = _Static(1, graphs.max_batch, graphs.max_blocks, 30, 40, 16, torch.device("cpu"))
    sampled = SchedulerOutput([_Row.make(params=SamplingParams(temperature=0.8, seed=1))], [])
    greedy = SchedulerOutput([_Row.make()], [])
    assert graphs._capture(st, graphs.shape_of(sampled)) is None
    assert graphs.capture_errors and not graphs.sampled_enabled and graphs.enabled
    assert graphs.shape_of(sampled) is None  # sampled steps now run eagerly
    shape = graphs.shape_of(greedy)
    assert shape is not None
    # A failed greedy capture turns every graph off.
    assert graphs._capture(st, shape) is None
    assert not graphs.enabled and graphs.shape_of(greedy) is None


def test_fill_writes_rows_then_padding(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    rows = [_Row.make(n=17, q=2, page=3, outs=[8, 9], blocks=(5, 6, 7), drafts=[77]),
            _Row.make(n=4, q=2, page=4, outs=[10, 11], blocks=(2,), drafts=[78])]
    sched = SchedulerOutput(rows, [])
    shape = graphs.shape_of(sched)
    assert shape == StepShape(2, 2, 2, 2)
    # A stale buffer must be overwritten where the step reads it.
    rows3 = [_Row.make(q=2, page=p) for p in range(3)]
    st = _Static(2, graphs.max_batch, graphs.max_blocks, 30, 40, 16, torch.device("cpu"))
    graphs.fill(st, SchedulerOutput(rows3, []), StepShape(3, 4, 2, 4))
    graphs.fill(st, sched, shape)
    m = st.meta
    # ids (last prompt token, then the draft), positions, slots, pages, table.
    assert m[0, :9].tolist() == [10 + 17, 77, 17, 18, 6 * 16 + 1, 6 * 16 + 2, 3, 8, 9]
    assert m[0, 9:11].tolist() == [5, 6]
    assert m[1, :9].tolist() == [14, 78, 4, 5, 2 * 16 + 4, 2 * 16 + 5, 4, 10, 11]
    assert m[1, 9:11].tolist() == [2, -1]
    # Three rows in the bucket of 4: row 3 is a padding row.
    graphs.fill(st, SchedulerOutput(rows3, []), StepShape(3, 4, 2, 4))
    assert m[3, :9].tolist() == [0, 0, 0, 1, 30 * 16, 30 * 16 + 1, 40, -1, -1]
    assert m[3, 9:13].tolist() == [30, -1, -1, -1]


def test_fill_of_plain_decode_rows(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    rows = [_Row.make(n=17, page=3, outs=[8], blocks=(5, 6, 7)),
            _Row.make(n=4, page=4, outs=[10], blocks=(2,)),
            _Row.make(n=40, page=9, outs=[11], blocks=(1, 2, 3, 4, 12))]
    sched = SchedulerOutput(rows, [])
    st = _Static(1, graphs.max_batch, graphs.max_blocks, 30, 40, 16, torch.device("cpu"))
    st.host[:] = 999  # stale values must be overwritten where the step reads them
    graphs.fill(st, sched, StepShape(3, 4, 1, 4))
    m = st.meta
    # id, position, KV slot, input page, output page, then the table (width 4).
    assert m[0, :9].tolist() == [27, 17, 6 * 16 + 1, 3, 8, 5, 6, 7, -1]
    assert m[1, :9].tolist() == [14, 4, 2 * 16 + 4, 4, 10, 2, -1, -1, -1]
    assert m[2, :9].tolist() == [50, 40, 3 * 16 + 8, 9, 11, 1, 2, 3, 4]
    assert m[3, :6].tolist() == [0, 0, 30 * 16, 40, -1, 30]  # the padding row


def test_fill_pads_rows_shorter_than_the_step(tiny_nemotron):
    graphs = _graphs(tiny_nemotron)
    rows = [_Row.make(n=17, q=1, page=3, outs=[8], blocks=(5, 6, 7)),
            _Row.make(n=4, q=3, page=4, outs=[10, 11, 12], blocks=(2,), drafts=[78, 79])]
    sched = SchedulerOutput(rows, [])
    shape = graphs.shape_of(sched)
    assert shape == StepShape(2, 2, 3, 2)
    st = _Static(3, graphs.max_batch, graphs.max_blocks, 30, 40, 16, torch.device("cpu"))
    graphs.fill(st, sched, shape)
    m = st.meta
    # Row 0 runs one real token; its two padding positions repeat the token and the
    # position, write their keys to the scratch block (30) and no state.
    assert m[0, :13].tolist() == [
        27, 27, 27,  # ids
        17, 17, 17,  # positions
        6 * 16 + 1, 30 * 16 + 1, 30 * 16 + 2,  # KV slots
        3, 8, -1, -1,  # input page, output pages
    ]
    assert m[1, :13].tolist() == [14, 78, 79, 4, 5, 6, 2 * 16 + 4, 2 * 16 + 5, 2 * 16 + 6,
                                  4, 10, 11, 12]


@pytest.mark.parametrize("fixture", ["tiny_granite", "tiny_nemotron"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2}])
def test_sampled_steps_replay_with_the_same_tokens(request, fixture, spec):
    """Seeded sampled requests (temperature, top-k, top-p, min-p, greedy beside them):
    the graph steps draw exactly the eager steps' tokens (one counter-based stream)."""
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=13, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.05, seed=14, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    _graphs_against_eager(request.getfixturevalue(fixture), params, spec)


@pytest.mark.parametrize("q", [1, 3, "mixed"])
def test_static_step_matches_the_eager_step(tiny_granite, q):
    """One step of random rows over random caches: the static-buffer step (graph path)
    gives the eager path's tokens and writes the same cache entries ("mixed": rows of
    1 to 4 tokens in one step, padded to the longest)."""
    g = torch.Generator().manual_seed(_seed())
    runner = LLM(tiny_granite, max_num_seqs=8).engine.runner
    caches = runner.caches
    scratch_block, scratch_page = caches.kv[next(iter(caches.kv))][0].shape[0] - 1, 103
    # (tensor, index of its scratch entry)
    tensors = [(t, scratch_page) for t in [*caches.conv.values(), *caches.ssm.values()]]
    tensors += [(t, scratch_block) for kv in caches.kv.values() for t in kv]
    for t, _ in tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    pages = torch.randperm(100, generator=g).tolist()
    blocks = torch.randperm(200, generator=g).tolist()
    rows = []
    lengths = [1, 4, 2, 1, 3] if q == "mixed" else [q] * 5
    for i, rq in enumerate(lengths):  # five rows: three padding rows in the bucket of 8
        n = int(torch.randint(1, 60, (), generator=g))
        drafts = torch.randint(3, 256, (rq - 1,), generator=g).tolist()
        rows.append(_Row.make(n=n, q=rq, page=pages[i], blocks=blocks[4 * i : 4 * i + 4],
                              drafts=drafts, outs=pages[10 + 4 * i : 10 + 4 * i + rq]))
    sched = SchedulerOutput(rows, [])

    def snapshot():
        out = []
        for t, scratch in tensors:
            c = t.clone()
            c[scratch] = 0  # padding may write the scratch block
            out.append(c)
        return out

    start = [t.clone() for t, _ in tensors]
    before = snapshot()
    want = [r.new_tokens for r in runner.execute(sched).rows]
    eager = snapshot()
    for (t, _), s in zip(tensors, start):
        t.copy_(s)
    graphs = runner.enable_decode_graphs(8, scratch_block, scratch_page)
    got = [r.new_tokens for r in runner.execute(sched).rows]
    assert graphs.counters["graph_steps"] == 1
    assert got == want
    for a, b, s in zip(snapshot(), eager, before):
        assert torch.equal(a != s, b != s)  # the same entries written
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
