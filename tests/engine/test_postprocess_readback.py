"""The state postprocess rides on the step's one read-back, and its accepted counts (decided
on the device from the choices) are checked against the tokens the host appended."""

from __future__ import annotations

import torch

from hybridserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(3, 256, (6,), generator=g).tolist() * 5)[: 20 + i] for i in range(4)]


def test_decisions_come_back_with_the_choices(tiny_nemotron):
    llm = LLM(tiny_nemotron, max_num_seqs=4, speculative_config=SPEC)
    eng = llm.engine
    runner = eng.runner
    seen = []
    commit = eng._commit_postprocess

    def spy(sched, rows, *rest):
        seen.append(runner.verify_readback is not None)
        commit(sched, rows, *rest)

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
    launch = runner.on_verify

    def off_by_one(sched, verify, accepted):
        # One more accepted token wherever a row rejected a draft (still a valid count).
        q = torch.tensor([sched.rows[i].num_tokens for i in verify])
        return launch(sched, verify, torch.where(accepted < q, accepted + 1, accepted))

    runner.on_verify = off_by_one
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    # Each request whose row disagreed fails alone, before its pages change hands.
    failed = [o for o in outs if o.error is not None]
    assert failed and all("the device accepted" in o.error for o in failed)
    assert all(o.outputs[0].finish_reason == "error" for o in failed)
    llm.engine.scheduler.check_integrity()
