"""Helpers the speculative-decoding tests share: random prompts, the tokens of a
generation, the drafter's page-exact state check, a driver of request waves, the
MTP drafter's from-scratch comparison, greedy runs against references (and with a head
that accepts every draft), and edited copies of a checkpoint."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def assert_greedy_workloads_match(llm, references: dict[int, list[list[int]]], params,
                                  caching: bool) -> None:
    """Workload 0, then 1 (new prompts, some sharing prefixes), then 0 again (prefix hits
    when ``caching``, and speculation together) give the ``references`` tokens of each
    workload (checking integrity every step); drafts were made, and at the end the MTP
    drafter's K/V blocks are all back (freed with the requests)."""
    llm.engine.check_integrity_every_step = True
    for seed in (0, 1, 0):
        assert output_tokens(llm.generate(motif_workload(seed), params)) == references[seed]
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0
    if caching:
        assert stats["prefix_hit_tokens"] > 0
    drafter = llm.engine.drafter
    drafter.check_integrity()
    assert drafter.blocks.num_free == drafter.blocks.num_blocks


def assert_every_mtp_draft_accepted(path, cachings, params) -> None:
    """With the MTP head of ``path`` (one built to equal its context-free target), each
    prefix-cache setting of ``cachings`` and k in {1, 3}: the output of workloads 0 and 1
    is the target's without speculation, and every one of the (many) drafts is accepted."""
    from hybridserve import LLM

    prompts = motif_workload(0) + motif_workload(1)
    ref = output_tokens(LLM(path, enable_prefix_caching=False).generate(prompts, params))
    for caching in cachings:
        for d in (1, 3):
            llm = LLM(path, enable_prefix_caching=caching, state_interval=16,
                      speculative_config={"method": "mtp", "num_speculative_tokens": d})
            llm.engine.check_integrity_every_step = True
            assert output_tokens(llm.generate(prompts, params)) == ref
            s = llm.stats()
            assert s["spec_draft_tokens"] > 50
            assert s["spec_accepted_tokens"] == s["spec_draft_tokens"], (caching, d, s)
            assert s["spec_mean_accepted_length"] > d


def copy_checkpoint(src: Path, dst: Path, config: Callable | None = None,
                    weights: Callable | None = None) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst``, its ``config.json`` dict
    and its tensors passed through ``config`` / ``weights`` (each edits in place or
    returns the replacement)."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config:
        raw = config(raw) or raw
    (dst / "config.json").write_text(json.dumps(raw))
    w = load_file(str(src / "model.safetensors"))
    if weights:
        w = weights(w) or w
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
