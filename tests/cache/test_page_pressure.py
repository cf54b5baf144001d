"""Few state pages: checkpoints and drafts shrink to fit, so every request that fits the
configured limits runs (and gives the tokens it gives with pages to spare); caches that
cannot run one ``max_model_len`` request are refused when the engine is built."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _rand(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


LONG = _rand(0, 784)  # 12 grid points (every 64) and its end: 13 pages in one chunk


@pytest.fixture(scope="module")
def uncached(tiny_granite):
    return LLM(tiny_granite, enable_prefix_caching=False, max_model_len=1024)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("pages", [3, 12])
def test_a_long_prompt_runs_with_few_state_pages(tiny_granite, uncached, pages):
    want = _tokens(uncached.generate([LONG], GREEDY))
    llm = LLM(tiny_granite, num_state_pages=pages, max_model_len=1024)
    llm.engine.check_integrity_every_step = True
    assert _tokens(llm.generate([LONG], GREEDY)) == want
    again = llm.generate([LONG], GREEDY)[0]
    assert again.outputs[0].token_ids == want[0]
    if pages == 12:
        # The prompt end (768: the last boundary before its final token) was among the
        # checkpoints kept: the same prompt again starts there. With 3 pages decoding
        # evicts it.
        assert again.num_cached_tokens == 768
    llm.engine.scheduler.check_integrity()


def test_many_long_prompts_share_few_pages(tiny_granite, uncached):
    prompts = [LONG[:700], _rand(1, 500), LONG[:300] + _rand(2, 400), _rand(3, 64)]
    want = _tokens(uncached.generate(prompts, GREEDY))
    llm = LLM(
        tiny_granite, num_state_pages=12, max_num_seqs=4, max_model_len=1024,
        max_num_batched_tokens=256,
    )
    llm.engine.check_integrity_every_step = True
    assert _tokens(llm.generate(prompts, GREEDY)) == want
    # Optional checkpoints gave way; no running request was preempted for them.
    assert llm.stats()["preemptions"] == 0


def test_drafts_shrink_to_the_free_pages(tiny_granite):
    prompt = list(range(3, 256))  # every token occurs: the drafter always proposes
    random.Random(4).shuffle(prompt)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(tiny_granite, enable_prefix_caching=False).generate([prompt], params))
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    # The request holds 2 pages (its state, its boundary state): 1 + 3 drafts never fit.
    llm = LLM(tiny_granite, num_state_pages=4, speculative_config=spec)
    llm.engine.check_integrity_every_step = True
    assert _tokens(llm.generate([prompt], params)) == want
    assert llm.stats()["spec_draft_tokens"] > 0


def _scheduler(**cache) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=1024), CacheConfig(**cache))


def test_checkpoints_dropped_earliest_grid_point_first():
    sched = _scheduler(num_state_pages=6, num_kv_blocks=100)
    req = Request("r", list(LONG), GREEDY, arrival=0, max_model_len=1024)
    req.extra_checkpoints.add(336)  # a junction off the grid
    sched.add(req)
    (row,) = sched.schedule().rows
    # The end, the junction and prompt end (768, 784), then the latest grid points.
    assert sorted(row.state_outputs) == [336, 576, 640, 704, 768, 784]
    sched.check_integrity([p for p in row.state_outputs.values()])


def test_caches_too_small_for_one_request_are_refused(tiny_granite):
    with pytest.raises(ValueError, match="num_state_pages=2 .*raise num_state_pages"):
        LLM(tiny_granite, num_state_pages=2)
    with pytest.raises(ValueError, match="num_kv_blocks=10 .*max_model_len=1024"):
        _scheduler(num_kv_blocks=10)
    # Without prefix caching no boundary state is kept: two pages run a request.
    llm = LLM(tiny_granite, num_state_pages=2, enable_prefix_caching=False, max_model_len=1024)
    uncached = LLM(tiny_granite, enable_prefix_caching=False, max_model_len=1024)
    assert _tokens(llm.generate([LONG[:100]], GREEDY)) == _tokens(
        uncached.generate([LONG[:100]], GREEDY)
    )
