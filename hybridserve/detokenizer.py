"""Incremental detokenization: the text of a growing token sequence without decoding
the whole sequence after every token.

``text(tokens)`` keeps the text of a prefix whose characters are complete (``stable``
tokens) and decodes only a short window before it plus the new tokens; the new text is
what that window's decode adds to the decode of its old part. When the two decodes do
not line up (a merge across the boundary, or a decoder that rewrites the start of a
sequence), it falls back to decoding everything, so the result always equals
``tokenizer.decode(tokens)``; a trailing incomplete character (U+FFFD) is shown but
not made stable, so a later byte can complete it.

``keep_special_ids``: special tokens whose text stays in the output even though
``skip_special_tokens`` drops the others (the tags a tool-call or reasoning parser reads,
when the tokenizer has them as special tokens); the text is then that of
:func:`decode_keeping`. Empty (the default): exactly ``tokenizer.decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT = 4  # tokens decoded before the stable boundary, for merges across it


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def decode_keeping(tokenizer: _Decoder, ids: list[int], keep: frozenset[int]) -> str:
    """``tokenizer.decode(ids)`` skipping special tokens except those in ``keep``, which
    are written as their own text: the runs between kept tokens are decoded as usual
    (a special token splits the decoding there anyway), each kept one on its own."""
    out: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in keep:
            if run:
                out.append(tokenizer.decode(run, True))
                run = []
            out.append(tokenizer.decode([t], False))
        else:
            run.append(t)
    if run or not out:
        out.append(tokenizer.decode(run, True))
    return "".join(out)


class _Keeping:
    """``tokenizer`` whose skipping decode keeps the special tokens in ``keep``."""

    def __init__(self, tokenizer: _Decoder, keep: frozenset[int]) -> None:
        self.tokenizer, self.keep = tokenizer, keep

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return self.tokenizer.decode(ids, False)
        return decode_keeping(self.tokenizer, ids, self.keep)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: _Decoder,
        skip_special_tokens: bool = True,
        keep_special_ids: frozenset[int] = frozenset(),
    ) -> None:
        if keep_special_ids and skip_special_tokens:
            tokenizer = _Keeping(tokenizer, frozenset(keep_special_ids))
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stable = 0  # tokens whose text is final
        self.stable_text = ""

    def text(self, tokens: Sequence[int]) -> str:
        """``tokenizer.decode(tokens)``, where ``tokens`` extends the previous call's."""
        tokens = list(tokens)
        if len(tokens) < self.stable:
            raise ValueError("the token sequence may only grow")
        start = max(0, self.stable - _CONTEXT)
        old = self.tokenizer.decode(tokens[start : self.stable], self.skip)
        new = self.tokenizer.decode(tokens[start:], self.skip)
        if new.startswith(old) and not old.endswith("\ufffd"):
            full = self.stable_text + new[len(old) :]
        else:
            full = self.tokenizer.decode(tokens, self.skip)
        if not full.endswith("\ufffd"):
            self.stable, self.stable_text = len(tokens), full
        return full
