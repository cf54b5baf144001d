"""Recurrent-state pages and the checkpoint index.

Ownership and invariants
------------------------
- A *state page* holds, for every Mamba layer, a conv window and an SSM state (the
  tensors live in the runner; this class only hands out page ids). All layers use
  the same page id for one logical state.
- ``ref_count[page]`` counts the holders of a page: a request whose current state it
  is, a request's kept block-boundary state, a step that is writing it, and the
  checkpoint index. A page with no holder is on the free list. Pages are never
  written after their step has written them (docs/state-lifecycle.md), so sharing a page
  between a request and the index is safe and costs no copy.
- A *checkpoint* is a page owned by the index under the chained block hash of the
  prefix it summarizes (the hash of the last full KV block of that prefix). It
  records the hashes of every block of its prefix: when any of those KV blocks is
  evicted the checkpoint can never be hit again and is dropped (the dependency map,
  :mod:`hybridserve.cache.dependents`, names them).
- Checkpoints hold at most ``budget`` pages; beyond that, and whenever live requests
  need pages, a checkpoint is evicted (and handed to ``on_evict`` first, which the host
  tier uses to keep it: :mod:`hybridserve.cache.host_tier`; a checkpoint dropped because
  its KV prefix is gone is not handed over). ``lru``: the least recently used.
  ``flop_aware`` (after Marconi, MLSys 2025): the lowest score
  ``recency + alpha * flops_saved / max_flops_saved``, where recency runs from 0 (least
  recent) to 1 (most recent) and ``flops_saved(length)`` is the prefill work a hit on
  the checkpoint saves. Every checkpoint holds one page, so FLOPs saved per byte is
  proportional to FLOPs saved; long prefixes, whose attention cost grows
  quadratically, outlive short ones that were touched a little more recently.
- Every admission, lookup hit and removal is published to ``event_sink`` when one is
  set (:mod:`hybridserve.cache.events`), so a router can mirror the index.

Only the scheduler calls into this class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridserve.cache.dependents import PrefixDependents
from hybridserve.cache.events import CacheEvent, EventSink


def eviction_victim(keys: Sequence[int], lengths: Sequence[int], policy: str,
                    flops_saved: Callable[[int], float], alpha: float) -> int:
    """The checkpoint to evict among ``keys`` (least recently used first, ``lengths``
    their prefix lengths) by the module's rule: ``lru`` the first; ``flop_aware`` the
    lowest ``recency + alpha * flops_saved / max_flops_saved``. The device index and the
    host tier evict by this one rule."""
    if policy == "lru" or len(keys) == 1:
        return keys[0]
    flops = [flops_saved(n) for n in lengths]
    top = max(flops) or 1.0
    last = len(keys) - 1
    scores = [i / last + alpha * f / top for i, f in enumerate(flops)]
    return keys[scores.index(min(scores))]


@dataclass(slots=True)
class Checkpoint:
    page: int
    length: int  # prefix length in tokens; a multiple of kv_block_size
    prefix_hashes: tuple[int, ...]
    last_used: int = 0  # the index's LRU clock at admission or the last lookup


class StateCache:
    """The state page pool plus the checkpoint index (see module docstring)."""

    def __init__(
        self,
        num_pages: int,
        checkpoint_budget: int,
        eviction_policy: str = "lru",
        flops_saved: Callable[[int], float] | None = None,
        alpha: float = 2.0,
    ) -> None:
        if eviction_policy not in ("lru", "flop_aware"):
            raise ValueError(f"eviction_policy={eviction_policy!r}; use 'lru' or 'flop_aware'")
        self.num_pages = num_pages
        self.checkpoint_budget = checkpoint_budget
        self.eviction_policy = eviction_policy
        self.flops_saved = flops_saved or (lambda length: float(length))
        self.alpha = alpha
        self.ref_count = [0] * num_pages
        # Stack of free pages; recently freed pages are reused first.
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        # key (block hash at the checkpoint's length) -> Checkpoint, in LRU order.
        self.checkpoints: OrderedDict[int, Checkpoint] = OrderedDict()
        # Which checkpoints each KV block's eviction invalidates.
        self._dependents = PrefixDependents()
        # Called with (key, checkpoint) just before an eviction releases the page.
        self.on_evict: Callable[[int, Checkpoint], None] | None = None
        self.num_admitted = 0
        self.num_evicted = 0
        self.num_dropped = 0
        # Ticks on every admission and lookup; published so routers can tell LRU age.
        self.clock = 0
        # Publishes checkpoint events (hybridserve.cache.events); None: off.
        self.event_sink: EventSink | None = None

    # ---- pages -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    def num_reclaimable(self) -> int:
        """Pages that evicting every checkpoint would free."""
        return sum(1 for c in self.checkpoints.values() if self.ref_count[c.page] == 1)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self.free) or count <= len(self.free) + self.num_reclaimable()

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` pages (one reference each), evicting checkpoints if needed.

        Raises MemoryError, changing nothing, if even evicting every checkpoint frees
        too few pages.
        """
        if not self.can_allocate(count):
            raise MemoryError(f"need {count} state pages, {len(self.free)} free")
        while len(self.free) < count:
            self._evict_lru()
        out = [self.free.pop() for _ in range(count)]
        for page in out:
            self.ref_count[page] = 1
        return out

    def incref(self, page: int) -> None:
        if self.ref_count[page] <= 0:
            raise AssertionError(f"state page {page} referenced while free")
        self.ref_count[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page (``-1`` entries are ignored)."""
        for page in pages:
            if page < 0:
                continue
            if self.ref_count[page] <= 0:
                raise AssertionError(f"state page {page} released with ref_count {self.ref_count[page]}")
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self.free.append(page)

    # ---- checkpoints -------------------------------------------------------------

    def lookup(self, key: int) -> Checkpoint | None:
        """The checkpoint stored under ``key`` (marking it recently used), or None."""
        ckpt = self.checkpoints.get(key)
        if ckpt is not None:
            self.checkpoints.move_to_end(key)
            self.clock += 1
            ckpt.last_used = self.clock
            self._emit("checkpoint_used", key, ckpt)
        return ckpt

    def touch(self, keys: Sequence[int]) -> None:
        """:meth:`lookup` of each of ``keys`` (all in the index), in their order: a
        prefix hit marks every checkpoint on its path (126 of them on an 8k-token
        prompt's grid), in one pass."""
        checkpoints, sink = self.checkpoints, self.event_sink
        for key in keys:
            checkpoints.move_to_end(key)
            self.clock += 1
            ckpt = checkpoints[key]
            ckpt.last_used = self.clock
            if sink is not None:
                sink(CacheEvent("checkpoint_used", key, ckpt.length, ckpt.last_used, self.clock))

    def _emit(self, kind: str, key: int, ckpt: Checkpoint) -> None:
        if self.event_sink is not None:
            self.event_sink(CacheEvent(kind, key, ckpt.length, ckpt.last_used, self.clock))

    def has(self, key: int) -> bool:
        return key in self.checkpoints

    def admit(self, key: int, length: int, page: int, prefix_hashes: Sequence[int]) -> bool:
        """Store ``page`` as the checkpoint of the prefix hashed ``key``.

        The index takes its own reference on ``page``. Returns False (taking nothing)
        if that prefix already has a checkpoint or the budget is zero.
        """
        return self.admit_all([(key, length, page, prefix_hashes)])[0]

    def admit_all(self, entries: Sequence[tuple[int, int, int, Sequence[int]]]) -> list[bool]:
        """:meth:`admit` of each ``(key, length, page, prefix_hashes)``, in order; their
        results (a prefill row admits several checkpoints along one prompt: a grid
        point, the prompt's end, its last block boundary)."""
        results = []
        for key, length, page, prefix_hashes in entries:
            if self.checkpoint_budget <= 0 or key in self.checkpoints:
                results.append(False)
                continue
            if len(self.checkpoints) >= self.checkpoint_budget:
                self._evict_lru()
            self.incref(page)
            self.clock += 1
            ckpt = Checkpoint(page, length, tuple(prefix_hashes), self.clock)
            self.checkpoints[key] = ckpt
            self._dependents.add(key, ckpt.prefix_hashes)
            self._emit("checkpoint_admitted", key, ckpt)
            self.num_admitted += 1
            results.append(True)
        return results

    def _remove(self, key: int, kind: str = "checkpoint_dropped") -> None:
        ckpt = self.checkpoints.pop(key)
        self._emit(kind, key, ckpt)
        self._dependents.remove(key)
        self.release([ckpt.page])

    def _evict_lru(self) -> None:
        # Candidates: checkpoints whose page nobody else holds (evicting them frees a
        # page); if there are none, any checkpoint.
        ref = self.ref_count
        if self.eviction_policy == "lru":
            # eviction_victim's lru rule (the first candidate) without listing every
            # candidate: an admission into a full index evicts on every admission.
            key = next((k for k, c in self.checkpoints.items() if ref[c.page] == 1), None)
            if key is None:
                key = next(iter(self.checkpoints))
        else:
            keys = [k for k, c in self.checkpoints.items() if ref[c.page] == 1]
            keys = keys or list(self.checkpoints)
            key = eviction_victim(keys, [self.checkpoints[k].length for k in keys],
                                  self.eviction_policy, self.flops_saved, self.alpha)
        if self.on_evict is not None:
            self.on_evict(key, self.checkpoints[key])
        self._remove(key, "checkpoint_evicted")
        self.num_evicted += 1

    def on_block_evicted(self, block_hash: int) -> None:
        """A KV block left the prefix index: drop every checkpoint that needed it."""
        for key in self._dependents.dependents(block_hash):
            self._remove(key)
            self.num_dropped += 1

    def drop(self, key: int) -> None:
        """Forget checkpoint ``key`` (its page's data cannot be trusted)."""
        self._remove(key)
        self.num_dropped += 1

    def clear(self) -> None:
        """Drop every checkpoint."""
        for key in list(self.checkpoints):
            self._remove(key)

    def check_integrity(self, holders: Sequence[int] = ()) -> None:
        """Raise AssertionError unless every page's ref count equals its holders.

        ``holders`` lists every page reference held outside the index (requests'
        state and boundary pages, pages a step is writing), one entry per reference.
        """
        expected = [0] * self.num_pages
        for page in holders:
            if page >= 0:
                expected[page] += 1
        for ckpt in self.checkpoints.values():
            expected[ckpt.page] += 1
        free = set(self.free)
        if len(free) != len(self.free):
            raise AssertionError("a state page is on the free list twice")
        for page in range(self.num_pages):
            if self.ref_count[page] != expected[page]:
                raise AssertionError(
                    f"state page {page}: ref_count {self.ref_count[page]}, holders {expected[page]}"
                )
            if (page in free) != (expected[page] == 0):
                raise AssertionError(f"state page {page}: free-list membership disagrees with holders")
        self._dependents.check({k: c.prefix_hashes for k, c in self.checkpoints.items()})
