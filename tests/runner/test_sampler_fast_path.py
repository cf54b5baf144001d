"""The runner's device-side greedy path: same tokens as the general (host) path, taken
only when every sampling row is greedy without penalties or logprobs."""

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runner import sampler


def test_verify_choices_matches_verify_drafts():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    params = SamplingParams(temperature=0.0)
    for _ in range(200):
        d = int(torch.randint(0, 5, (), generator=g))
        logits = torch.randn(d + 1, 11, generator=g)
        choices = sampler.argmax_ids(logits).tolist()
        # Drafts agree with the argmax for a random prefix, then (maybe) disagree.
        agree = int(torch.randint(0, d + 1, (), generator=g))
        drafts = choices[:agree] + torch.randint(0, 11, (d - agree,), generator=g).tolist()
        logps = torch.stack([sampler.process_logits(row, params, [], []) for row in logits])
        want = sampler.verify_drafts(logps, drafts, params, 0, 0)
        assert sampler.verify_choices(choices, drafts) == want


def test_fast_path_only_for_plain_greedy():
    assert sampler.samples_by_argmax(SamplingParams(temperature=0.0))
    for kw in (dict(temperature=0.7), dict(temperature=0.0, repetition_penalty=1.2),
               dict(temperature=0.0, presence_penalty=0.5),
               dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.0, logprobs=2)):
        assert not sampler.samples_by_argmax(SamplingParams(**kw))


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_engine_outputs_equal_with_and_without_fast_paths(tiny_granite, monkeypatch, spec):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    # Repetitive prompts so n-gram drafts get accepted (verify rows of several tokens).
    prompts = [(torch.randint(3, 256, (6,), generator=g).tolist() * 3)[: 10 + i] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in
            LLM(tiny_granite, speculative_config=spec).generate(prompts, params, use_tqdm=False)]

    from hybridserve.config import KernelPolicy

    # No batched decode ops (attention and Mamba take their general paths) and no greedy
    # argmax read-back.
    monkeypatch.setattr(sampler, "samples_by_argmax", lambda params: False)
    slow_llm = LLM(tiny_granite, speculative_config=spec,
                   kernel_policy=KernelPolicy(uniform_decode=False))
    slow = [o.outputs[0].token_ids for o in slow_llm.generate(prompts, params, use_tqdm=False)]
    assert fast == slow
