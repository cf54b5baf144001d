"""Everything at once: speculative decoding, prefix caching, preemption under tight
caches, chunked prefill, aborts and sampled requests in one randomized run, with the
cache integrity checked after every step and greedy outputs compared to a plain run."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams


def _prompt(rng: random.Random, roots: list[list[int]]) -> list[int]:
    root = rng.choice(roots)
    tail = [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))]
    if rng.random() < 0.4:  # repetitive: drafts get accepted
        tail = tail[:4] * rng.randint(2, 5)
    return root[: rng.randint(1, len(root))] + tail


def _soak(path, seed: int, enforce_eager: bool):
    """One randomized run; returns (prompts, outputs by request id, aborted ids, llm)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(3, 256) for _ in range(n)] for n in (70, 33, 100)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(rng, roots) for _ in range(24)]
    llm = LLM(
        path, max_num_seqs=8, max_model_len=160, num_kv_blocks=20,
        num_state_pages=60, max_checkpoint_pages=8, state_interval=16,
        max_num_batched_tokens=40, enforce_eager=enforce_eager,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    engine = llm.engine
    engine.check_integrity_every_step = True
    pending = list(enumerate(prompts))
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        # Requests arrive over time; some sampled, some aborted mid-flight.
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"g{i}", p, greedy)
                if rng.random() < 0.3:
                    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i)
                    engine.add_request(f"s{i}", p, sampled)
        if engine.scheduler.running and rng.random() < 0.05:
            victim = rng.choice(engine.scheduler.running)
            engine.abort_request(engine.group_id(victim))
            aborted.add(victim.request_id)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 5000
    return prompts, done, aborted, llm


def _check_end_state(llm) -> None:
    engine = llm.engine
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert not engine.drafter.inner._indexes  # finished and aborted requests leave no index
    llm.reset_prefix_cache()
    engine.scheduler.check_integrity()
    assert engine.scheduler.states.num_free == engine.scheduler.states.num_pages
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


# Two seeds by default; more random workloads through the same paths are ``slow``.
@pytest.mark.parametrize("seed", [0, 1, pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_soak_everything_together(tiny_granite, seed):
    prompts, done, aborted, llm = _soak(tiny_granite, seed, enforce_eager=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(tiny_granite, enable_prefix_caching=False)
    expected = {i: o.outputs[0].token_ids for i, o in enumerate(plain.generate(prompts, greedy))}
    checked = 0
    for i in range(len(prompts)):
        rid = f"g{i}"
        if rid in aborted:
            continue
        assert done[rid] == expected[i], rid
        checked += 1
    assert checked >= len(prompts) // 2
    _check_end_state(llm)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_soak_with_decode_graphs_equals_eager(tiny_granite, seed):
    """The same run through the decode-graph path (its static-buffer step: mixed draft
    counts padded, sampled rows drawn in the step, the postprocess decided from the
    device's accepted counts) gives every request, sampled ones included, the eager
    run's tokens."""
    _, eager, eager_aborted, _ = _soak(tiny_granite, seed, enforce_eager=True)
    _, graphs, graphs_aborted, llm = _soak(tiny_granite, seed, enforce_eager=False)
    assert graphs_aborted == eager_aborted
    assert graphs == eager
    assert any(rid.startswith("s") for rid in graphs)
    counters = llm.engine.runner.graphs.counters
    assert counters["graph_steps"] > 0, counters
    _check_end_state(llm)
