"""The checkpoint dependency map: which checkpoints a KV block's eviction invalidates.

A checkpoint (on the device, :mod:`hybridserve.cache.state_cache`, or on the host tier,
:mod:`hybridserve.cache.host_tier`) summarises a prefix, recorded as the chained hashes
of its full KV blocks. When any of those blocks leaves the prefix index the checkpoint
can never be hit again and is dropped; :meth:`PrefixDependents.dependents` names them.

Why a tree. Recording every checkpoint under every block of its prefix costs one set
update per block on each admission and each removal: about 500 of them for a checkpoint
8k tokens deep, paid on every cached prompt's first token (a few admissions and LRU
evictions each). The checkpoints along one path share all but their last few blocks, so
they are kept as a tree instead:

- a *node* is one distinct prefix, named by its last block hash; it holds the keys
  stored under it (one in the engine, where a checkpoint's key is that hash);
- a node's *parent* is the deepest other node whose prefix its own starts with (the
  root, None, if there is none); its *segment* is its prefix past its parent's;
- ``_segment[h]`` holds the nodes whose segment contains block hash ``h``.

Every block of a node's prefix lies in exactly one segment on its path (its own or an
ancestor's), so the checkpoints that need block ``h`` are those of the nodes in
``_segment[h]`` and of their subtrees. The tree depends only on the set of live
prefixes, not on the order they came in (:meth:`check` rebuilds it to compare).

Costs. An admission walks back from its prefix's end to its parent (with the checkpoint
grid, a few blocks) and records its segment; a removal forgets its segment and hands it
to each of its children. A prefix whose last hash names a node of a different prefix
(a hash collision, or a test's made-up hashes) is kept flat, under every hash of its
prefix, so the answers stay exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_ROOT = None


class PrefixDependents:
    """Checkpoint keys by the KV blocks their prefixes need (see module docstring)."""

    def __init__(self) -> None:
        self._keys: dict[int, set[int]] = {}  # node -> keys stored under it
        self._node_of: dict[int, int | None] = {}  # key -> node (None: no blocks)
        self._prefix: dict[int, tuple[int, ...]] = {}  # node -> its prefix
        self._parent: dict[int, int | None] = {}
        # parent -> first hash of a child's segment -> those children. Indexed by that
        # hash so an admission looks only at the children its prefix could lie above.
        self._children: dict[int | None, dict[int, set[int]]] = {_ROOT: {}}
        self._segment: dict[int, set[int]] = {}  # block hash -> nodes whose segment has it
        # The flat fallback: key -> prefix, and block hash -> those keys.
        self._flat_prefix: dict[int, tuple[int, ...]] = {}
        self._flat: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._node_of) + len(self._flat_prefix)

    def __contains__(self, key: int) -> bool:
        return key in self._node_of or key in self._flat_prefix

    # ---- updates -----------------------------------------------------------------

    def add(self, key: int, prefix: Sequence[int]) -> None:
        """Record checkpoint ``key`` as needing every block of ``prefix`` (chained
        hashes, shallowest first). Raises ValueError if ``key`` is already recorded."""
        if key in self:
            raise ValueError(f"checkpoint {key} is already in the dependency map")
        prefix = tuple(prefix)
        if not prefix:
            self._node_of[key] = None
            return
        n = prefix[-1]
        held = self._keys.get(n)
        if held is not None:
            if self._prefix[n] == prefix:
                held.add(key)
                self._node_of[key] = n
            else:
                self._add_flat(key, prefix)
            return
        prefixes = self._prefix
        parent, start = _ROOT, 0
        for i in range(len(prefix) - 2, -1, -1):
            p = prefix[i]
            if p in prefixes and prefixes[p] == prefix[: i + 1]:
                parent, start = p, i + 1
                break
        end = len(prefix)
        siblings = self._children[parent]
        first = prefix[start]
        mine: dict[int, set[int]] = {}
        # Nodes under the parent whose prefixes run through the new one become its
        # children: their segments lose the new node's blocks.
        group = siblings.get(first)
        if group:
            for c in [c for c in group if len(prefixes[c]) > end and prefixes[c][:end] == prefix]:
                group.discard(c)
                cp = prefixes[c]
                for h in cp[start:end]:
                    self._unsegment(h, c)
                mine.setdefault(cp[end], set()).add(c)
                self._parent[c] = n
        siblings.setdefault(first, set()).add(n)
        self._children[n] = mine
        self._parent[n] = parent
        prefixes[n] = prefix
        self._keys[n] = {key}
        self._node_of[key] = n
        segment = self._segment
        for h in prefix[start:]:
            nodes = segment.get(h)
            if nodes is None:
                segment[h] = {n}
            else:
                nodes.add(n)

    def remove(self, key: int) -> None:
        """Forget checkpoint ``key``. Raises KeyError if it is not recorded."""
        if key in self._flat_prefix:
            for h in self._flat_prefix.pop(key):
                keys = self._flat.get(h)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._flat[h]
            return
        n = self._node_of.pop(key)
        if n is None:
            return
        held = self._keys[n]
        held.discard(key)
        if held:
            return
        del self._keys[n]
        parent = self._parent.pop(n)
        prefix = self._prefix.pop(n)
        start = len(self._prefix[parent]) if parent is not _ROOT else 0
        own = prefix[start:]
        for h in own:
            self._unsegment(h, n)
        siblings = self._children[parent]
        first = prefix[start]
        group = siblings[first]
        group.discard(n)
        # Its children now hang from its parent, their segments starting where its did.
        segment = self._segment
        for kids in self._children.pop(n).values():
            for c in kids:
                self._parent[c] = parent
                group.add(c)
                for h in own:
                    nodes = segment.get(h)
                    if nodes is None:
                        segment[h] = {c}
                    else:
                        nodes.add(c)
        if not group:
            del siblings[first]

    def _unsegment(self, h: int, node: int) -> None:
        nodes = self._segment[h]
        nodes.discard(node)
        if not nodes:
            del self._segment[h]

    def _add_flat(self, key: int, prefix: tuple[int, ...]) -> None:
        self._flat_prefix[key] = prefix
        for h in prefix:
            self._flat.setdefault(h, set()).add(key)

    # ---- queries -----------------------------------------------------------------

    def dependents(self, block_hash: int) -> list[int]:
        """The keys whose prefix holds ``block_hash``, deepest first (so removing them
        in this order hands no segment down to a child that goes next)."""
        found: dict[int, None] = {}
        stack = list(self._segment.get(block_hash, ()))
        while stack:
            node = stack.pop()
            if node in found:
                continue
            found[node] = None
            for kids in self._children[node].values():
                stack.extend(kids)
        nodes = sorted(found, key=lambda node: len(self._prefix[node]), reverse=True)
        keys = [k for node in nodes for k in sorted(self._keys[node])]
        keys += sorted(self._flat.get(block_hash, ()), key=lambda k: -len(self._flat_prefix[k]))
        return keys

    def covering(self) -> dict[int, set[int]]:
        """Every block hash -> the keys whose prefix holds it (the map this structure
        stands for, built in full: for tests and integrity checks)."""
        out: dict[int, set[int]] = {}
        for key, prefix in self.prefixes().items():
            for h in prefix:
                out.setdefault(h, set()).add(key)
        return out

    def prefixes(self) -> dict[int, tuple[int, ...]]:
        """Every recorded key -> its prefix."""
        out = {key: () if n is None else self._prefix[n] for key, n in self._node_of.items()}
        out.update(self._flat_prefix)
        return out

    def _shape(self) -> tuple:
        children = {p: {f: kids for f, kids in groups.items() if kids}
                    for p, groups in self._children.items()}
        return (self._keys, self._node_of, self._prefix, self._parent, children,
                self._segment, self._flat_prefix, self._flat)

    def check(self, prefixes: Mapping[int, Sequence[int]], what: str = "checkpoint") -> None:
        """Raise AssertionError unless the map records exactly ``prefixes`` (key ->
        prefix hashes) and its tree is the one those prefixes build afresh."""
        mine = self.prefixes()
        want = {key: tuple(p) for key, p in prefixes.items()}
        if mine != want:
            missing = sorted(set(want) - set(mine))
            stale = sorted(set(mine) - set(want))
            raise AssertionError(
                f"{what} dependency map is stale: missing {missing}, stale {stale}, "
                f"or a prefix differs")
        fresh = PrefixDependents()
        for key, prefix in want.items():
            if key in self._flat_prefix:
                fresh._add_flat(key, prefix)
            else:
                fresh.add(key, prefix)
        if fresh._shape() != self._shape():
            raise AssertionError(f"{what} dependency map's tree differs from its rebuild")
