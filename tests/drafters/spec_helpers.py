"""Helpers the speculative-decoding tests share: random prompts, the tokens of a
generation, the drafter's page-exact state check, a driver of request waves and the
MTP drafter's from-scratch comparison."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from hybridserve.testing.reference import reference_state
from hybridserve.testing.tiny_mtp import dense_hidden, dense_mtp_drafts


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random ids clear of the tiny tokenizers' special ids."""
    return [rng.randrange(3, 256) for _ in range(n)]


def output_tokens(outs) -> list[list[int]]:
    """The generated ids of each output's first completion."""
    return [o.outputs[0].token_ids for o in outs]


def motif_workload(seed: int) -> list[list[int]]:
    """A repeated motif (drafts get accepted), a random prompt, the motif then random
    ids, and a short random prompt."""
    rng = random.Random(seed)
    motif = rand_tokens(rng, 6)
    return [motif * 5, rand_tokens(rng, 21), motif * 2 + rand_tokens(rng, 4), rand_tokens(rng, 3)]


def assert_page_exact(drafter, page: int, prefix: list[int]) -> None:
    """The draft model's recurrent state in ``page`` is its exact state after ``prefix``."""
    conv, ssm = reference_state(drafter.model, prefix, len(prefix), torch.float32)
    for layer in conv:
        assert (drafter.caches.conv[layer][page] - conv[layer]).abs().max() <= 1e-5
        assert (drafter.caches.ssm[layer][page] - ssm[layer]).abs().max() <= 1e-5


def step_waves(engine, prompts, params, waves: int = 2) -> Iterator[dict[str, list[int]]]:
    """Run ``waves`` waves of ``prompts`` (each wave once the one before has finished)
    step by step, checking the drafter's integrity after every step; yields after each
    step every request's token sequence seen so far, by request id."""
    seen: dict[str, list[int]] = {}
    for wave in range(waves):
        for i, p in enumerate(prompts):
            engine.add_request(f"w{wave}r{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            engine.drafter.check_integrity()
            for req in engine.scheduler.running:
                seen[req.request_id] = list(req.all_token_ids)
            yield seen


def assert_mtp_drafts_match_dense(llm, prompts, params) -> None:
    """Every proposal the engine's MTP drafter makes while generating ``prompts``
    (incremental catch-up from the hidden states handed over after prefill and verify
    steps) equals the head run from scratch on the dense hidden states of the same
    prefix."""
    drafter = llm.engine.drafter
    seen: list[tuple[list[int], int, list[int]]] = []
    original = drafter.propose_batch

    def spy(requests):
        out = original(requests)
        seen.extend((list(r.token_ids), r.k, o) for r, o in zip(requests, out))
        return out

    drafter.propose_batch = spy
    llm.generate(prompts, params)
    assert len(seen) > 20
    with torch.inference_mode():
        for tokens, k, drafts in seen[::3]:
            hidden = dense_hidden(llm.model, tokens)
            assert drafts == dense_mtp_drafts(drafter, tokens, hidden, k)


def run_aborting_duplicates(engine, prompts, params, at_step: int = 6) -> dict[str, list[int]]:
    """Add ``prompts`` as ``r0 ..``, then their first two again, step the engine to the
    end and abort the two duplicates at step ``at_step`` (mid-speculation); returns the
    finished requests' tokens by request id."""
    for i, p in enumerate(prompts + prompts[:2]):
        engine.add_request(f"r{i}", p, params)
    n = len(prompts)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == at_step:
            assert engine.abort_request(f"r{n}") and engine.abort_request(f"r{n + 1}")
    return done
