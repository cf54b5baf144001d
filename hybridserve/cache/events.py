"""Cache events: what an engine's prefix index gained or lost, for routers outside it.

The block pool and the state cache each take an optional ``event_sink`` (a callable
taking one :class:`CacheEvent`); with none set they publish nothing and cost nothing.
Events are emitted in the order the index changes, so replaying a replica's stream
from its start rebuilds exactly which block hashes and checkpoints it holds.

Kinds
-----
- ``block_stored`` / ``block_removed``: a full KV block entered / left the prefix
  index under ``block_hash`` (the chained hash of :func:`~hybridserve.cache.block_pool.chain_hash`).
- ``checkpoint_admitted``: the state after the prefix whose last full block hashes to
  ``block_hash`` (``length`` tokens) is now kept.
- ``checkpoint_used``: a lookup touched it (it moved to the recent end of the LRU order).
- ``checkpoint_evicted``: removed for room (budget reached or live requests needed pages).
- ``checkpoint_dropped``: removed because a KV block of its prefix was evicted, or the
  cache was cleared; it can never be hit again.
- ``host_checkpoint_stored`` / ``host_checkpoint_removed`` (``length`` set): the host tier
  (:mod:`hybridserve.cache.host_tier`) took an evicted checkpoint / gave it up (evicted,
  dropped, or restored to the device, which then publishes ``checkpoint_admitted``). A
  host checkpoint is reusable too, at the cost of one copy back.

``last_used`` is the state cache's LRU clock when the checkpoint was last admitted or
touched, and ``clock`` the clock when the event was emitted: ``clock - last_used`` is
the checkpoint's LRU age in index operations (0: just used). Block events carry only
the hash (``length``, ``last_used`` and ``clock`` stay 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

EVENT_KINDS = (
    "block_stored",
    "block_removed",
    "checkpoint_admitted",
    "checkpoint_used",
    "checkpoint_evicted",
    "checkpoint_dropped",
    "host_checkpoint_stored",
    "host_checkpoint_removed",
)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: str
    block_hash: int
    length: int = 0
    last_used: int = 0
    clock: int = 0

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"CacheEvent.kind={self.kind!r}; use one of {EVENT_KINDS}")

    @property
    def age(self) -> int:
        """LRU age of a checkpoint at emission, in index operations."""
        return self.clock - self.last_used


EventSink = Callable[[CacheEvent], None]


class EventLog:
    """An event sink that buffers events until :meth:`drain` (one per engine).

    Attach it to both pools with :meth:`attach`; a publisher (a replica's metrics
    endpoint, a Ray actor method) drains it and ships the batch to the router. The
    engine thread appends while another thread drains, hence the lock.
    """

    def __init__(self) -> None:
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: CacheEvent) -> None:
        with self._lock:
            self._events.append(event)

    def attach(self, blocks, states, host=None) -> EventLog:
        """Make this log the event sink of a BlockPool, a StateCache and, when given, a
        HostCheckpointIndex."""
        blocks.event_sink = self
        states.event_sink = self
        if host is not None:
            host.event_sink = self
        return self

    def drain(self) -> list[CacheEvent]:
        """The events since the last drain, oldest first."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)
