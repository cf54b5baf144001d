"""Token bitmasks in the batched sampler: packed into the step's one buffer without a
changed bit, applied to constrained positions only, and absent from steps without
constrained rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve import SamplingParams, StructuredOutputsParams
from hybridserve.runner import sampler
from hybridserve.structured.backend import bitmask_words

CONSTRAINED = StructuredOutputsParams(regex="a")  # only marks the params; masks come from below


class FixedMasks:
    """A grammar whose masks are given: position j of a row gets ``masks[j]`` (the
    sampler's side of the contract, without a parser)."""

    def __init__(self, masks: np.ndarray, vocab_size: int) -> None:
        self.masks = masks
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.calls: list[list[int]] = []

    def fill_bitmasks(self, drafts, out: np.ndarray) -> None:
        self.calls.append(list(drafts))
        out[:] = self.masks[: len(drafts) + 1]


def _random_masks(rng: np.random.Generator, count: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` masks as int32 words and as bool rows; every row allows >= 1 token, and
    bit 31 (the sign bit) is set in some words so sign handling is exercised."""
    allowed = rng.random((count, vocab)) < rng.choice([0.05, 0.3, 0.9])
    allowed[np.arange(count), rng.integers(0, vocab, count)] = True
    words = bitmask_words(vocab)
    padded = np.zeros((count, words * 32), dtype=bool)
    padded[:, :vocab] = allowed
    packed = np.packbits(padded.reshape(count, words, 32), axis=-1, bitorder="little")
    return packed.reshape(count, words * 4).view(np.int32).copy(), allowed


def test_dense_masks_equal_the_masked_positions():
    """The decode graphs' draw masks every position from a dense buffer (all ones for
    rows that mask nothing): the same values as the eager sampler's masked positions,
    the other rows bit for bit unchanged."""
    rng = np.random.default_rng(3)
    vocab = 77
    masks, allowed = _random_masks(rng, 5, vocab)
    row = sampler.SampleRow(SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED), 0, 0, [], [],
                            [1, 2, 3, 4], grammar=FixedMasks(masks, vocab))
    free = sampler.SampleRow(SamplingParams(temperature=0.0), 0, 0, [], [], [5])
    plan = sampler.plan_draw([free, row], vocab)
    x = torch.randn(7, vocab)
    want = sampler.apply_bitmasks(x, plan, plan.packed)
    dense = np.full((7, bitmask_words(vocab)), -1, dtype=np.int32)
    sampler.fill_masks([row], dense, vocab, starts=[2])
    got = sampler.apply_dense_bitmasks(x, torch.from_numpy(dense))
    assert torch.equal(got, want)
    assert torch.equal(got[:2], x[:2])
    assert torch.equal(torch.isfinite(got[2:]), torch.from_numpy(allowed))


@pytest.mark.parametrize("vocab", [31, 32, 70, 97])
def test_masks_survive_the_float64_buffer(vocab):
    rng = np.random.default_rng(vocab)
    masks, allowed = _random_masks(rng, 3, vocab)
    if vocab >= 32:
        masks[0, 0] |= np.int32(-(2**31))  # the sign bit of a word
        allowed[0, 31] = True
    row = sampler.SampleRow(SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED), 0, 0, [], [],
                            [1, 2], grammar=FixedMasks(masks, vocab))
    plan = sampler.plan_draw([row], vocab)
    assert plan.num_masked == 3 and plan.mask_words == bitmask_words(vocab)
    x = torch.zeros(3, vocab)
    got = sampler.apply_bitmasks(x, plan, plan.packed)
    assert torch.equal(torch.isfinite(got), torch.from_numpy(allowed))


def test_constrained_rows_match_the_masked_reference_and_free_rows_are_untouched():
    rng = random.Random(0)
    nrng = np.random.default_rng(0)
    vocab = 75
    g = torch.Generator().manual_seed(0)
    rows, allowed_rows, logits = [], [], []
    for i in range(40):
        kw = dict(temperature=rng.choice([0.0, 0.5, 1.0]), top_k=rng.choice([0, 5]),
                  top_p=rng.choice([1.0, 0.8]), repetition_penalty=rng.choice([1.0, 1.3]))
        constrained = i % 3 != 0
        drafts = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        grammar = None
        if constrained:
            masks, allowed = _random_masks(nrng, len(drafts) + 1, vocab)
            grammar = FixedMasks(masks, vocab)
            kw["structured_outputs"] = CONSTRAINED
        params = SamplingParams(**kw)
        rows.append(sampler.SampleRow(params, rng.randrange(2**62), len(output), [1, 2], output, drafts, grammar))
        for j in range(len(drafts) + 1):
            logits.append(torch.randn(vocab, generator=g) * 3)
            allowed_rows.append(allowed[j] if constrained else None)
    logits = torch.stack(logits)
    plan = sampler.plan_draw(rows, vocab)
    got = sampler.process_step(logits, plan, plan.packed)
    free = [sampler.SampleRow(r.params, r.sample_seed, r.first_index, r.prompt_ids, r.output_ids, r.drafts)
            for r in rows]
    unmasked = sampler.process_step(logits, sampler.plan_draw(free, vocab), sampler.plan_draw(free, vocab).packed)
    pos = 0
    for r in rows:
        out = list(r.output_ids)
        for j in range(len(r.drafts) + 1):
            allowed = allowed_rows[pos]
            if allowed is None:
                assert torch.equal(got[pos], unmasked[pos])
            else:
                masked = logits[pos].masked_fill(~torch.from_numpy(allowed), float("-inf"))
                want = sampler.process_logits(masked, r.params, r.prompt_ids, out)
                torch.testing.assert_close(got[pos], want, rtol=1e-5, atol=1e-5)
                assert not torch.isfinite(got[pos][~torch.from_numpy(allowed)]).any()
            if j < len(r.drafts):
                out.append(r.drafts[j])
            pos += 1
    # Every drawn token of a constrained position is one its mask allows.
    choices, _ = sampler.read_step(sampler.sample_step(logits, plan, plan.packed).tolist(), plan)
    for c, allowed in zip(choices, allowed_rows):
        assert allowed is None or allowed[c]


def test_rows_ask_their_grammar_for_every_position_once():
    vocab = 40
    masks, _ = _random_masks(np.random.default_rng(1), 4, vocab)
    grammar = FixedMasks(masks, vocab)
    p = SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED)
    sampler.plan_draw([sampler.SampleRow(p, 0, 0, [], [], [3, 4, 5], grammar)], vocab)
    assert grammar.calls == [[3, 4, 5]]


def test_a_grammar_for_another_vocabulary_is_refused():
    masks, _ = _random_masks(np.random.default_rng(2), 1, 64)
    p = SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED)
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.plan_draw([sampler.SampleRow(p, 0, 0, [], [], [], FixedMasks(masks, 64))], 200)


def test_constrained_params_leave_the_greedy_path_and_take_the_masked_graphs():
    p = SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED)
    assert not sampler.samples_by_argmax(p)
    # Masks have a fixed size: decode graphs draw such rows through their mask buffer;
    # penalties, biases and logprobs still leave the graphs.
    assert sampler.graph_samplable(p) and sampler.needs_mask(p, object())
    assert not sampler.needs_mask(p, None)  # a grammar waiting for its start tag
    assert sampler.needs_mask(SamplingParams(temperature=0.0, min_tokens=3), None)
    for kw in ({"logprobs": 1}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
               {"frequency_penalty": 0.5}, {"logit_bias": {3: 1.0}}):
        assert not sampler.graph_samplable(SamplingParams(temperature=0.0, structured_outputs=CONSTRAINED, **kw))
    plain = SamplingParams(temperature=0.0)
    plan = sampler.plan_draw([sampler.SampleRow(plain, 0, 0, [], [], [])], 50)
    assert plan.num_masked == 0 and plan.packed.numel() == len(sampler.PARAM_COLUMNS)
