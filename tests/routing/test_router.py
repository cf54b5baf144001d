"""The router on synthetic event streams, and its mirror of a real scheduler's index."""

import pytest

from hybridserve.cache.block_pool import block_hashes
from hybridserve.cache.events import CacheEvent
from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.routing.router import Router
from hybridserve.routing.sim import SimReplica, StepCost

BS = 4


def stored(tokens, upto_blocks):
    return [CacheEvent("block_stored", h) for h in block_hashes(tokens, BS)[:upto_blocks]]


def ckpt(tokens, blocks, kind="checkpoint_admitted", clock=1):
    h = block_hashes(tokens, BS)[blocks - 1]
    return CacheEvent(kind, h, blocks * BS, clock, clock)


PROMPT = list(range(100, 133))  # 33 tokens: 8 full blocks usable (len - 1 = 32)


def test_checkpoint_depth_beats_deeper_kv_without_checkpoint():
    r = Router(2, BS)
    # Replica 0: all 8 blocks cached, a checkpoint only at 2 blocks.
    r.apply_events(0, stored(PROMPT, 8) + [ckpt(PROMPT, 2)])
    # Replica 1: 5 blocks cached, a checkpoint at 5 blocks.
    r.apply_events(1, stored(PROMPT, 5) + [ckpt(PROMPT, 5)])
    assert r.depths(PROMPT) == [8, 20]
    d = r.route(PROMPT)
    assert (d.replica, d.depth, d.reason) == (1, 20, "hit")
    # Token-prefix routing prefers the deeper KV run.
    p = Router(2, BS, policy="prefix")
    p.apply_events(0, stored(PROMPT, 8) + [ckpt(PROMPT, 2)])
    p.apply_events(1, stored(PROMPT, 5) + [ckpt(PROMPT, 5)])
    assert p.route(PROMPT).replica == 0


def test_checkpoint_needs_every_kv_block_of_its_prefix():
    r = Router(2, BS)
    r.apply_events(0, stored(PROMPT, 6) + [ckpt(PROMPT, 6)])
    r.apply_events(1, stored(PROMPT, 3) + [ckpt(PROMPT, 3)])
    assert r.route(PROMPT).replica == 0
    # Block 2 of replica 0 leaves its index: the checkpoint at 6 blocks is unreachable.
    r.apply_events(0, [CacheEvent("block_removed", block_hashes(PROMPT, BS)[1])])
    assert r.depths(PROMPT) == [0, 12]
    assert r.route(PROMPT).replica == 1


@pytest.mark.parametrize("kind", ["checkpoint_evicted", "checkpoint_dropped"])
def test_removed_checkpoint_is_forgotten(kind):
    r = Router(2, BS)
    r.apply_events(0, stored(PROMPT, 8) + [ckpt(PROMPT, 4), ckpt(PROMPT, 8)])
    assert r.depths(PROMPT)[0] == 32
    r.apply_events(0, [ckpt(PROMPT, 8, kind)])
    assert r.depths(PROMPT)[0] == 16


def test_host_tier_checkpoint_counts_until_removed():
    r = Router(2, BS)
    h = block_hashes(PROMPT, BS)[5]
    r.apply_events(0, stored(PROMPT, 8) + [ckpt(PROMPT, 2), CacheEvent("host_checkpoint_stored", h, 24),
                                           ckpt(PROMPT, 6, "checkpoint_evicted")])
    r.apply_events(1, stored(PROMPT, 8) + [ckpt(PROMPT, 4)])
    assert r.depths(PROMPT) == [24, 16]
    r.apply_events(0, [CacheEvent("host_checkpoint_removed", h, 24)])
    assert r.depths(PROMPT) == [8, 16]


def test_last_prompt_token_is_never_counted():
    r = Router(1, BS)
    prompt = list(range(8))  # 2 full blocks, but only 7 tokens may come from the cache
    r.apply_events(0, stored(prompt, 2) + [ckpt(prompt, 1), ckpt(prompt, 2)])
    assert r.depths(prompt) == [4]


def test_lru_age_from_clock():
    r = Router(1, BS)
    r.apply_events(0, stored(PROMPT, 2) + [ckpt(PROMPT, 2, clock=3)])
    r.apply_events(0, [CacheEvent("checkpoint_used", 0, 8, 9, 9)])  # another checkpoint
    hashes = r.request_hashes(PROMPT)
    assert r.replicas[0].reusable_depth(hashes, BS) == (8, 6)


def test_queue_bound_sends_elsewhere():
    r = Router(3, BS, max_queue=1)
    r.apply_events(0, stored(PROMPT, 8) + [ckpt(PROMPT, 8)])
    r.apply_events(1, stored(PROMPT, 2) + [ckpt(PROMPT, 2)])
    assert r.route(PROMPT).replica == 0
    assert r.route(PROMPT).replica == 0  # queue 1 <= bound
    d = r.route(PROMPT)  # replica 0 now has 2 > 1 in its queue: next deepest
    assert (d.replica, d.reason) == (1, "over_bound")
    r.route(PROMPT)
    d = r.route(PROMPT)  # 0 and 1 over the bound; 2 has no hit: least loaded
    assert (d.replica, d.reason) == (2, "over_bound")
    for _ in range(2):
        r.finished(0)
    assert r.route(PROMPT).replica == 0


def test_no_hit_goes_to_least_loaded_and_baselines():
    r = Router(3, BS)
    r.set_load(0, 5)
    r.set_load(1, 2)
    r.set_load(2, 3)
    assert r.route(PROMPT).replica == 1
    rr = Router(3, BS, policy="round_robin")
    assert [rr.route(PROMPT).replica for _ in range(4)] == [0, 1, 2, 0]
    rnd = Router(3, BS, policy="random", seed=1)
    picks = {rnd.route(PROMPT).replica for _ in range(30)}
    assert picks == {0, 1, 2}


def test_bad_arguments_name_the_knob():
    with pytest.raises(ValueError, match="policy"):
        Router(2, BS, policy="prefix_tree")
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, BS)
    with pytest.raises(ValueError, match="kind"):
        CacheEvent("block_moved", 1)


@pytest.mark.parametrize("host_pages", [0, 6])
def test_events_mirror_a_real_scheduler(host_pages):
    """Replaying a real scheduler's events rebuilds its index (both checkpoint tiers);
    the router's depth for a new prompt equals what the scheduler's own lookup finds."""
    cache = CacheConfig(kv_block_size=BS, num_kv_blocks=40, num_state_pages=24, state_interval=8)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=160)
    rep = SimReplica(cache, sched, StepCost(), num_host_pages=host_pages)
    router = Router(1, BS)
    base = list(range(50, 80))
    waves = [[base + [i] * (5 + i) for i in range(8)], [list(range(200, 260))], [base + [4] * 9]]
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            rep.add(f"w{w}r{i}", p, [7 + i] * (3 + i % 4))
        while rep.has_work():
            rep.step()
            rep.scheduler.check_integrity()
            router.apply_events(0, rep.events.drain())
    s = rep.scheduler
    assert s.blocks.num_evicted > 0 and s.states.num_evicted + s.states.num_dropped > 0
    view = router.replicas[0]
    assert view.blocks == set(s.blocks.hash_to_block)
    assert set(view.checkpoints) == set(s.states.checkpoints)
    assert set(view.host_checkpoints) == set(s.host.checkpoints)
    assert bool(s.host.checkpoints) == (host_pages > 0)
    seen, from_host = [], []
    for probe in [base + [4] * 12, base + [3] * 8 + [1, 2], list(range(200, 250)), base[:9]]:
        hashes = block_hashes(probe, BS, limit=len(probe) - 1)
        expected, _, _, _, host_key = s._probe(probe, hashes)
        if host_key is not None:
            from_host.append(s.host.checkpoints[host_key].length > expected)
            expected = max(expected, s.host.checkpoints[host_key].length)
        assert router.depths(probe) == [expected]
        seen.append(expected)
    assert max(seen) > 0
    # Without the host tier one probe's checkpoints are gone; with it, one is on the host.
    assert (0 in seen) if host_pages == 0 else any(from_host)


def test_block_hashes_are_the_same_in_every_process():
    """Routers run in other processes: the chained hash must not depend on the process
    (hash(None) and str hashes do)."""
    import os
    import subprocess
    import sys

    code = "from hybridserve.cache.block_pool import block_hashes; print(block_hashes(list(range(40)), 4))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    outs.add(str(block_hashes(list(range(40)), 4)) + "\n")
    assert len(outs) == 1
