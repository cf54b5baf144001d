"""The runner's device-side greedy path: same tokens as the general (host) path, taken
only when every sampling row is greedy without penalties or logprobs."""

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runner import sampler


def test_verify_choices_by_hand():
    """``choices[j]``: the target's token after draft position j."""
    vc = sampler.verify_choices
    assert vc([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all d drafts accepted: d + 1 tokens
    assert vc([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the first rejection emits the target's token
    assert vc([4, 6, 7, 8], [5, 6, 7]) == [4]  # ... and later agreement no longer counts
    assert vc([1, 2, 3], [9, 2]) == [1]
    assert vc([3], []) == [3]  # no drafts: the target's token alone


def _one_hot_logps(tokens, vocab=8):
    """Distributions that put all their mass on one token each (every processing and
    every draw, greedy or sampled, must pick it)."""
    x = torch.full((len(tokens), vocab), float("-inf"))
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return x


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_drafts_by_hand(temperature):
    params = SamplingParams(temperature=temperature)
    logps = _one_hot_logps([2, 0, 4, 6])
    vd = lambda drafts: sampler.verify_drafts(logps[: len(drafts) + 1], drafts, params, 3, 10)
    assert vd([2, 0, 4]) == [2, 0, 4, 6]  # every draft accepted, then the bonus token
    assert vd([2, 1, 4]) == [2, 0]  # rejected at position 1: the walk stops there
    assert vd([3, 0, 4]) == [2]
    assert vd([]) == [2]
    # Greedy on plain logits: accept while the draft is the argmax.
    logits = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.5, 1.0], [0.0, 0.1, 0.2]])
    logps = torch.log_softmax(logits, dim=-1)
    greedy = SamplingParams(temperature=0.0)
    assert sampler.verify_drafts(logps, [2, 0], greedy, None, 0) == [2, 0, 2]
    assert sampler.verify_drafts(logps, [2, 1], greedy, None, 0) == [2, 0]


def test_fast_path_only_for_plain_greedy():
    assert sampler.samples_by_argmax(SamplingParams(temperature=0.0))
    for kw in (dict(temperature=0.7), dict(temperature=0.0, repetition_penalty=1.2),
               dict(temperature=0.0, presence_penalty=0.5),
               dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.0, logprobs=2)):
        assert not sampler.samples_by_argmax(SamplingParams(**kw))


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_engine_outputs_equal_with_and_without_fast_paths(tiny_granite, monkeypatch, spec,
                                                          count_calls, mixer_paths):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    # Repetitive prompts so n-gram drafts get accepted (verify rows of several tokens).
    prompts = [(torch.randint(3, 256, (6,), generator=g).tolist() * 3)[: 10 + i] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from hybridserve.kernels import paged_attention

    argmax = count_calls(sampler, "argmax_ids")
    sampled = count_calls(sampler, "sample_step")
    uniform_attention = count_calls(paged_attention, "paged_attention_decode_reference")
    fast = [o.outputs[0].token_ids for o in
            LLM(tiny_granite, speculative_config=spec).generate(prompts, params, use_tqdm=False)]
    # Which paths the fast side took: the device argmax for every step, the uniform
    # attention and Mamba decode paths for decode steps.
    fast_paths = (len(argmax), len(sampled), len(uniform_attention), mixer_paths["decode"])
    assert fast_paths[0] > 0 and fast_paths[1] == 0 and fast_paths[2] > 0 and fast_paths[3] > 0

    from hybridserve.config import KernelPolicy

    # No batched decode ops (attention and Mamba take their general paths) and no greedy
    # argmax read-back.
    monkeypatch.setattr(sampler, "samples_by_argmax", lambda params: False)
    slow_llm = LLM(tiny_granite, speculative_config=spec,
                   kernel_policy=KernelPolicy(uniform_decode=False))
    slow = [o.outputs[0].token_ids for o in slow_llm.generate(prompts, params, use_tqdm=False)]
    # The slow side took none of them: the general sampler, per-row paths.
    assert (len(argmax), len(uniform_attention), mixer_paths["decode"]) == fast_paths[:1] + fast_paths[2:]
    assert len(sampled) > 0
    assert fast == slow
