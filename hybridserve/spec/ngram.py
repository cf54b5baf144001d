"""Prompt-lookup (n-gram) drafting.

A drafter proposes up to ``k`` tokens to follow a sequence; the target model verifies
them in one forward. Any class with ``propose(token_ids, k) -> list[int]`` can stand
in (a small draft model later).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hybridserve.config import SpecConfig


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...


class NgramDrafter:
    """Match the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
    against earlier text; propose the tokens that followed the most recent match."""

    def __init__(self, config: SpecConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        toks = list(token_ids)
        length = len(toks)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = toks[length - n :]
            # Most recent earlier occurrence whose continuation is known.
            for start in range(length - n - 1, -1, -1):
                if toks[start : start + n] == suffix:
                    follow = toks[start + n : start + n + k]
                    if follow:
                        return follow
        return []
