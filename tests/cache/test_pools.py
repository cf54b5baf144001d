"""Allocator-level tests of the KV block pool and the state page cache."""

from __future__ import annotations

import pytest

from hybridserve.cache.block_pool import BlockPool, block_hashes, chain_hash, extend_hashes
from hybridserve.cache.state_cache import StateCache


def test_block_pool_keeps_hashes_until_reuse_and_evicts_oldest_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    evicted = []
    pool.on_evict.append(evicted.append)
    toks = [1, 2, 3, 4]
    hashes = block_hashes(toks, 2)
    blocks = pool.allocate(2)
    for b, h, i in zip(blocks, hashes, (0, 2)):
        pool.register(b, h, toks[i : i + 2])
    pool.release(blocks)
    assert pool.num_free == 4
    # Freed blocks stay hittable, with token confirmation.
    assert pool.lookup(hashes[0], [1, 2]) == blocks[0]
    assert pool.lookup(hashes[0], [9, 9]) is None
    assert pool.num_free_of(blocks) == 2
    pool.acquire([blocks[0]])
    assert pool.num_free == 3
    assert pool.num_free_of(blocks) == 1 and pool.num_free_of([]) == 0
    pool.release([blocks[0]])
    # Unhashed blocks are reused first; then hashed ones, oldest release first.
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(blocks) and evicted == []
    pool.allocate(1)
    assert len(evicted) == 1
    pool.check_integrity()
    with pytest.raises(MemoryError):
        pool.allocate(2)


def test_block_pool_refuses_double_release():
    pool = BlockPool(num_blocks=2, block_size=2)
    b = pool.allocate(1)
    pool.release(b)
    with pytest.raises(AssertionError, match="ref_count"):
        pool.release(b)


def test_chained_hash_depends_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4], 2)
    b = block_hashes([9, 2, 3, 4], 2)
    assert a[1] != b[1]  # same second block, different parent
    assert block_hashes([1, 2, 3, 4], 2, extra_key="lora-1")[0] != a[0]
    assert block_hashes([1, 2, 3], 2) == a[:1]  # partial blocks are not hashed


def test_extended_hashes_are_the_chained_hashes():
    """extend_hashes (the scheduler's, inline) computes chain_hash's chain, from scratch
    or from a prefix already hashed, and leaves a partial block unhashed."""
    toks = list(range(100, 137))
    chain, parent = [], None
    for start in range(0, 36, 4):
        parent = chain_hash(parent, toks[start : start + 4])
        chain.append(parent)
    assert chain == block_hashes(toks, 4)
    whole: list[int] = []
    extend_hashes(whole, toks, 4, 9)
    assert whole == chain
    part = chain[:3]
    extend_hashes(part, toks, 4, 5)
    assert part == chain[:5]


def test_state_cache_checkpoint_lifecycle():
    sc = StateCache(num_pages=4, checkpoint_budget=2)
    (p,) = sc.allocate(1)
    assert sc.admit(key=10, length=32, page=p, prefix_hashes=[5, 10])
    assert not sc.admit(key=10, length=32, page=p, prefix_hashes=[5, 10])  # once per prefix
    sc.release([p])  # the writer's reference; the index keeps the page alive
    assert sc.ref_count[p] == 1 and sc.lookup(10).page == p
    sc.check_integrity()
    # A KV block of its prefix is evicted: the checkpoint can never hit again.
    sc.on_block_evicted(5)
    assert sc.lookup(10) is None and sc.num_dropped == 1
    assert sc.num_free == 4
    sc.check_integrity()


def test_state_cache_evicts_checkpoints_for_live_pages():
    sc = StateCache(num_pages=3, checkpoint_budget=3)
    pages = sc.allocate(3)
    for i, page in enumerate(pages):
        sc.admit(key=i, length=16 * (i + 1), page=page, prefix_hashes=[i])
        sc.release([page])
    assert sc.num_free == 0 and sc.can_allocate(2)
    got = sc.allocate(2)
    assert len(got) == 2 and sc.num_evicted == 2
    assert list(sc.checkpoints) == [2]  # the most recently used survives
    sc.check_integrity(holders=got)
    with pytest.raises(MemoryError):
        sc.allocate(2)
    # A page shared by a request and the index is not reclaimable.
    sc.incref(sc.checkpoints[2].page)
    assert not sc.can_allocate(1)


def test_flop_aware_eviction_prefers_cheap_prefixes():
    sc = StateCache(num_pages=8, checkpoint_budget=2, eviction_policy="flop_aware",
                    flops_saved=lambda n: float(n * n))
    for key, length in ((1, 256), (2, 16), (3, 16)):
        (page,) = sc.allocate(1)
        sc.admit(key=key, length=length, page=page, prefix_hashes=[key])
        sc.release([page])
    # LRU would have evicted the 256-token prefix (the oldest).
    assert sorted(c.length for c in sc.checkpoints.values()) == [16, 256]
    with pytest.raises(ValueError, match="eviction_policy"):
        StateCache(4, 1, eviction_policy="mru")


# --- which checkpoint goes first -------------------------------------------------------


def _cache_with(lengths, policy="lru", alpha=1.0, pages=None, budget=None):
    """A StateCache holding one checkpoint per length, admitted in order (key i + 1 for
    ``lengths[i]``, the first the least recently used), every page held by the index
    alone; ``flops_saved`` is the length itself."""
    sc = StateCache(num_pages=pages or len(lengths), checkpoint_budget=budget or len(lengths),
                    eviction_policy=policy, flops_saved=float, alpha=alpha)
    for key, length in enumerate(lengths, start=1):
        (page,) = sc.allocate(1)
        assert sc.admit(key=key, length=length, page=page, prefix_hashes=[100 + key])
        sc.release([page])
    return sc


def _evict_one(sc: StateCache) -> int:
    """Make room for one live page; returns the key of the checkpoint that went."""
    before = set(sc.checkpoints)
    sc.allocate(1)
    (gone,) = before - set(sc.checkpoints)
    return gone


def test_lru_evicts_the_least_recently_used_first():
    sc = _cache_with([64, 16, 32])
    assert [_evict_one(sc) for _ in range(3)] == [1, 2, 3]
    assert sc.num_evicted == 3


def test_flop_aware_scores_recency_plus_flops_saved():
    # Candidates in LRU order 1 (64 tokens), 2 (16), 3 (32); alpha 1, max flops 64:
    # scores 0 + 64/64 = 1.0, 0.5 + 16/64 = 0.75, 1 + 32/64 = 1.5 -> key 2 goes.
    # Then 1 and 3: 0 + 1.0 = 1.0, 1 + 0.5 = 1.5 -> key 1 (LRU would take 1, then 2).
    sc = _cache_with([64, 16, 32], policy="flop_aware")
    assert _evict_one(sc) == 2
    assert _evict_one(sc) == 1
    # alpha weighs FLOPs against recency: with alpha 4 the long prefix outlives both
    # (scores 4, 1.5, 3 -> key 2; then 4, 1 + 2 = 3 -> key 3).
    sc = _cache_with([64, 16, 32], policy="flop_aware", alpha=4.0)
    assert _evict_one(sc) == 2
    assert _evict_one(sc) == 3


@pytest.mark.parametrize("policy", ["lru", "flop_aware"])
@pytest.mark.parametrize("pressure", ["live_pages", "budget"])
def test_a_checkpoint_someone_else_holds_is_never_evicted(policy, pressure):
    # Key 1 is the first to go under both policies (the oldest and the cheapest) ...
    sc = _cache_with([16, 64, 64], policy=policy, pages=4 if pressure == "budget" else 3)
    held = sc.checkpoints[1].page
    sc.incref(held)  # ... but a request reads it as its state
    if pressure == "live_pages":
        assert _evict_one(sc) == 2
    else:
        (page,) = sc.allocate(1)  # the fourth page was free: nothing evicted for it
        assert sc.num_evicted == 0
        assert sc.admit(key=9, length=80, page=page, prefix_hashes=[109])  # over budget
        assert set(sc.checkpoints) == {1, 3, 9}
    assert 1 in sc.checkpoints and sc.checkpoints[1].page == held
    assert sc.ref_count[held] == 2


@pytest.mark.parametrize("policy", ["lru", "flop_aware"])
def test_a_lookup_protects_its_checkpoint_from_the_next_eviction(policy):
    sc = _cache_with([32, 32, 32], policy=policy)
    assert sc.lookup(1).length == 32  # a prefix hit on the least recently used
    assert _evict_one(sc) == 2
    assert sc.lookup(404) is None
    assert sc.has(1) and not sc.has(2)
    assert _evict_one(sc) == 3


def test_touching_a_path_is_a_lookup_of_each_of_its_checkpoints_in_order():
    """StateCache.touch (a prefix hit's walk): the LRU order, clock, last-used stamps and
    events of one lookup per key, in the keys' order."""
    caches, events = [], []
    for _ in range(2):
        sc = _cache_with([16, 32, 48, 64])
        sink = []
        sc.event_sink = sink.append
        caches.append(sc)
        events.append(sink)
    for key in (3, 1, 4):
        caches[0].lookup(key)
    caches[1].touch([3, 1, 4])
    a, b = caches
    assert list(a.checkpoints) == list(b.checkpoints) == [2, 3, 1, 4]
    assert a.clock == b.clock
    assert [c.last_used for c in a.checkpoints.values()] == [
        c.last_used for c in b.checkpoints.values()]
    assert events[0] == events[1] and len(events[0]) == 3
    assert _evict_one(a) == _evict_one(b) == 2


@pytest.mark.parametrize("budget", [8, 3, 1])
def test_admitting_a_batch_is_admitting_each_in_order(budget):
    """StateCache.admit_all: the checkpoints, pages, clock, events and dependency map of
    one admit() per entry, for prefixes along one path (a prefill row's), off it, a key
    already held, and (small budgets) entries evicted by later ones of the batch."""
    path = [11, 12, 13, 14, 15, 16]
    batches = [
        [(1, 32, None, path[:2])],
        [(2, 64, None, path[:4]), (3, 96, None, path[:6]), (4, 80, None, path[:5])],
        [(3, 96, None, path[:6]), (5, 48, None, [11, 12, 99]), (6, 16, None, [77])],
    ]
    caches = []
    for batched in (False, True):
        sc = StateCache(num_pages=16, checkpoint_budget=budget)
        events, results = [], []
        sc.event_sink = events.append
        for batch in batches:
            entries = [(k, n, sc.allocate(1)[0], hashes) for k, n, _, hashes in batch]
            if batched:
                results += sc.admit_all(entries)
            else:
                results += [sc.admit(*entry) for entry in entries]
            sc.release([page for _, _, page, _ in entries])
        caches.append((sc, events, results))
    (a, ev_a, res_a), (b, ev_b, res_b) = caches
    assert res_a == res_b and ev_a == ev_b
    assert list(a.checkpoints.items()) == list(b.checkpoints.items())
    assert a._dependents.covering() == b._dependents.covering()
    assert a.ref_count == b.ref_count and a.free == b.free and a.clock == b.clock
    assert (a.num_admitted, a.num_evicted) == (b.num_admitted, b.num_evicted)
    b.check_integrity()
    b.on_block_evicted(13)  # every checkpoint whose prefix has block 13 goes
    assert all(13 not in c.prefix_hashes for c in b.checkpoints.values())
    b.check_integrity()


def test_block_pool_integrity_rejects_writes_to_shared_or_indexed_blocks():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2)
    pool.register(a, block_hashes([5, 6], 2)[0], [5, 6])
    pool.check_integrity(writes=[b])
    with pytest.raises(AssertionError, match=f"KV block {a} is written"):
        pool.check_integrity(writes=[a])  # registered: prefix hits read it
    pool.acquire([b])
    with pytest.raises(AssertionError, match=f"KV block {b} is written"):
        pool.check_integrity(writes=[b])  # another request holds it too
