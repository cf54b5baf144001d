"""``min_tokens`` and ``allowed_token_ids``: masks in the batched sampler, with and
without n-gram speculation, beside free rows that they leave unchanged."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llms(tiny_granite):
    return {
        "plain": LLM(tiny_granite, max_num_seqs=8, max_model_len=256),
        "ngram": LLM(tiny_granite, max_num_seqs=8, max_model_len=256,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    }


PROMPTS = ["abcabcabc", "hello hello", "x"]


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_allowed_token_ids(llms, kind) -> None:
    llm = llms[kind]
    allowed = llm.tokenizer.encode("ab ", add_special_tokens=False)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=i, allowed_token_ids=allowed, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 1.0))]
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate([*PROMPTS, PROMPTS[0]], [*params, free], use_tqdm=False)
    for out in outs[:3]:
        ids = out.outputs[0].token_ids
        assert len(ids) == 20 and set(ids) <= set(allowed), ids
    # The free row beside them is what it is alone.
    alone = llm.generate([PROMPTS[0]], free, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == alone
    assert set(alone) - set(allowed), "the test needs a free row that leaves the allowed set"


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_min_tokens_holds_back_stops(llms, kind) -> None:
    llm = llms[kind]
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate(PROMPTS, base, use_tqdm=False)
    for prompt, out in zip(PROMPTS, free):
        ids = out.outputs[0].token_ids
        first = ids[0]
        # Stopping on the first greedy token ends at once without min_tokens...
        stop = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[first])
        assert llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0].token_ids == [first]
        # ...and cannot happen before min_tokens: the stop token is never drawn there.
        held = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[first], min_tokens=4)
        got = llm.generate([prompt], held, use_tqdm=False)[0].outputs[0].token_ids
        assert len(got) >= 4 and first not in got[:4], got
        # Stop strings wait for min_tokens too.
        text = llm.tokenizer.decode(ids[:1])
        held = SamplingParams(max_tokens=12, temperature=0.0, stop=[text], min_tokens=3,
                              stop_token_ids=[first])
        got = llm.generate([prompt], held, use_tqdm=False)[0].outputs[0]
        assert len(got.token_ids) >= 3


def test_validation(llms) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llms["plain"].generate(["x"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
