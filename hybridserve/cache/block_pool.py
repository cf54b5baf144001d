"""Attention KV blocks: allocation, reference counts and the prefix index.

Ownership and invariants
------------------------
- A block holds ``kv_block_size`` token positions of every attention layer.
- ``ref_count`` is the number of requests using the block. A block with
  ``ref_count == 0`` sits in the free queue, oldest release first.
- A *full* block of a request is registered under the chained hash of its prefix
  (:func:`chain_hash` of the previous block's hash, its token ids and an extra key,
  e.g. an adapter id). A freed block keeps its hash and stays hittable until it is
  reused for other tokens; reuse evicts it (least recently released first) and
  tells the listeners (the state cache drops checkpoints whose prefix it was part of).
- A hit is confirmed by comparing token ids, so a hash collision can only cost a miss.

Only the scheduler calls into this class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridserve.cache.events import CacheEvent, EventSink


def chain_hash(parent: int | None, token_ids: Sequence[int], extra_key: object = None) -> int:
    """Hash of a full block given its parent block's hash (None for the first block).

    The same in every process, so a router elsewhere computes the same chain: built
    only from ints (whose hashes do not depend on the process, unlike ``hash(None)``
    and string hashes). ``extra_key`` must be an int (or a tuple of ints) for that to
    hold. CPython's ``hash`` never returns -1, so -1 cannot be a real parent.
    """
    key = (-1 if parent is None else parent, tuple(token_ids))
    return hash(key if extra_key is None else (*key, extra_key))


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Append to ``hashes`` (the chained hashes of the first full blocks of ``token_ids``,
    no extra key) those of the next ones, up to ``num_blocks`` in all: :func:`chain_hash`
    of each, inline (an 8k-token prompt has 512 blocks to hash)."""
    parent = hashes[-1] if hashes else -1
    # One copy of the tokens to hash, as a tuple: its slices are the blocks' tuples.
    tokens = tuple(token_ids[len(hashes) * block_size : num_blocks * block_size])
    for start in range(0, (num_blocks - len(hashes)) * block_size, block_size):
        parent = hash((parent, tokens[start : start + block_size]))
        hashes.append(parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: object = None, limit: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids[:limit]``."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    out: list[int] = []
    parent = None
    for start in range(0, n - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size], extra_key)
        out.append(parent)
    return out


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockPool:
    """Fixed pool of KV blocks with a hash -> block prefix index (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in release order; the first is reused first.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.on_evict: list[Callable[[int], None]] = []
        # Publishes block_stored / block_removed (hybridserve.cache.events); None: off.
        self.event_sink: EventSink | None = None
        self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks for new tokens; raises MemoryError if too few are free."""
        if count > len(self.free):
            raise MemoryError(f"need {count} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._forget_hash(block)
            block.ref_count = 1
            out.append(block_id)
        return out

    def _forget_hash(self, block: Block) -> None:
        if block.block_hash is None:
            return
        h = block.block_hash
        if self.hash_to_block.get(h) == block.block_id:
            del self.hash_to_block[h]
            self.num_evicted += 1
            if self.event_sink is not None:
                self.event_sink(CacheEvent("block_removed", h))
            for fn in self.on_evict:
                fn(h)
        block.block_hash = None
        block.token_ids = ()

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly ``token_ids`` under ``block_hash``, if any."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        if self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self.hash_to_block

    def num_free_of(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` (distinct) sit on the free queue: the blocks that
        :meth:`acquire` would take off it."""
        return len(self.free.keys() & block_ids)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each of ``block_ids`` (cache hits); takes them off the free queue."""
        blocks, free = self.blocks, self.free  # a prefix hit brings 500 blocks at 8k tokens
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                del free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block reaching zero joins the free queue.

        Blocks are released in reverse so that a sequence's tail is reused before its
        head (heads are shared by more future prompts).
        """
        blocks, free = self.blocks, self.free
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            if block.ref_count <= 0:
                raise AssertionError(f"KV block {block_id} released with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._forget_hash(block)
                    free[block_id] = None
                    free.move_to_end(block_id, last=False)
                else:
                    free[block_id] = None

    def register(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Record that ``block_id`` now holds the full block ``token_ids`` under ``block_hash``."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        # Keep the first block registered under a hash: it may already be shared.
        stored = self.hash_to_block.setdefault(block_hash, block_id) == block_id
        if stored and self.event_sink is not None:
            self.event_sink(CacheEvent("block_stored", block_hash))

    def clear_cache(self) -> int:
        """Forget every hash of a free block. Returns how many were forgotten."""
        n = 0
        for block_id in list(self.free):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._forget_hash(block)
                n += 1
        return n

    def check_integrity(self, writes: Sequence[int] = ()) -> None:
        """Raise AssertionError if ref counts, the free queue or the hash index disagree,
        or if a block of ``writes`` (blocks a step is about to write) is not its writer's
        alone (``ref_count`` 1) or is registered in the prefix index: a registered block
        is read by hits on its prefix and must never change."""
        indexed = set(self.hash_to_block.values())
        for block_id in writes:
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.block_hash is not None or block_id in indexed:
                raise AssertionError(
                    f"KV block {block_id} is written by a step but has ref_count "
                    f"{block.ref_count}, hash {block.block_hash} (index: {block_id in indexed})"
                )
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(f"KV block {block.block_id} has ref_count {block.ref_count}")
            in_free = block.block_id in self.free
            if in_free != (block.ref_count == 0):
                raise AssertionError(
                    f"KV block {block.block_id}: ref_count {block.ref_count} but in_free={in_free}"
                )
        for h, block_id in self.hash_to_block.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"hash index points at KV block {block_id} that lost its hash")
