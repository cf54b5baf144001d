"""The state postprocess rides on the step's one read-back (the runner returns its decisions
in the step's result), and its accepted counts (decided on the device from the choices)
are checked against the tokens the host appended."""

from __future__ import annotations

import dataclasses

import torch

from hybridserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(3, 256, (6,), generator=g).tolist() * 5)[: 20 + i] for i in range(4)]


def test_decisions_come_back_with_the_choices(tiny_nemotron):
    llm = LLM(tiny_nemotron, max_num_seqs=4, speculative_config=SPEC)
    eng = llm.engine
    seen = []
    commit = eng._commit_postprocess

    def spy(rows, *rest):
        seen.append(all(decision is not None for _, _, decision in rows))
        commit(rows, *rest)

    eng._commit_postprocess = spy
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert seen and all(seen)
    assert eng.stats()["spec_draft_tokens"] > 0  # verify rows of several tokens ran
    # The same tokens as the engine without speculation.
    plain = LLM(tiny_nemotron, max_num_seqs=4)
    assert out == [o.outputs[0].token_ids for o in plain.generate(_prompts(), params, use_tqdm=False)]


def test_a_device_host_disagreement_fails_the_request(tiny_nemotron):
    llm = LLM(tiny_nemotron, max_num_seqs=4, speculative_config=SPEC)
    runner = llm.engine.runner
    decisions = runner._decisions

    def off_by_one(sched, host):
        # One more accepted token wherever a row rejected a draft (still a valid count).
        out = decisions(sched, host)
        return {
            i: dataclasses.replace(d, num_accepted=d.num_accepted + 1)
            if d.num_accepted < sched.rows[i].num_tokens else d
            for i, d in out.items()
        }

    runner._decisions = off_by_one
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    # Each request whose row disagreed fails alone, before its pages change hands.
    failed = [o for o in outs if o.error is not None]
    assert failed and all("the device accepted" in o.error for o in failed)
    assert all(o.outputs[0].finish_reason == "error" for o in failed)
    llm.engine.scheduler.check_integrity()
