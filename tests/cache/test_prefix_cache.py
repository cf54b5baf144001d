"""Prefix caching of attention KV and recurrent state (docs/state-lifecycle.md)."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.testing.reference import assert_checkpoints_exact

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _workload(seed: int) -> list[list[int]]:
    """Prompts sharing prefixes of lengths on and off the 16/64 grids, some shorter than 64."""
    rng = random.Random(seed)
    roots = [_rand(rng, n) for n in (100, 64, 37, 16, 130)]
    prompts = []
    for _ in range(14):
        root = rng.choice(roots)
        cut = rng.choice([len(root), rng.randint(1, len(root))])
        prompts.append(root[:cut] + _rand(rng, rng.randint(1, 30)))
    return prompts


@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_identical_with_and_without_prefix_caching(tiny_granite, seed):
    prompts = _workload(seed)
    ref = _tokens(LLM(tiny_granite, enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = LLM(tiny_granite, state_interval=32, max_num_seqs=4)
    llm.engine.check_integrity_every_step = True
    # In waves, so later prompts find what earlier ones left.
    got = []
    for i in range(0, len(prompts), 4):
        got += _tokens(llm.generate(prompts[i : i + 4], GREEDY))
    assert got == ref
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] > 0
    seqs = [p + o for p, o in zip(prompts, got)]
    assert assert_checkpoints_exact(llm, seqs + prompts) > 0


def test_eviction_pressure_keeps_outputs_exact(tiny_granite):
    prompts = _workload(2) * 2
    ref = _tokens(LLM(tiny_granite, enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = LLM(
        tiny_granite, state_interval=16, max_num_seqs=3, max_checkpoint_pages=3,
        num_kv_blocks=40, max_model_len=192,
    )
    llm.engine.check_integrity_every_step = True
    got = []
    for i in range(0, len(prompts), 3):
        got += _tokens(llm.generate(prompts[i : i + 3], GREEDY))
    assert got == ref
    stats = llm.stats()
    assert stats["checkpoints_evicted"] + stats["checkpoints_dropped"] > 0
    assert stats["checkpoint_pages"] <= 3
    seqs = [p + o for p, o in zip(prompts, got)]
    assert_checkpoints_exact(llm, seqs + prompts)


def test_multi_turn_chat_hits_previous_turn(tiny_granite):
    rng = random.Random(5)
    llm = LLM(tiny_granite)
    ref_llm = LLM(tiny_granite, enable_prefix_caching=False)
    prompt = _rand(rng, 45)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for _turn in range(3):
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == ref_llm.generate([prompt], params)[0].outputs[0].token_ids
        seq = prompt + out.outputs[0].token_ids
        # The next turn: this turn's prompt + output + new user text.
        prompt = seq + _rand(rng, 7)
        # Everything computed (all but the last output token) up to its last full block.
        expected = (len(seq) - 1) // 16 * 16
        nxt = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        assert nxt.num_cached_tokens >= expected
    assert_checkpoints_exact(llm, [prompt])


def test_short_prompt_repeated_hits_whole_blocks(tiny_granite):
    rng = random.Random(6)
    prompt = _rand(rng, 40)
    llm = LLM(tiny_granite)
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # 2 blocks of 16; a 528-token page gives 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_identical_prompt_still_computes_its_last_token(tiny_granite):
    prompt = _rand(random.Random(7), 48)  # a multiple of the block size
    llm = LLM(tiny_granite)
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 32  # h <= len - 1, on a block boundary
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_diverging_prompts_hit_the_shared_blocks(tiny_granite):
    rng = random.Random(8)
    shared = _rand(rng, 100)
    a, b, c = (shared + _rand(rng, 20) for _ in range(3))
    # A dense grid: the second prompt already finds a checkpoint at 96.
    llm = LLM(tiny_granite, state_interval=16)
    llm.generate([a], GREEDY)
    assert llm.generate([b], GREEDY)[0].num_cached_tokens == 96
    # The default grid of 64: the second prompt hits 64 and checkpoints the junction
    # (96) while it is prefilled, so the third hits 96.
    llm = LLM(tiny_granite, state_interval=64)
    llm.generate([a], GREEDY)
    assert llm.generate([b], GREEDY)[0].num_cached_tokens == 64
    third = llm.generate([c], GREEDY)[0]
    assert third.num_cached_tokens == 96
    ref = LLM(tiny_granite, enable_prefix_caching=False).generate([c], GREEDY)[0]
    assert third.outputs[0].token_ids == ref.outputs[0].token_ids


def test_one_prefill_forward_writes_every_grid_checkpoint(tiny_granite):
    prompt = _rand(random.Random(9), 150)
    llm = LLM(tiny_granite, state_interval=32, checkpoint_policies=("grid",))
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert llm.stats()["steps"] == 1  # the whole prompt in one forward
    lengths = sorted(c.length for c in llm.engine.scheduler.states.checkpoints.values())
    assert lengths == [32, 64, 96, 128]
    assert assert_checkpoints_exact(llm, [prompt]) == 4


def test_all_pages_return_after_clear(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    llm.generate(_workload(3), GREEDY)
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert sched.states.checkpoints  # checkpoints hold pages until cleared
    llm.reset_prefix_cache()
    sched.check_integrity()
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.states.num_free == sched.states.num_pages
    assert all(b.ref_count == 0 for b in sched.blocks.blocks)


def test_integrity_check_can_fail(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    llm.generate(_workload(4)[:3], GREEDY)
    sched = llm.engine.scheduler
    sched.check_integrity()
    page = next(iter(sched.states.checkpoints.values())).page
    sched.states.ref_count[page] += 1
    with pytest.raises(AssertionError, match="state page"):
        sched.check_integrity()
    sched.states.ref_count[page] -= 1
    sched.blocks.blocks[0].ref_count = -1
    with pytest.raises(AssertionError, match="KV block 0"):
        sched.check_integrity()


def test_prefix_caching_off_and_bad_interval(tiny_granite):
    prompt = _rand(random.Random(10), 40)
    llm = LLM(tiny_granite, enable_prefix_caching=False)
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.stats()["checkpoint_pages"] == 0
    with pytest.raises(ValueError, match="multiple of kv_block_size"):
        LLM(tiny_granite, state_interval=24)


def test_flop_aware_eviction_keeps_long_prefixes(tiny_granite):
    """A long shared prefix revisited between bursts of short one-off prompts: LRU lets
    the bursts push it out; FLOP-aware eviction keeps it and hits more tokens."""
    rng = random.Random(11)
    long_prefix = _rand(rng, 160)
    trace = []
    for _ in range(4):
        trace.append([long_prefix + _rand(rng, 5)])
        trace += [[_rand(rng, 20) + _rand(rng, 3)] for _ in range(3)]
    hits = {}
    outs = {}
    for policy in ("lru", "flop_aware"):
        llm = LLM(
            tiny_granite, eviction_policy=policy, max_checkpoint_pages=2,
            checkpoint_policies=("prompt_end",), max_num_seqs=1,
        )
        llm.engine.check_integrity_every_step = True
        outs[policy] = [_tokens(llm.generate(wave, GREEDY)) for wave in trace]
        hits[policy] = llm.stats()["prefix_hit_tokens"]
    assert outs["lru"] == outs["flop_aware"]
    assert hits["flop_aware"] > hits["lru"]
    with pytest.raises(ValueError, match="eviction_policy"):
        LLM(tiny_granite, eviction_policy="random")


def test_prompts_arriving_together_share_the_prefill(tiny_granite):
    """In-flight junctions: a prompt sharing a prefix with one being prefilled waits
    for the checkpoint at their junction instead of computing the prefix again."""
    rng = random.Random(12)
    shared = _rand(rng, 100)
    prompts = [shared + _rand(rng, 20) for _ in range(4)]
    llm = LLM(tiny_granite)  # default grid of 64: only the junction gives 96
    llm.engine.check_integrity_every_step = True
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 96, 96, 96]
    ref = LLM(tiny_granite, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert _tokens(outs) == _tokens(ref)
    # Without the junction policy the batch runs side by side and nothing hits.
    llm = LLM(tiny_granite, checkpoint_policies=("grid", "prompt_end", "finished"))
    assert [o.num_cached_tokens for o in llm.generate(prompts, GREEDY)] == [0, 0, 0, 0]


def test_a_prefix_hit_protects_its_checkpoint_from_the_next_eviction(tiny_granite):
    """Two checkpoints fill the budget; a hit on the older one makes the other the
    least recently used, so the next admission evicts that one (LRU)."""
    rng = random.Random(13)
    first, second, third = (_rand(rng, 40) for _ in range(3))
    llm = LLM(tiny_granite, max_checkpoint_pages=2, checkpoint_policies=("prompt_end",),
              max_num_seqs=1)
    llm.engine.check_integrity_every_step = True
    one = SamplingParams(max_tokens=1, temperature=0.0)
    # Each 40-token prompt leaves one checkpoint, at 32.
    assert [llm.generate([p], one)[0].num_cached_tokens for p in (first, second)] == [0, 0]
    assert llm.generate([first], one)[0].num_cached_tokens == 32  # the hit
    assert llm.generate([third], one)[0].num_cached_tokens == 0  # evicts one checkpoint
    assert llm.stats()["checkpoints_evicted"] == 1
    assert llm.generate([first], one)[0].num_cached_tokens == 32
    assert llm.generate([second], one)[0].num_cached_tokens == 0
