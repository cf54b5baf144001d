"""Choosing a replica for each request from the replicas' published cache events.

What the router knows
---------------------
Each replica publishes :class:`~hybridserve.cache.events.CacheEvent` batches; the
router replays them into a :class:`ReplicaView`: the set of KV block hashes in the
replica's prefix index and its checkpoints (block hash at the checkpoint position ->
length, last use). Events may arrive late; a stale view costs a worse choice, never
a wrong answer (the replica's own scheduler decides what it actually reuses).

What a request can reuse on a replica
-------------------------------------
Hash the request's full KV blocks with the engine's chained hash
(:func:`~hybridserve.cache.block_pool.block_hashes`) over its first ``len - 1``
tokens (the engine always computes the last prompt token). For a hybrid model a
prefix is reusable only up to the deepest block ``i`` whose blocks ``0..i`` are all
cached *and* that has a checkpoint at its end (the recurrent state after it): KV
blocks beyond the deepest checkpoint are dead weight.

Policies (``Router(policy=...)``)
---------------------------------
- ``checkpoint`` (default): among replicas whose queue is at most ``max_queue``, the
  one with the deepest reusable prefix (ties: shorter queue, then lower id). When no
  replica within the bound has a hit, the least loaded replica (ties rotate, so
  that cold requests arriving one at a time spread over the replicas).
- ``prefix``: the same, scoring the deepest run of cached KV blocks and ignoring
  checkpoints (what token-prefix routers do).
- ``round_robin`` and ``random`` (seeded): baselines that ignore caches.
- ``least_loaded``: the shortest queue (ties rotate over the replicas).

The queue of a replica is the number of requests the router sent it that have not
finished (:meth:`Router.finished`), or the count a replica reports
(:meth:`Router.set_load`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hybridserve.cache.block_pool import block_hashes
from hybridserve.cache.events import CacheEvent

POLICIES = ("checkpoint", "prefix", "round_robin", "random", "least_loaded")


@dataclass
class ReplicaView:
    """The router's mirror of one replica's prefix index, rebuilt from its events."""

    blocks: set[int] = field(default_factory=set)
    # block hash at the checkpoint position -> (length in tokens, last_used clock)
    checkpoints: dict[int, tuple[int, int]] = field(default_factory=dict)
    # block hash -> length of checkpoints on the replica's host tier (reusable after a copy)
    host_checkpoints: dict[int, int] = field(default_factory=dict)
    clock: int = 0
    queue: int = 0
    num_events: int = 0

    def apply(self, event: CacheEvent) -> None:
        self.num_events += 1
        kind, h = event.kind, event.block_hash
        if kind == "block_stored":
            self.blocks.add(h)
        elif kind == "block_removed":
            self.blocks.discard(h)
        elif kind == "host_checkpoint_stored":
            self.host_checkpoints[h] = event.length
        elif kind == "host_checkpoint_removed":
            self.host_checkpoints.pop(h, None)
        elif kind in ("checkpoint_admitted", "checkpoint_used"):
            self.checkpoints[h] = (event.length, event.last_used)
        else:  # checkpoint_evicted / checkpoint_dropped
            self.checkpoints.pop(h, None)
        self.clock = max(self.clock, event.clock)

    def kv_depth(self, hashes: Sequence[int], block_size: int) -> int:
        """Tokens of the longest run of cached KV blocks from the start."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n * block_size

    def reusable_depth(self, hashes: Sequence[int], block_size: int) -> tuple[int, int]:
        """(tokens, LRU age) of the deepest prefix with its KV blocks and a checkpoint
        on either tier.

        Age is ``clock - last_used`` of a device checkpoint, ``clock`` for a host one
        (older than any device checkpoint), 0 when there is no hit."""
        best, age = 0, 0
        for i, h in enumerate(hashes):
            if h not in self.blocks:
                break
            ckpt = self.checkpoints.get(h)
            if ckpt is not None:
                best, age = (i + 1) * block_size, self.clock - ckpt[1]
            elif h in self.host_checkpoints:
                best, age = (i + 1) * block_size, self.clock
        return best, age


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    policy: str
    depth: int  # tokens the router expects the replica to reuse (0 for cache-blind policies)
    reason: str  # "hit", "no_hit", "over_bound" (the deepest was too busy), "blind"


class Router:
    """Picks a replica per request (see the module docstring for the policies)."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "checkpoint",
        max_queue: int = 8,
        seed: int = 0,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}; use one of {POLICIES}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.block_size = block_size
        self.policy = policy
        self.max_queue = max_queue
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self._next = 0  # round robin's turn
        self._rotate = 0  # where least-loaded ties start
        self._rng = random.Random(seed)
        self.counters = {"routed": 0, "hit": 0, "no_hit": 0, "over_bound": 0, "blind": 0}

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ---- inputs ------------------------------------------------------------------

    def apply_events(self, replica: int, events: Iterable[CacheEvent]) -> None:
        view = self.replicas[replica]
        for event in events:
            view.apply(event)

    def set_load(self, replica: int, queue: int) -> None:
        self.replicas[replica].queue = queue

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` finished (or failed)."""
        view = self.replicas[replica]
        view.queue = max(0, view.queue - 1)

    def reset_replica(self, replica: int) -> None:
        """Forget what ``replica`` held (it restarted with empty caches)."""
        queue = self.replicas[replica].queue
        self.replicas[replica] = ReplicaView(queue=queue)

    # ---- the decision ------------------------------------------------------------

    def request_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks the engine may take from its cache."""
        return block_hashes(token_ids, self.block_size, limit=len(token_ids) - 1)

    def depths(self, token_ids: Sequence[int]) -> list[int]:
        """Per replica, the tokens this router's policy would count as reusable."""
        hashes = self.request_hashes(token_ids)
        if self.policy == "prefix":
            return [v.kv_depth(hashes, self.block_size) for v in self.replicas]
        return [v.reusable_depth(hashes, self.block_size)[0] for v in self.replicas]

    def choose(self, token_ids: Sequence[int]) -> RouteDecision:
        """The replica for a request with these token ids; does not count it as sent."""
        n = self.num_replicas
        if self.policy == "round_robin":
            r = self._next % n
            self._next += 1
            return RouteDecision(r, self.policy, 0, "blind")
        if self.policy == "random":
            return RouteDecision(self._rng.randrange(n), self.policy, 0, "blind")
        if self.policy == "least_loaded":
            return RouteDecision(self._least_loaded(), self.policy, 0, "blind")
        depths = self.depths(token_ids)
        within = [r for r in range(n) if self.replicas[r].queue <= self.max_queue]
        best = max(within, key=lambda r: (depths[r], -self.replicas[r].queue, -r), default=None)
        if best is not None and depths[best] > 0:
            deepest = max(depths)
            reason = "hit" if depths[best] == deepest else "over_bound"
            return RouteDecision(best, self.policy, depths[best], reason)
        reason = "over_bound" if max(depths) > 0 else "no_hit"
        least = self._least_loaded()
        return RouteDecision(least, self.policy, depths[least], reason)

    def _least_loaded(self) -> int:
        # Ties rotate, so that cold requests arriving one at a time spread out.
        n = self.num_replicas
        order = [(self._rotate + i) % n for i in range(n)]
        best = min(order, key=lambda r: self.replicas[r].queue)
        self._rotate = best + 1
        return best

    def route(self, token_ids: Sequence[int]) -> RouteDecision:
        """:meth:`choose`, then count the request in that replica's queue."""
        decision = self.choose(token_ids)
        self.replicas[decision.replica].queue += 1
        self.counters["routed"] += 1
        self.counters[decision.reason] += 1
        return decision
