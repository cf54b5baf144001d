"""Checkpoint-aware routing on a multi-turn trace, over the engine's real cache logic."""

from hybridserve.config import CacheConfig
from hybridserve.routing.sim import multi_turn_trace, simulate

CACHE = CacheConfig(kv_block_size=16, num_kv_blocks=1500, num_state_pages=512, state_interval=64)


def test_turns_follow_their_checkpoints_and_hit_rate_matches_one_replica():
    trace = multi_turn_trace(60, turns=4, arrival_rate=10.0, num_system_prompts=4, seed=3)
    single = simulate(trace, 1, "checkpoint", CACHE)
    routed = simulate(trace, 2, "checkpoint", CACHE, max_queue=16)
    rand = simulate(trace, 2, "random", CACHE, seed=5)
    # Turn k+1 goes where turn k went, or to a replica offering at least as deep a prefix.
    moved = 0
    for (c, k), r in routed.placement.items():
        if k == 0:
            continue
        prev = routed.placement[(c, k - 1)]
        if r != prev:
            moved += 1
            depths = routed.depths[(c, k)]
            assert depths[r] >= depths[prev], (c, k, depths)
    assert moved <= 0.05 * len(trace) * 3
    assert routed.sticky_fraction() > 0.95
    assert min(routed.per_replica_requests) > 0
    assert routed.hit_rate >= single.hit_rate - 0.05
    assert routed.hit_rate > rand.hit_rate + 0.05
    assert rand.sticky_fraction() < 0.7
