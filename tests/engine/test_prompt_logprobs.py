"""``prompt_logprobs`` and ``logit_bias`` through the engine: prompt logprobs equal
transformers' log-softmax at every prompt position, whatever the chunking, the batch,
or the prefix cache holds; a logit bias steers what is sampled."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams


def _prompts(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_logp(tiny_granite):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_granite, dtype=torch.float32).eval()

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return logp


def _check_against(prompt_lps, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Entry p is token p's logprob given tokens < p (ref row p - 1), its rank, and the
    k most likely tokens there."""
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for p in range(1, len(ids)):
        entry, row = prompt_lps[p], ref[p - 1]
        tok = ids[p]
        v = row[tok]
        assert entry[tok].logprob == pytest.approx(float(v), abs=1e-4)
        # The rank, up to the reference's rounding of near ties.
        assert int((row > v + 1e-5).sum()) + 1 <= entry[tok].rank <= int((row > v - 1e-5).sum()) + 1
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1))
        torch.testing.assert_close(torch.tensor([x for _, _, x in top]), row.topk(k).values,
                                   atol=1e-4, rtol=0)
        assert set(entry) == {t for _, t, _ in top} | {tok}


def test_prompt_logprobs_match_transformers_chunked_and_batched(tiny_granite, hf_logp):
    prompts = _prompts(31, 4, 5, 70)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    # Chunks of 7 tokens: each prompt spans several prefill rows, and rows of several
    # prompts share steps.
    llm = LLM(tiny_granite, max_num_seqs=4, max_num_batched_tokens=7)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs):
        _check_against(out.prompt_logprobs, ids, hf_logp(ids), 3)
    # Asking for them changes no generated token.
    plain = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_k0_reports_only_the_prompt_token(tiny_granite, hf_logp):
    ids = _prompts(32, 1, 20, 20)[0]
    llm = LLM(tiny_granite, max_num_seqs=2)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
    ref = hf_logp(ids)
    for p in range(1, len(ids)):
        assert list(out.prompt_logprobs[p]) == [ids[p]]
        assert out.prompt_logprobs[p][ids[p]].logprob == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)


def test_a_cached_prefix_is_not_read_for_prompt_logprobs(tiny_granite, hf_logp):
    """The prefix cache holds the whole prompt; a request asking for prompt logprobs
    computes every position anyway (no hit), and gets the same numbers as cold."""
    ids = _prompts(33, 1, 150, 150)[0]
    llm = LLM(tiny_granite, max_num_seqs=2, state_interval=32)
    llm.generate([ids], SamplingParams(max_tokens=4))
    (warm,) = llm.generate([ids], SamplingParams(max_tokens=1))
    assert warm.num_cached_tokens > 100  # the cache does serve this prompt
    before = llm.stats()["prefix_queries"]
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.num_cached_tokens == 0
    assert llm.stats()["prefix_queries"] == before  # not looked up
    _check_against(out.prompt_logprobs, ids, hf_logp(ids), 1)


def test_prompt_logprobs_survive_preemption(tiny_granite, hf_logp):
    prompts = _prompts(34, 6, 30, 40)
    llm = LLM(tiny_granite, max_num_seqs=6, max_model_len=128, num_kv_blocks=14)
    llm.engine.check_integrity_every_step = True
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2))
    assert llm.stats()["preemptions"] > 0
    for ids, out in zip(prompts, outs):
        _check_against(out.prompt_logprobs, ids, hf_logp(ids), 2)


def test_logit_bias_steers_greedy_and_sampled_tokens(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    ids = _prompts(35, 1, 10, 10)[0]
    (out,) = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                logit_bias={77: 100.0}))
    assert out.outputs[0].token_ids == [77] * 6
    (free,) = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    first = free.outputs[0].token_ids[0]
    (banned,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                   logit_bias={first: -100.0}))
    assert banned.outputs[0].token_ids[0] != first
    sampled = llm.generate([ids] * 3, SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                                                     ignore_eos=True, logit_bias={9: 100.0, 10: 100.0}))
    assert all(set(o.outputs[0].token_ids) <= {9, 10} for o in sampled)


def test_bad_prompt_logprobs_names_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
