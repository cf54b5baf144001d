"""Admission's walk of the caches (Scheduler._probe): the same hit, KV prefix and host
key as a walk that looks up and compares one block at a time, also when a hit block's
tokens differ from the prompt's (a hash collision: the walk stops there)."""

from __future__ import annotations

import random

from hybridserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _block_by_block(sched, tokens, hashes):
    """The walk as BlockPool.lookup and the indexes' has() give it, block by block."""
    bs = sched.block_size
    hit, best, host_key = [], 0, None
    for i, h in enumerate(hashes):
        block_id = sched.blocks.lookup(h, tokens[i * bs : (i + 1) * bs])
        if block_id is None:
            break
        hit.append(block_id)
        if sched.states.has(h):
            best, host_key = (i + 1) * bs, None
        elif sched.host.has(h):
            host_key = h
    page = sched.states.checkpoints[hashes[best // bs - 1]].page if best else -1
    return best, hit[: best // bs], page, len(hit) * bs, host_key


def test_probe_stops_at_a_block_whose_tokens_differ(tiny_nemotron):
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(40 * 16)]
    llm = LLM(tiny_nemotron, state_interval=64, max_num_seqs=2, max_model_len=1024,
              checkpoint_policies=("grid", "prompt_end"))
    engine, sched = llm.engine, llm.engine.scheduler
    llm.generate([prefix + [5] * 24], GREEDY, use_tqdm=False)
    engine.add_request("again", prefix + [6] * 24, GREEDY)
    req = sched.waiting[-1]
    tokens = req.all_token_ids
    hashes = sched._hashes(req, (len(tokens) - 1) // sched.block_size)
    want = _block_by_block(sched, tokens, hashes)
    assert want[0] == 640 and want[3] == 640
    assert sched._probe(tokens, hashes, touch=False) == want
    index, blocks = sched.blocks.hash_to_block, sched.blocks.blocks
    for k in (0, 1, 3, 4, 17, 39):
        block = blocks[index[hashes[k]]]
        kept = block.token_ids
        block.token_ids = kept[:-1] + (kept[-1] + 1,)  # the same hash, other tokens
        try:
            want = _block_by_block(sched, tokens, hashes)
            assert want[3] == k * 16 and want[0] == k // 4 * 64
            assert sched._probe(tokens, hashes, touch=False) == want
        finally:
            block.token_ids = kept
    engine.abort_request("again")
