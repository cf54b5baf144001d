"""The checkpoint dependency map (hybridserve.cache.dependents) against the plain map it
stands for: every checkpoint under every block of its prefix."""

import random

import pytest

from hybridserve.cache.block_pool import block_hashes
from hybridserve.cache.dependents import PrefixDependents


def _brute(live: dict[int, tuple[int, ...]], h: int) -> set[int]:
    return {key for key, prefix in live.items() if h in prefix}


def _assert_matches(deps: PrefixDependents, live: dict[int, tuple[int, ...]]) -> None:
    deps.check(live)
    every = {h for prefix in live.values() for h in prefix}
    for h in every:
        got = deps.dependents(h)
        assert len(got) == len(set(got))
        assert set(got) == _brute(live, h), h
        depth = [len(live[k]) for k in got]
        assert depth == sorted(depth, reverse=True)  # deepest first
    assert deps.covering() == {h: _brute(live, h) for h in every}


@pytest.mark.parametrize("seed", range(12))
def test_random_admissions_removals_and_block_evictions_match_the_plain_map(seed):
    """Chained hashes of random prompts that share prefixes and branch (as agents'
    conversations do), checkpoints admitted in any order (deep before shallow too), at
    the grid, a junction or a prompt's end, removed one by one (LRU, drops) or all that
    need an evicted block; after every change the answers are the plain map's."""
    rng = random.Random(seed)
    bs = 4
    trunks = [[rng.randrange(50) for _ in range(bs * rng.randrange(2, 12))] for _ in range(3)]
    prompts = []
    for _ in range(8):
        base = rng.choice(trunks + prompts) if prompts else rng.choice(trunks)
        cut = bs * rng.randrange(0, len(base) // bs + 1)
        prompts.append(base[:cut] + [rng.randrange(50) for _ in range(bs * rng.randrange(1, 8))])
    chains = [block_hashes(p, bs) for p in prompts]
    deps, live = PrefixDependents(), {}
    for _ in range(300):
        op = rng.random()
        if op < 0.55:
            chain = rng.choice(chains)
            n = rng.randrange(1, len(chain) + 1)
            key = chain[n - 1]
            if key in live:
                continue
            deps.add(key, chain[:n])
            live[key] = tuple(chain[:n])
        elif op < 0.85 and live:
            key = rng.choice(sorted(live))
            deps.remove(key)
            del live[key]
        elif live:
            h = rng.choice(sorted({h for p in live.values() for h in p}))
            for key in deps.dependents(h):
                deps.remove(key)
                del live[key]
            assert not _brute(live, h)
        _assert_matches(deps, live)


def test_keys_that_share_a_prefix_and_colliding_last_hashes_stay_exact():
    """Two keys on one prefix (one node), a prefix whose last hash names a node of a
    different prefix (kept flat), and a checkpoint of no blocks."""
    deps = PrefixDependents()
    live = {10: (1, 2, 3), 11: (1, 2, 3), 12: (9, 8, 3), 13: (1, 2), 14: (1, 2, 3, 4), 15: ()}
    for key, prefix in live.items():
        deps.add(key, prefix)
    _assert_matches(deps, live)
    with pytest.raises(ValueError, match="already"):
        deps.add(12, (5,))
    for key in (10, 13, 12, 15):
        deps.remove(key)
        del live[key]
        _assert_matches(deps, live)
    deps.add(12, (9, 8, 3))  # now its own node's prefix is gone: still exact
    live[12] = (9, 8, 3)
    _assert_matches(deps, live)
    assert deps.dependents(2) == [14, 11]
    with pytest.raises(KeyError):
        deps.remove(404)


def test_an_admission_between_a_node_and_its_children_takes_them_over():
    """A shallower checkpoint admitted after deeper ones on two branches becomes their
    parent; removing it gives them back its blocks."""
    deps = PrefixDependents()
    a, b = (1, 2, 3, 4, 5), (1, 2, 3, 7, 8)
    deps.add(5, a)
    deps.add(8, b)
    deps.add(3, a[:3])
    assert deps._parent[5] == deps._parent[8] == 3
    assert deps._segment[1] == {3}
    deps.check({5: a, 8: b, 3: a[:3]})
    deps.remove(3)
    assert deps._segment[1] == {5, 8}
    deps.check({5: a, 8: b})


def test_a_planted_fault_fails_the_check():
    deps = PrefixDependents()
    deps.add(3, (1, 2, 3))
    deps.add(5, (1, 2, 3, 4, 5))
    deps._segment[4].discard(5)  # a KV eviction of block 4 would miss checkpoint 5
    with pytest.raises(AssertionError, match="dependency map"):
        deps.check({3: (1, 2, 3), 5: (1, 2, 3, 4, 5)})
    with pytest.raises(AssertionError, match="stale"):
        PrefixDependents().check({3: (1, 2, 3)})
