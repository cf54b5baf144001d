"""Prompt-lookup (n-gram) drafting.

A drafter proposes up to ``k`` tokens to follow a sequence; the target model verifies
them in one forward. Any class with ``propose(token_ids, k, key) -> list[int]`` and
``forget(key)`` can stand in (a small draft model later).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from hybridserve.config import SpecConfig


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int, key: Hashable = None) -> list[int]: ...

    def forget(self, key: Hashable) -> None: ...


def propose_reference(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The n-gram proposal by brute force (the twin of :class:`NgramDrafter`): the
    tokens that followed the most recent earlier occurrence of the longest suffix of
    length ``max_n`` down to ``min_n`` that has one."""
    if k <= 0:
        return []
    toks = list(token_ids)
    length = len(toks)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = toks[length - n :]
        for start in range(length - n - 1, -1, -1):
            if toks[start : start + n] == suffix:
                return toks[start + n : start + n + k]
    return []


class _Index:
    """For each n, the latest start of every n-gram whose next token is known."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # tokens whose preceding n-grams are recorded

    def extend(self, toks: list[int]) -> None:
        for t in range(max(self.indexed, 1), len(toks)):
            # Token t is the continuation of every n-gram ending just before it.
            for n, table in self.tables.items():
                if t >= n:
                    table[tuple(toks[t - n : t])] = t - n
        self.indexed = max(self.indexed, len(toks))


class NgramDrafter:
    """Match the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
    against earlier text; propose the tokens that followed the most recent match.

    With a ``key`` (the engine passes the request id) the drafter keeps an index of the
    sequence's n-grams and extends it as tokens are appended, so a proposal costs a few
    dictionary lookups instead of a scan of the whole context; ``forget(key)`` drops it.
    Without a key it scans (:func:`propose_reference`).
    """

    def __init__(self, config: SpecConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._indexes: dict[Hashable, _Index] = {}

    def propose(self, token_ids: Sequence[int], k: int, key: Hashable = None) -> list[int]:
        if k <= 0:
            return []
        if key is None:
            return propose_reference(token_ids, k, self.min_n, self.max_n)
        toks = list(token_ids)
        index = self._indexes.get(key)
        if index is None or index.indexed > len(toks):
            index = self._indexes[key] = _Index(self.min_n, self.max_n)
        index.extend(toks)
        length = len(toks)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = index.tables[n].get(tuple(toks[length - n :]))
            if start is not None:
                return toks[start + n : start + n + k]
        return []

    def forget(self, key: Hashable) -> None:
        self._indexes.pop(key, None)
