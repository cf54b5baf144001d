"""The prefix hit predicted on a request's arrival (Scheduler.predict_hit): the same value
as admission's walk of the caches, at a fraction of its work."""

from __future__ import annotations

import random

from hybridserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _probe_prediction(sched, req) -> int:
    """The prediction as admission's own walk finds it (:meth:`Scheduler._probe`, which
    compares every hit block's tokens), without marking anything used: the deepest
    device hit, or a deeper host-tier checkpoint's length."""
    tokens = req.all_token_ids
    hashes = sched._hashes(req, (len(tokens) - 1) // sched.block_size)
    best, _, _, _, host_key = sched._probe(tokens, hashes, touch=False)
    if host_key is not None:
        best = max(best, sched.host.checkpoints[host_key].length)
    return best


def test_prediction_equals_the_admission_walk_on_device_host_and_evicted_prefixes(tiny_granite):
    """Prompts sharing prefixes on a two-page device budget with a host tier and few KV
    blocks: deepest checkpoints on the device, on the host, behind an evicted KV block,
    or none. Every prediction equals what admission's walk of the same caches gives."""
    rng = random.Random(5)
    roots = [_rand(rng, n) for n in (90, 70, 50, 33)]
    llm = LLM(tiny_granite, state_interval=16, max_checkpoint_pages=2,
              checkpoint_offload_pages=16, max_num_seqs=2, max_model_len=160,
              num_kv_blocks=40)
    engine = llm.engine
    sched = engine.scheduler
    kinds = {"device": 0, "host": 0, "none": 0}
    for step in range(24):
        root = rng.choice(roots)
        prompt = root[: rng.randint(1, len(root))] + _rand(rng, rng.randint(1, 20))
        for j, ask in enumerate((prompt, root + [7], root[:40] + [9])):
            rid = f"ask-{step}-{j}"
            engine.add_request(rid, ask, GREEDY)
            req = sched.waiting[-1]
            predicted = engine.predicted_cached_tokens(rid)
            want = _probe_prediction(sched, req)
            assert predicted == want, (step, j, predicted, want)
            if want == 0:
                kinds["none"] += 1
            elif any(sched.host.has(h) for h in req.block_hashes[want // 16 - 1 : want // 16]):
                kinds["host"] += 1
            else:
                kinds["device"] += 1
            engine.abort_request(rid)
        llm.generate([prompt], GREEDY, use_tqdm=False)
    # The workload reaches every case the prediction distinguishes.
    assert all(kinds.values()), kinds
    # A KV prefix that breaks before the deepest checkpoint (the index drops such
    # checkpoints itself; here the block's hash is hidden from the index for one
    # prediction) stops the prediction where admission's walk stops.
    prompt = roots[0] + [7]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    engine.add_request("broken", prompt, GREEDY)
    req = sched.waiting[-1]
    assert engine.predicted_cached_tokens("broken") >= 48
    cached = sched.blocks.hash_to_block
    hidden = req.block_hashes[1]
    block = cached.pop(hidden)
    try:
        assert sched.predict_hit(req) == _probe_prediction(sched, req) < 32
    finally:
        cached[hidden] = block
    engine.abort_request("broken")


def test_arrival_compares_no_block_tokens(tiny_nemotron):
    """A prompt over a long cached prefix: its arrival's prediction walks the block index
    by hash only, so the tokens of each hit block are compared once in all (by
    admission), not twice; the prediction is still the hit admission takes."""
    rng = random.Random(2)
    prefix = _rand(rng, 40 * 16)
    llm = LLM(tiny_nemotron, state_interval=64, max_num_seqs=2, max_model_len=1024,
              checkpoint_policies=("grid", "prompt_end"))
    engine = llm.engine
    llm.generate([prefix + _rand(rng, 24)], GREEDY, use_tqdm=False)
    blocks = engine.scheduler.blocks
    compared = []

    class Counted(tuple):
        """A cached block's token ids, recording every comparison with a prompt's (one
        block at a time, or read in a pass over the whole path)."""

        def __ne__(self, other):
            compared.append(self)
            return tuple.__ne__(self, other)

        def __iter__(self):
            compared.append(self)
            return tuple.__iter__(self)

    for block in blocks.blocks:
        block.token_ids = Counted(block.token_ids)
    engine.add_request("again", prefix + _rand(rng, 24), GREEDY)
    assert compared == []
    predicted = engine.predicted_cached_tokens("again")
    assert predicted == 640
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == predicted
    # Admission's walk: the 40 hit blocks, once each (the first miss after them is a
    # miss by hash: no tokens to compare).
    assert len(compared) == len({id(t) for t in compared}) == 40
