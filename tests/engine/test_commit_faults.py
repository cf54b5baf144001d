"""A request whose step cannot be committed fails alone.

A fault after the forward (appending tokens, stop strings, detokenizing, the page
bookkeeping of prefill and verify rows, the postprocess commit, finishing) ends the
request with finish reason ``"error"``; its blocks and pages are freed, every cache
reference keeps its holder (checked after every step), the request next to it gets
exactly the tokens it gets alone, and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledRow, Scheduler

MAX_TOKENS = 12
# The victim also has a stop string (never produced), so its stop check runs.
VICTIM = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=["@@@@"])
BYSTANDER = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


PROMPTS = {"victim": _prompt(1, 40), "bystander": _prompt(2, 60)}


@pytest.fixture(scope="module")
def alone(tiny_granite) -> dict[str, list[int]]:
    """Each prompt's tokens generated alone, without prefix caching."""
    llm = LLM(tiny_granite, max_num_seqs=1, enable_prefix_caching=False)
    return {
        k: llm.generate([p], BYSTANDER)[0].outputs[0].token_ids for k, p in PROMPTS.items()
    }


def _requests_of(args) -> list[Request]:
    """The requests a call is about: a request, a row, or a list of (row, result, ...)."""
    for a in args:
        if isinstance(a, Request):
            return [a]
        if isinstance(a, ScheduledRow):
            return [a.request]
        if isinstance(a, list) and a and isinstance(a[0], tuple):
            return [t[0].request for t in a]
    raise AssertionError("no request among the arguments")


def inject(monkeypatch, owner: type, name: str, nth: int, victim: str = "victim") -> list:
    """Make ``owner.name`` raise on its ``nth`` call for a request of ``victim``'s group;
    returns the list of faults raised."""
    real = getattr(owner, name)
    calls, raised = [0], []

    def faulty(self, *args, **kwargs):
        if any(EngineCore.group_id(r) == victim for r in _requests_of(args)):
            calls[0] += 1
            if calls[0] == nth:
                raised.append(name)
                raise RuntimeError(f"injected fault in {name}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)
    return raised


def _drain(engine: EngineCore) -> dict:
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < 500
    return done


def _assert_all_free(engine: EngineCore) -> None:
    s = engine.scheduler
    s.check_integrity()
    assert not s.running and not s.waiting
    assert all(b.ref_count == 0 for b in s.blocks.blocks)
    # Only the checkpoint index holds pages, one each.
    assert s.states.num_free + len(s.states.checkpoints) == s.states.num_pages
    assert len(s.free_seats) == s.config.max_num_seqs


def _llm(path, **kw) -> LLM:
    # Chunked prefills (commit_prefill_row runs several times per prompt) next to
    # decode rows; a dense checkpoint grid so commits admit checkpoints.
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, state_interval=16) | kw
    llm = LLM(path, **kw)
    llm.engine.check_integrity_every_step = True
    return llm


# (owner, method, the victim's call that raises)
SITES = [
    (EngineCore, "_append_tokens", 3),  # token append, while decoding
    (EngineCore, "_check_stop_strings", 2),  # stop strings (detokenizes)
    (EngineCore, "_decode", 1),  # detokenizing the output (every step's output)
    (Scheduler, "commit_prefill_row", 2),  # the second prefill chunk
    (Scheduler, "commit_decode_row", 3),
    (Scheduler, "_admit_checkpoint", 1),  # inside commit_prefill_row
    (Scheduler, "_register_full_blocks", 4),  # inside a commit, after the refs moved
    (Scheduler, "_admit_boundary_checkpoint", 1),  # finishing at the length cap
]


@pytest.mark.parametrize(("owner", "name", "nth"), SITES, ids=[s[1] for s in SITES])
def test_a_fault_after_the_forward_fails_only_its_request(
    tiny_granite, alone, monkeypatch, owner, name, nth
):
    llm = _llm(tiny_granite)
    engine = llm.engine
    raised = inject(monkeypatch, owner, name, nth)
    # Per-step outputs, so that detokenizing runs on every step.
    engine.add_request("victim", PROMPTS["victim"], VICTIM)
    engine.add_request("bystander", PROMPTS["bystander"], BYSTANDER)
    done = _drain(engine)
    assert raised == [name]
    bad = done["victim"]
    assert [o.finish_reason for o in bad.outputs] == ["error"]
    assert f"injected fault in {name}" in bad.error
    good = done["bystander"]
    assert good.error is None and good.outputs[0].finish_reason == "length"
    assert good.outputs[0].token_ids == alone["bystander"]
    _assert_all_free(engine)
    # The engine keeps serving: the same prompt again (no fault now) is exact.
    engine.add_request("again", PROMPTS["victim"], VICTIM)
    assert _drain(engine)["again"].outputs[0].token_ids == alone["victim"]
    _assert_all_free(engine)


def test_offline_generate_reports_the_failed_prompt(tiny_granite, alone, monkeypatch):
    llm = _llm(tiny_granite)
    inject(monkeypatch, EngineCore, "_append_tokens", 2, victim="gen-0")
    outs = llm.generate([PROMPTS["victim"], PROMPTS["bystander"]], BYSTANDER)
    assert outs[0].outputs[0].finish_reason == "error" and "injected" in outs[0].error
    assert outs[1].outputs[0].token_ids == alone["bystander"]
    _assert_all_free(llm.engine)


def test_a_failed_child_fails_its_whole_group(tiny_granite, alone, monkeypatch):
    llm = _llm(tiny_granite)
    engine = llm.engine
    inject(monkeypatch, Scheduler, "commit_decode_row", 5)
    engine.add_request("victim", PROMPTS["victim"], SamplingParams(
        n=3, max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True))
    engine.add_request("bystander", PROMPTS["bystander"], BYSTANDER)
    done = _drain(engine)
    assert [o.finish_reason for o in done["victim"].outputs] == ["error"] * 3
    assert done["bystander"].outputs[0].token_ids == alone["bystander"]
    _assert_all_free(engine)


def test_a_postprocess_commit_that_raises_fails_its_verify_rows(tiny_granite, alone, monkeypatch):
    """The postprocess commit serves every verify row of the step: when it raises as a
    whole, those rows' requests fail; a request still prefilling in that step does not."""
    llm = _llm(tiny_granite)
    engine = llm.engine
    raised = inject(monkeypatch, EngineCore, "_commit_postprocess", 2)
    engine.add_request("victim", PROMPTS["victim"][:5], VICTIM)
    # 120 tokens in chunks of at most 16: still prefilling while the victim decodes.
    long_prompt = _prompt(3, 120)
    engine.add_request("bystander", long_prompt, BYSTANDER)
    done = _drain(engine)
    assert raised
    assert done["victim"].outputs[0].finish_reason == "error"
    ref = LLM(tiny_granite, max_num_seqs=1, enable_prefix_caching=False)
    assert done["bystander"].outputs[0].token_ids == ref.generate([long_prompt], BYSTANDER)[
        0
    ].outputs[0].token_ids
    _assert_all_free(engine)


def test_a_device_host_mismatch_fails_only_that_row(tiny_granite, alone, monkeypatch):
    """A verify row whose read-back accepted count disagrees with the tokens the host
    appended fails before any of its pages changes hands; the rows beside it commit."""
    llm = _llm(tiny_granite)
    engine = llm.engine
    real = EngineCore._commit_postprocess
    tampered = []

    def tamper(self, rows, *rest):
        out = []
        for row, res, decision in rows:
            if row.request.request_id == "victim" and len(rows) == 2 and not tampered:
                decision = dataclasses.replace(decision, num_accepted=decision.num_accepted + 1)
                tampered.append(row.num_computed)
            out.append((row, res, decision))
        return real(self, out, *rest)

    monkeypatch.setattr(EngineCore, "_commit_postprocess", tamper)
    engine.add_request("victim", PROMPTS["victim"], VICTIM)
    engine.add_request("bystander", PROMPTS["bystander"], BYSTANDER)
    done = _drain(engine)
    assert tampered
    assert "the device accepted" in done["victim"].error
    assert done["bystander"].outputs[0].token_ids == alone["bystander"]
    _assert_all_free(engine)


def test_speculative_verify_commit_fault(tiny_granite, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _llm(tiny_granite, speculative_config=spec, max_num_batched_tokens=64)
    engine = llm.engine
    # Prompts holding every token the model can make: whatever it samples occurs
    # earlier, so the n-gram drafter always proposes and verify rows carry drafts.
    loop = list(range(3, 256))
    random.Random(4).shuffle(loop)
    other = loop[::-1]
    want = LLM(tiny_granite, max_num_seqs=1, enable_prefix_caching=False).generate(
        [other], BYSTANDER)[0].outputs[0].token_ids
    drafted = []
    real = Scheduler.commit_decode_row

    def spy(self, row, *args):
        drafted.append(row.num_drafts)
        return real(self, row, *args)

    monkeypatch.setattr(Scheduler, "commit_decode_row", spy)
    inject(monkeypatch, Scheduler, "commit_decode_row", 3)
    engine.add_request("victim", loop, VICTIM)
    engine.add_request("bystander", other, BYSTANDER)
    done = _drain(engine)
    assert max(drafted) > 0
    assert done["victim"].outputs[0].finish_reason == "error"
    assert done["bystander"].outputs[0].token_ids == want
    _assert_all_free(engine)


def test_async_scheduling_drops_the_failed_requests_row_in_flight(tiny_granite, alone, monkeypatch):
    llm = _llm(tiny_granite)
    engine = EngineCore(
        llm.config, llm.model, llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids,
        enforce_eager=False, async_scheduling=True,
    )
    engine.check_integrity_every_step = True
    dropped = []
    real_drop = Scheduler.drop_ahead_row
    monkeypatch.setattr(
        Scheduler, "drop_ahead_row",
        lambda self, row: (dropped.append(row.request.request_id), real_drop(self, row)),
    )
    inject(monkeypatch, EngineCore, "_append_tokens", 6)
    engine.add_request("victim", PROMPTS["victim"], BYSTANDER)
    engine.add_request("bystander", PROMPTS["bystander"], BYSTANDER)
    done = _drain(engine)
    assert "victim" in dropped  # its next row was in flight when it failed
    assert done["victim"].outputs[0].finish_reason == "error"
    assert done["bystander"].outputs[0].token_ids == alone["bystander"]
    assert engine._inflight is None
    _assert_all_free(engine)
