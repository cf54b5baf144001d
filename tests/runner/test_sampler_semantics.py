"""What each sampling parameter means, checked against oracles that share no code with
the sampler: tables computed by hand on a five-token vocabulary, and transformers'
logits processors on random logits. Both implementations are held to them: the
per-row definition (``sampler.process_logits``) and the batched device sampler
(``sampler.process_step``, each row in a batch of rows with other parameters)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.runner import sampler


def _per_row(logits, params, prompt=(), output=()):
    return sampler.process_logits(torch.tensor(logits), params, list(prompt), list(output)).exp()


def _batched(logits, params, prompt=(), output=()):
    """The row's distribution from the batched sampler, between two rows of other
    parameters (penalties and truncation on, so every code path runs for the batch)."""
    x = torch.tensor(logits)
    other = SamplingParams(temperature=0.5, top_k=2, top_p=0.9, min_p=0.1,
                           repetition_penalty=1.5, presence_penalty=0.3,
                           frequency_penalty=0.2)
    rows = [
        sampler.SampleRow(other, 1, 0, [1, 2], [3], []),
        sampler.SampleRow(params, 7, len(output), list(prompt), list(output), []),
        sampler.SampleRow(other, 2, 1, [4], [0, 0], []),
    ]
    plan = sampler.plan_draw(rows, x.numel())
    logp = sampler.process_step(torch.stack([x.flip(0), x, x * 0.5]), plan, plan.packed)
    return logp[1].exp()


IMPLEMENTATIONS = pytest.mark.parametrize("probs", [_per_row, _batched], ids=["per_row", "batched"])


def _softmax(values):
    m = max(v for v in values if v != -math.inf)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in values]
    return [v / sum(e) for v in e]


def _assert_probs(got: torch.Tensor, want: list[float]):
    want_t = torch.tensor(want, dtype=torch.float32)
    assert torch.equal(got == 0, want_t == 0), f"support {got.tolist()} != {want}"
    torch.testing.assert_close(got, want_t, rtol=1e-5, atol=1e-6)


LOGITS = [2.0, -1.0, 0.5, -0.5, 1.0]
# Probabilities 0.5, 0.25, 0.15, 0.07, 0.03 (at temperature 1).
PEAKED = [math.log(p) for p in (0.5, 0.25, 0.15, 0.07, 0.03)]


# --- penalties ----------------------------------------------------------------------


@IMPLEMENTATIONS
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(probs):
    # Tokens 0 and 1 are in the prompt, 3 in the output: 2.0 / 2, -1.0 * 2, -0.5 * 2.
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    got = probs(LOGITS, params, prompt=[0, 1], output=[3])
    _assert_probs(got, _softmax([1.0, -2.0, 0.5, -1.0, 1.0]))
    # A penalty below 1 rewards repetition the same way round.
    params = SamplingParams(temperature=1.0, repetition_penalty=0.5)
    got = probs(LOGITS, params, prompt=[0, 1], output=[3])
    _assert_probs(got, _softmax([4.0, -0.5, 0.5, -0.25, 1.0]))


@IMPLEMENTATIONS
def test_presence_and_frequency_penalties_count_output_tokens_only(probs):
    # Output [2, 2, 4]: token 2 loses 0.5 + 2 * 0.25, token 4 loses 0.5 + 0.25; the
    # prompt's token 0 is not penalised.
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = probs(LOGITS, params, prompt=[0], output=[2, 2, 4])
    _assert_probs(got, _softmax([2.0, -1.0, -0.5, -0.5, 0.25]))


@IMPLEMENTATIONS
def test_greedy_applies_penalties_before_the_argmax(probs):
    # 2.0 / 4 = 0.5 falls below token 4's 1.0: greedy picks token 4.
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    got = probs(LOGITS, params, prompt=[0], output=[])
    assert int(got.argmax()) == 4
    _assert_probs(got, _softmax([0.5, -1.0, 0.5, -0.5, 1.0]))


@IMPLEMENTATIONS
def test_logit_bias_adds_to_the_logits_before_penalties_and_temperature(probs):
    # Token 1 gets +3 (-1.0 -> 2.0), token 4 gets -1.5 (1.0 -> -0.5); then the
    # repetition penalty on the prompt's token 1 halves its now positive logit (vLLM's
    # order: bias, then penalties), and temperature 0.5 doubles everything.
    params = SamplingParams(temperature=0.5, logit_bias={1: 3.0, 4: -1.5}, repetition_penalty=2.0)
    got = probs(LOGITS, params, prompt=[1])
    _assert_probs(got, _softmax([2 * v for v in (2.0, 1.0, 0.5, -0.5, -0.5)]))


@IMPLEMENTATIONS
def test_logit_bias_is_clamped_to_100_and_steers_greedy(probs):
    # -1e4 is clamped to -100 (as OpenAI and vLLM clamp), so token 0 keeps a tiny
    # probability instead of none; +100 on token 3 makes it the greedy choice.
    params = SamplingParams(temperature=1.0, logit_bias={0: -1e4})
    _assert_probs(probs(LOGITS, params), _softmax([2.0 - 100, -1.0, 0.5, -0.5, 1.0]))
    got = probs(LOGITS, SamplingParams(temperature=0.0, logit_bias={3: 100.0}))
    assert int(got.argmax()) == 3


def test_logit_bias_validation_names_the_field():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
    assert SamplingParams(logit_bias={}).logit_bias is None


# --- temperature and truncation ----------------------------------------------------


@IMPLEMENTATIONS
def test_temperature_divides_the_logits(probs):
    _assert_probs(probs(LOGITS, SamplingParams(temperature=0.5)), _softmax([2 * v for v in LOGITS]))
    _assert_probs(probs(LOGITS, SamplingParams(temperature=2.0)), _softmax([v / 2 for v in LOGITS]))


@IMPLEMENTATIONS
def test_top_k_keeps_the_k_most_likely(probs):
    got = probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    _assert_probs(got, _softmax([2.0, -math.inf, -math.inf, -math.inf, 1.0]))
    got = probs(LOGITS, SamplingParams(temperature=1.0, top_k=1))
    _assert_probs(got, [1.0, 0.0, 0.0, 0.0, 0.0])


@IMPLEMENTATIONS
@pytest.mark.parametrize("top_p,kept", [(0.3, [0.5]), (0.7, [0.5, 0.25]),
                                        (0.8, [0.5, 0.25, 0.15]), (0.95, [0.5, 0.25, 0.15, 0.07])])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(probs, top_p, kept):
    got = probs(PEAKED, SamplingParams(temperature=1.0, top_p=top_p))
    want = kept + [0.0] * (5 - len(kept))
    _assert_probs(got, [p / sum(kept) for p in want])


@IMPLEMENTATIONS
@pytest.mark.parametrize("min_p,kept", [(0.2, [0.5, 0.25, 0.15]), (0.1, [0.5, 0.25, 0.15, 0.07]),
                                        (0.6, [0.5])])
def test_min_p_is_relative_to_the_most_likely_token(probs, min_p, kept):
    # min_p 0.2: the threshold is 0.2 * 0.5 = 0.1, so 0.15 stays (an absolute threshold
    # of 0.2 would drop it); min_p 0.6: 0.3 leaves the top token alone.
    got = probs(PEAKED, SamplingParams(temperature=1.0, min_p=min_p))
    want = kept + [0.0] * (5 - len(kept))
    _assert_probs(got, [p / sum(kept) for p in want])


@IMPLEMENTATIONS
def test_everything_at_once_in_order(probs):
    """Penalties, then temperature, then top-k, top-p, min-p (each on what the last
    left), worked by hand."""
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.3,
                            repetition_penalty=2.0, presence_penalty=0.5)
    got = probs(LOGITS, params, prompt=[0], output=[1])
    # Repetition on tokens 0 and 1, presence on 1: [1.0, -2.5, 0.5, -0.5, 1.0];
    # temperature 0.5: [2, -5, 1, -1, 2]; top-4 drops token 1. Probabilities
    # e^2, e, e^-1, e^2 over 2e^2 + e + e^-1 = 0.4136, 0.1522, 0.0206, 0.4136.
    # top-p 0.9: the mass before token 3 is 0.9794 >= 0.9, so it goes; renormalised
    # 0.4222, 0.1555, 0.4222; min-p 0.3 (threshold 0.1267) keeps all three.
    e = math.e
    z = 2 * e**2 + e
    _assert_probs(got, [e**2 / z, 0.0, e / z, 0.0, e**2 / z])
    # A min-p of 0.4 (threshold 0.169) then drops token 2 as well.
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.4,
                            repetition_penalty=2.0, presence_penalty=0.5)
    _assert_probs(probs(LOGITS, params, prompt=[0], output=[1]), [0.5, 0.0, 0.0, 0.0, 0.5])


# --- against transformers' logits processors ----------------------------------------


def _transformers_probs(logits, params, prompt, output):
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([list(prompt) + list(output)])
    x = logits[None].clone()
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(params.temperature)(ids, x)
    if params.top_k > 0:
        x = TopKLogitsWarper(params.top_k)(ids, x)
    if params.top_p < 1.0:
        x = TopPLogitsWarper(params.top_p)(ids, x)
    if params.min_p > 0.0:
        x = MinPLogitsWarper(params.min_p)(ids, x)
    return torch.softmax(x[0], dim=-1)


@IMPLEMENTATIONS
def test_matches_transformers_logits_processors(probs, test_seed):
    rng = random.Random(test_seed)
    g = torch.Generator().manual_seed(test_seed)
    vocab = 40
    for _ in range(60):
        params = SamplingParams(
            temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=rng.choice([0, 1, 3, 10, 39]),
            top_p=rng.choice([1.0, 0.2, 0.6, 0.9]),
            min_p=rng.choice([0.0, 0.02, 0.1, 0.4]),
            repetition_penalty=rng.choice([1.0, 0.8, 1.3, 2.0]),
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        logits = torch.randn(vocab, generator=g) * 3
        want = _transformers_probs(logits, params, prompt, output)
        got = probs(logits.tolist(), params, prompt, output)
        assert torch.equal(got == 0, want == 0), params
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
