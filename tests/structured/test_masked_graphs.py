"""Constrained decode and verify steps replayed from decode graphs
(:mod:`hybridserve.runner.cuda_graph`): every position's token mask goes into the static
mask buffer (all ones for rows that mask nothing), the step's draw applies it, and the
tokens equal the eager step's, greedy and seeded, with drafts (a mask per verify
position) and beside free rows. On the CPU the graphs are not captured: the same
static-buffer step runs eagerly (as in tests/runner/test_cuda_graph.py); the capture is
checked on CUDA (``gpu``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybridserve import LLM, SamplingParams, StructuredOutputsParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.runner.cuda_graph import DecodeGraphs, Sampling, StepShape
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.step import ScheduledRow, SchedulerOutput
from hybridserve.structured.backend import bitmask_words

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["id", "name", "kind"],
    "additionalProperties": False,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
MARK = StructuredOutputsParams(regex="a")  # marks params as constrained; masks come from FixedMasks
PROMPTS = [
    '{"id":12,"name":"ab","kind":"cat"} {"id":',
    "abc-12 bca-7 abc-12 abc-",
    "pick: alpha beta or omega; alpha beta",
    "free text that is not constrained at all, free text",
]
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=["alpha beta", "omega"]),
]


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _graph_llm(path, async_scheduling=False, **kw) -> LLM:
    """An LLM whose engine replays decode graphs (the static-buffer step on the CPU)."""
    llm = LLM(path, **kw)
    eng = llm.engine
    llm.engine = EngineCore(
        llm.config, llm.model, llm.tokenizer, eng.vocab_size, eng.eos_token_ids,
        enforce_eager=False, async_scheduling=async_scheduling,
    )
    return llm


def _batch(seed: int) -> tuple[list[str], list[SamplingParams]]:
    """Constrained rows (greedy and seeded), free rows, and rows masked by
    ``allowed_token_ids`` / ``min_tokens``, all in one batch."""
    prompts, params = [], []
    for i, so in enumerate(CONSTRAINTS):
        for temperature in (0.0, 0.9):
            prompts.append(PROMPTS[i])
            params.append(SamplingParams(max_tokens=40, temperature=temperature, seed=seed + i,
                                         top_k=20 if i == 1 else 0, structured_outputs=so))
    prompts += PROMPTS[3:] * 4
    params += [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=seed + 7, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, seed=seed + 8,
                       allowed_token_ids=list(range(97, 123)), ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=20),
    ]
    return prompts, params


@pytest.mark.parametrize(
    "spec, async_scheduling", [(None, False), (None, True), (SPEC, False)],
    ids=["plain", "async", "ngram"],
)
def test_constrained_steps_replay_with_the_eager_tokens(tiny_granite, spec, async_scheduling):
    prompts, params = _batch(_seed())
    kw = dict(max_num_seqs=16, max_model_len=512, speculative_config=spec)
    want = [o.outputs[0].token_ids for o in
            LLM(tiny_granite, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _graph_llm(tiny_granite, async_scheduling=async_scheduling, **kw)
    llm.engine.check_integrity_every_step = True
    runner = llm.engine.runner
    eager = []
    real = runner.forward_logits
    runner.forward_logits = lambda sched: eager.append(sched) or real(sched)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    graphs = runner.graphs
    c = graphs.counters
    # Every step of decode and verify rows only ran from the graphs (the eager ones
    # carry prompt rows), the constrained ones through the masked draw.
    assert eager and all(any(not row.is_decode for row in s.rows) for s in eager)
    assert c["masked_graph_steps"] >= 20, c
    if async_scheduling:
        # Constrained steps went ahead: forward launched, draw after the commit.
        assert c["deferred_draws"] >= 10, c
    masked_keys = {k[-1] for k in graphs._graphs if len(k) == 4 and isinstance(k[-1], Sampling)}
    assert any(s.masked and s.any_sampled for s in masked_keys)  # seeded rows drew there
    assert graphs.mask_seconds > 0
    if spec:
        assert llm.stats()["spec_accepted_tokens"] > 0
        assert any(k[1] > 1 for k in graphs._graphs if len(k) == 4 and k[-1].masked)


def test_greedy_constrained_rows_take_the_masked_greedy_graph(tiny_granite):
    """A batch of greedy rows, some constrained: a masked greedy key (no sampling
    parameters sent), the eager tokens, and every constrained output matches."""
    so = CONSTRAINTS[1]
    prompts = PROMPTS[1:2] * 3 + PROMPTS[3:4] * 2
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=so)] * 3
    params += [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 2
    kw = dict(max_num_seqs=8, max_model_len=512)
    want = [o.outputs[0].token_ids for o in
            LLM(tiny_granite, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _graph_llm(tiny_granite, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    graphs = llm.engine.runner.graphs
    assert graphs.counters["masked_graph_steps"] > 0
    assert any(k[-1] == Sampling(masked=True) for k in graphs._graphs if len(k) == 4)


def test_a_grammar_starting_under_async_scheduling(tiny_granite):
    """A grammar that starts after a tag the free output writes: with async scheduling
    the step after the tag is launched ahead before the tag is on the host, and its draw
    (deferred until the tag is committed) takes the new grammar's mask: the eager
    engine's tokens, and the output after the tag matches."""
    prompts = PROMPTS[3:4] * 3
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=512)
    (lead,) = LLM(tiny_granite, **kw).generate(prompts[:1], free, use_tqdm=False)
    tag = (lead.outputs[0].token_ids[3],)
    so = StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{1,3}", after_token_ids=tag)
    params = [SamplingParams(max_tokens=30, temperature=t, seed=3, structured_outputs=so)
              for t in (0.0, 0.8)] + [free]
    want = [o.outputs[0] for o in LLM(tiny_granite, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _graph_llm(tiny_granite, async_scheduling=True, **kw)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    ids = got[0].token_ids
    start = ids.index(tag[0]) + 1
    body = ids[start:-1] if got[0].finish_reason == "stop" else ids[start:]
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", llm.tokenizer.decode(body))
    assert llm.engine.runner.graphs.counters["deferred_draws"] > 0


def test_a_deferred_draw_not_queued_after_the_commit_is_queued_before_collect(tiny_granite, monkeypatch):
    """Where the draw of a step launched ahead was not queued after the commit before
    it (that commit raised), the next step queues it before reading it back: the same
    tokens (its masks come from the committed grammar states either way)."""
    prompts, params = PROMPTS[:2], [SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=so)
                                    for so in CONSTRAINTS[:2]]
    kw = dict(max_num_seqs=4, max_model_len=512)
    want = [o.outputs[0].token_ids for o in LLM(tiny_granite, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _graph_llm(tiny_granite, async_scheduling=True, **kw)
    monkeypatch.setattr(llm.engine, "_draw_inflight", lambda: None)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.runner.graphs.counters["deferred_draws"] > 0


# ---- one static step against the eager step, with given masks ----------------------


class FixedMasks:
    """A grammar whose masks are given (position j of the row: ``masks[j]``)."""

    def __init__(self, masks: np.ndarray, vocab_size: int) -> None:
        self.masks = masks
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)

    def fill_bitmasks(self, drafts, out: np.ndarray) -> None:
        out[:] = self.masks[: len(drafts) + 1]


def _random_masks(g: torch.Generator, count: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` masks (int32 words, bool rows), each allowing a few tokens."""
    allowed = torch.rand(count, vocab, generator=g) < 0.05
    allowed[torch.arange(count), torch.randint(0, vocab, (count,), generator=g)] = True
    words = bitmask_words(vocab)
    padded = np.zeros((count, words * 32), dtype=bool)
    padded[:, :vocab] = allowed.numpy()
    packed = np.packbits(padded.reshape(count, words, 32), axis=-1, bitorder="little")
    return packed.reshape(count, words * 4).view(np.int32).copy(), allowed.numpy()


def _row(n, q, page, blocks, outs, drafts, params, grammar=None) -> ScheduledRow:
    req = Request("x", list(range(10, 10 + n + 1)), params, 0)
    req.block_ids = list(blocks)
    req.draft_token_ids = list(drafts)
    req.grammar = grammar
    req.sample_seed = params.seed
    return ScheduledRow(
        request=req, num_computed=n, num_tokens=q, num_drafts=q - 1, samples=True,
        state_in_page=page, is_decode=True,
        state_outputs={n + 1 + t: p for t, p in enumerate(outs)},
    )


@pytest.mark.parametrize("q", [1, 3, "mixed"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_static_masked_step_matches_the_eager_step(tiny_granite, q, sampled):
    """Random rows over random caches, some with random sparse masks on every position
    (verify rows: one per draft position), padded rows and positions among them: the
    static-buffer step gives the eager step's tokens, every masked position's token is
    one its mask allows, and without the masks the tokens differ (the masks bite)."""
    g = torch.Generator().manual_seed(_seed())
    runner = LLM(tiny_granite, max_num_seqs=8).engine.runner
    vocab = runner.model.config.vocab_size
    caches = runner.caches
    scratch_block, scratch_page = caches.kv[next(iter(caches.kv))][0].shape[0] - 1, 103
    for t in [*caches.conv.values(), *caches.ssm.values(), *(x for kv in caches.kv.values() for x in kv)]:
        t.copy_(torch.randn(t.shape, generator=g))
    start = [t.clone() for t in [*caches.conv.values(), *caches.ssm.values(),
                                 *(x for kv in caches.kv.values() for x in kv)]]
    pages = torch.randperm(100, generator=g).tolist()
    blocks = torch.randperm(200, generator=g).tolist()
    lengths = [1, 4, 2, 1, 3] if q == "mixed" else [q] * 5
    rows, allowed = [], []
    for i, rq in enumerate(lengths):  # five rows: three padding rows in the bucket of 8
        grammar = None
        if i != 2:  # row 2 is free: its mask is all ones
            masks, ok = _random_masks(g, rq, vocab)
            grammar = FixedMasks(masks, vocab)
        # The params mark the constrained rows (the runner's eager path reads them).
        params = SamplingParams(temperature=0.9 if sampled and i % 2 else 0.0, seed=100 + i,
                                top_k=8 if sampled and i == 3 else 0,
                                structured_outputs=MARK if grammar else None)
        # Drafts the masks allow (as the engine cuts them), random otherwise.
        drafts = [int(np.flatnonzero(ok[j])[0]) if grammar else int(torch.randint(3, vocab, (), generator=g))
                  for j in range(rq - 1)]
        n = int(torch.randint(1, 60, (), generator=g))
        rows.append(_row(n, rq, pages[i], blocks[4 * i : 4 * i + 4], pages[10 + 4 * i : 10 + 4 * i + rq],
                         drafts, params, grammar))
        allowed.append(ok if grammar else None)
    sched = SchedulerOutput(rows, [])

    def run(graphs: bool, masks: bool = True) -> list[list[int]]:
        for t, s in zip([*caches.conv.values(), *caches.ssm.values(),
                         *(x for kv in caches.kv.values() for x in kv)], start):
            t.copy_(s)
        saved = [(r.request.grammar, r.request.params) for r in rows]
        if not masks:
            for r in rows:
                r.request.grammar = None
                r.request.params = SamplingParams(temperature=r.request.params.temperature,
                                                  seed=r.request.params.seed, top_k=r.request.params.top_k)
        r = ModelRunner(runner.model, caches, runner.block_size, 8)
        if graphs:
            r.enable_decode_graphs(8, scratch_block, scratch_page)
        try:
            out = [row.new_tokens for row in r.execute(sched).rows]
        finally:
            for row, (grammar, params) in zip(rows, saved):
                row.request.grammar, row.request.params = grammar, params
        if graphs:
            assert r.graphs.counters["masked_graph_steps"] == (1 if masks else 0)
        return out

    want = run(graphs=False)
    got = run(graphs=True)
    assert got == want
    for row, tokens, ok in zip(rows, got, allowed):
        if ok is not None:
            assert all(ok[j, t] for j, t in enumerate(tokens)), (tokens, row.num_drafts)
    assert run(graphs=True, masks=False) != got


def test_masks_are_filled_after_the_forward_is_queued(tiny_granite, monkeypatch):
    """After a key's first step (whose masks are filled before the capture), a masked
    step queues its forward, then fills the masks (the matchers' host work, which on
    CUDA runs while the device computes the forward), then draws."""
    order = []
    real_forward, real_masks, real_draw = (
        DecodeGraphs._forward_logits, DecodeGraphs.fill_masks, DecodeGraphs._draw)
    monkeypatch.setattr(DecodeGraphs, "_forward_logits",
                        lambda self, *a: order.append("forward") or real_forward(self, *a))
    monkeypatch.setattr(DecodeGraphs, "fill_masks",
                        lambda self, *a: order.append("masks") or real_masks(self, *a))
    monkeypatch.setattr(DecodeGraphs, "_draw", lambda self, *a: order.append("draw") or real_draw(self, *a))
    llm = _graph_llm(tiny_granite, max_num_seqs=4, max_model_len=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=CONSTRAINTS[1])
    llm.generate(PROMPTS[1:2], params, use_tqdm=False)
    assert order[:3] == ["masks", "forward", "draw"]  # the first step of the key
    assert order[3:] and order[3:] == ["forward", "masks", "draw"] * (len(order[3:]) // 3)


def test_shapes_of_masked_steps(tiny_granite):
    """The key says whether a step masks, not which rows do; a row scheduled ahead
    whose grammar waits for its start tag makes the step masked (the token on the
    device may start it); a grammar of another vocabulary leaves the graphs."""
    llm = LLM(tiny_granite, max_num_seqs=8)
    graphs = DecodeGraphs(llm.model, llm.engine.runner.caches, 16, 8, 4, 30, 40, "cpu", capture=False)
    vocab = llm.model.config.vocab_size
    masks, _ = _random_masks(torch.Generator().manual_seed(0), 1, vocab)
    greedy = SamplingParams(temperature=0.0)

    marked = SamplingParams(temperature=0.0, structured_outputs=MARK)

    def rows(constrained: set[int], grammar=None):
        return SchedulerOutput([
            _row(20, 1, p, (5, 6), [100 + p], [], marked if p in constrained else greedy,
                 (grammar or FixedMasks(masks, vocab)) if p in constrained else None)
            for p in range(3)], [])

    a, b = graphs.shape_of(rows({0})), graphs.shape_of(rows({1, 2}))
    assert a == b == StepShape(3, 4, 1, 2, Sampling(masked=True))
    assert graphs.shape_of(rows(set())).sampling == Sampling()
    limited = SchedulerOutput([_row(20, 1, 3, (5, 6), [9], [], SamplingParams(temperature=0.0, min_tokens=4))], [])
    assert graphs.shape_of(limited).sampling == Sampling(masked=True)
    ahead = rows({0})
    ahead.rows[0].ahead = True
    assert graphs.shape_of(ahead) == a
    waiting = rows(set())
    for row in waiting.rows:
        row.ahead = True
    waiting.rows[1].request.pending_grammar = FixedMasks(masks, vocab)
    assert graphs.shape_of(waiting).sampling == Sampling(masked=True)
    for row in waiting.rows:
        row.ahead = False
    assert graphs.shape_of(waiting).sampling == Sampling()
    assert graphs.shape_of(rows({0}, FixedMasks(masks, vocab + 64))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, SPEC], ids=["async", "ngram"])
def test_captured_constrained_steps_match_eager_on_cuda(tiny_granite, spec):
    """On CUDA with captured graphs (async scheduling on without drafts): the
    constrained batch's tokens equal the eager engine's, and its decode steps replayed
    the masked graphs (ahead, with deferred draws, under async scheduling)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts, params = _batch(_seed())
    kw = dict(max_num_seqs=16, max_model_len=512, device="cuda", dtype="float32",
              speculative_config=spec)
    want = [o.outputs[0].token_ids for o in
            LLM(tiny_granite, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_granite, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = llm.engine.runner.graphs
    c = graphs.counters
    assert graphs.capture and not graphs.capture_errors, graphs.capture_errors
    assert c["captures"] >= 2 and c["masked_graph_steps"] >= 20, c
    if spec is None:
        assert llm.engine.async_scheduling and c["deferred_draws"] >= 10, c
    assert got == want
