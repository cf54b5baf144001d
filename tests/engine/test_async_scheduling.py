"""Async scheduling: a plain decode step is launched before the previous one's tokens
are read back. The engine must give every request the tokens of the step-by-step run,
keep every cache reference straight while a step is in flight (cache integrity checked
after every step), and drop the in-flight rows of requests that finish meanwhile.

The decode-graph path runs its static-buffer step without capture on the CPU, so the
pipelining (launch, device-side token hand-over, late read-back) runs here as on CUDA.
"""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.engine_core import EngineCore


def _engine(path, async_scheduling: bool, **kw) -> EngineCore:
    llm = LLM(path, **kw)
    eng = llm.engine
    llm.engine = None
    engine = EngineCore(
        llm.config, llm.model, llm.tokenizer, eng.vocab_size, eng.eos_token_ids,
        enforce_eager=False, async_scheduling=async_scheduling,
    )
    engine.check_integrity_every_step = True
    return engine


def _script(seed: int):
    """Requests arriving over steps: greedy and seeded sampled, some with stop tokens
    that end them at steps nobody can predict, various lengths, shared prefixes."""
    rng = random.Random(seed)
    roots = [[rng.randrange(3, 256) for _ in range(n)] for n in (40, 21)]
    arrivals = []
    for i in range(14):
        prompt = rng.choice(roots)[: rng.randint(1, 40)] + [
            rng.randrange(3, 256) for _ in range(rng.randint(1, 12))
        ]
        kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=True)
        if rng.random() < 0.4:
            kw.update(stop_token_ids=list(range(3, 50)))  # ends early, at a random token
        if rng.random() < 0.3:
            kw.update(temperature=0.9, top_p=0.9, seed=i)
        else:
            kw.update(temperature=0.0)
        arrivals.append((rng.choice([0, 0, 1, 3, 6, 10]), f"r{i}", prompt, SamplingParams(**kw)))
    arrivals.sort(key=lambda a: a[0])
    aborts = {rng.choice([4, 8, 12]): f"r{rng.randrange(14)}" for _ in range(2)}
    return arrivals, aborts


def _run(engine: EngineCore, arrivals, aborts) -> tuple[dict[str, list[int]], set[str], int]:
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = list(arrivals)
    step = ahead = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if step in aborts and engine.abort_request(aborts[step]):
            aborted.add(aborts[step])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        ahead += engine._inflight is not None
        step += 1
        assert step < 1000
    assert engine._inflight is None
    engine.scheduler.check_integrity()
    return done, aborted, ahead


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_scheduling_gives_the_step_by_step_tokens(tiny_granite, seed):
    arrivals, aborts = _script(seed)
    kw = dict(max_num_seqs=6, max_model_len=96, state_interval=16, num_state_pages=80,
              max_checkpoint_pages=16)
    sync_done, sync_aborted, _ = _run(_engine(tiny_granite, False, **kw), arrivals, aborts)
    eng = _engine(tiny_granite, True, **kw)
    drops = []
    real = eng.scheduler.drop_ahead_row
    eng.scheduler.drop_ahead_row = lambda row: (drops.append(row), real(row))
    done, aborted, ahead = _run(eng, arrivals, aborts)
    assert ahead > 5  # steps did go ahead
    assert drops  # and some requests stopped while their next row was in flight
    assert aborted == sync_aborted
    # An abort lands between steps, and an async engine has committed one step less by
    # then; every other request gets exactly the step-by-step tokens.
    kept = set(sync_done) - aborted
    assert kept and kept <= set(done)
    for rid in kept:
        assert done[rid] == sync_done[rid], rid
    assert set(done) - aborted == kept


def test_rows_of_requests_that_stop_are_dropped(tiny_granite, monkeypatch):
    """A stop token ends a request while its next row is in flight: that row's result
    is dropped and its page released (the integrity check after every step)."""
    eng = _engine(tiny_granite, True, max_num_seqs=4, max_model_len=64)
    dropped = []
    real = eng.scheduler.drop_ahead_row

    def spy(row):
        dropped.append(row.request.request_id)
        real(row)

    monkeypatch.setattr(eng.scheduler, "drop_ahead_row", spy)
    sync = _engine(tiny_granite, False, max_num_seqs=4, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = {}
    for e in (sync, eng):
        e.add_request("a", [5, 6, 7, 8], params)
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    free[id(e)] = out.outputs[0].token_ids
    tokens = free[id(sync)]
    assert free[id(eng)] == tokens
    # Stop on the token the request makes at its 6th step: async has its 7th in flight.
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                          stop_token_ids=[tokens[5]])
    first = tokens.index(tokens[5])
    eng.add_request("b", [5, 6, 7, 8], stop)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert outs[0].outputs[0].token_ids == tokens[: first + 1]
    assert dropped == ["b"]


def test_length_capped_requests_get_no_row_ahead(tiny_granite):
    eng = _engine(tiny_granite, True, max_num_seqs=4, max_model_len=64)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    launched = []
    real = eng.runner.launch

    def spy(sched, *args):
        launched.append([row.num_computed for row in sched.rows])
        return real(sched, *args)

    eng.runner.launch = spy
    while eng.has_unfinished_requests():
        eng.step()
    # The prefill (tried on the graph path first, which declines it), then the decode
    # steps from 3 computed tokens up to the fifth output: none is launched for a sixth.
    assert launched == [[0], [3], [4], [5], [6]]


def test_async_scheduling_needs_graphs_and_no_drafts(tiny_granite):
    llm = LLM(tiny_granite)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineCore(llm.config, llm.model, llm.tokenizer, llm.engine.vocab_size,
                   llm.engine.eos_token_ids, enforce_eager=True, async_scheduling=True)
    assert not llm.engine.async_scheduling  # eager on the CPU by default
    spec = LLM(tiny_granite, enforce_eager=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not spec.engine.async_scheduling
    assert LLM(tiny_granite, enforce_eager=False).engine.async_scheduling


def test_abort_while_a_row_is_in_flight(tiny_granite):
    eng = _engine(tiny_granite, True, max_num_seqs=4, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    eng.add_request("a", [5, 6, 7, 8], params)
    eng.add_request("b", [9, 10, 11], params)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    assert {row.request.request_id for row in eng._inflight[0].rows} == {"a", "b"}
    assert eng.abort_request("a")
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["b"] and len(outs[0].outputs[0].token_ids) == 30
    # No page is left held by the dropped row: every reference has a holder.
    eng.scheduler.check_integrity()


def _saturated(engine: EngineCore, requests) -> tuple[dict, dict, int]:
    """Every request arrives at once, more than the engine seats. Returns each request's
    tokens, the step its first token came out in, and how many steps were launched
    ahead while requests waited."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, first, ahead_waiting, step = {}, {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        ahead_waiting += engine._inflight is not None and bool(engine.scheduler.waiting)
        step += 1
        assert step < 1000
    engine.scheduler.check_integrity()
    return done, first, ahead_waiting


def test_saturated_engine_goes_ahead_and_admits_on_time(tiny_granite):
    """All seats taken and requests waiting: plain decode steps still go ahead (the next
    ordinary step could not admit a waiting request either). Length caps free seats
    knowably, so with no stop token every request is admitted in the step the
    step-by-step engine admits it in, and gets its tokens."""
    rng = random.Random(7)
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(2, 20))],
         SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 14), ignore_eos=True))
        for i in range(7)
    ]
    kw = dict(max_num_seqs=2, max_model_len=64)
    sync_done, sync_first, _ = _saturated(_engine(tiny_granite, False, **kw), requests)
    done, first, ahead_waiting = _saturated(_engine(tiny_granite, True, **kw), requests)
    assert ahead_waiting > 5
    assert done == sync_done and first == sync_first


def test_saturated_engine_with_stop_tokens_gives_the_step_by_step_tokens(tiny_granite):
    """Stop tokens free seats only once read back: the request waiting for one is
    admitted a step later, with the same tokens."""
    rng = random.Random(3)
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(2, 20))],
         SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=20,
                        ignore_eos=True, stop_token_ids=list(range(3, 40))))
        for i in range(7)
    ]
    kw = dict(max_num_seqs=2, max_model_len=64)
    sync_done, _, _ = _saturated(_engine(tiny_granite, False, **kw), requests)
    done, _, ahead_waiting = _saturated(_engine(tiny_granite, True, **kw), requests)
    assert ahead_waiting > 0
    assert done == sync_done
