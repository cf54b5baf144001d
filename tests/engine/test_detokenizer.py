"""Incremental detokenization equals decoding the whole sequence, token by token."""

from __future__ import annotations

import random

import pytest

from hybridserve.detokenizer import IncrementalDetokenizer
from hybridserve.llm import DEFAULT_MODEL
from hybridserve.tokenizer import Tokenizer


@pytest.mark.parametrize("source", ["default", "bytes"])
def test_incremental_text_equals_full_decode(source, tiny_granite):
    tok = Tokenizer(DEFAULT_MODEL if source == "default" else tiny_granite)
    rng = random.Random(0)
    texts = [
        "def f(x):\n    return x  # naïve café ünïcödé → ✓ 日本語 🙂\n",
        "".join(rng.choice("ab \n\t{}()é日🙂") for _ in range(200)),
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        # Random tokens too: byte pieces that never form valid UTF-8 in order.
        for seq in (ids, [rng.randrange(tok.vocab_size) for _ in range(120)]):
            detok = IncrementalDetokenizer(tok)
            for k in range(1, len(seq) + 1):
                assert detok.text(seq[:k]) == tok.decode(seq[:k]), (source, k)
