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


class _CountingDecoder:
    """A tokenizer whose ``decode`` counts the tokens it is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0
        self.calls = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens)


# Tokens decoded per new token: the window before the stable boundary (decoded twice)
# and the new token. Decoding everything on every token costs n / 2 per token.
DECODES_PER_TOKEN = 12


@pytest.mark.parametrize("kind", ["text", "random"])
def test_decode_work_grows_linearly(kind):
    tok = Tokenizer(DEFAULT_MODEL)
    rng = random.Random(1)
    if kind == "text":
        source = "def f(x):\n    return x  # naïve café → ✓ 日本語 🙂\n" * 200
        ids = tok.encode(source, add_special_tokens=False)[:1000]
    else:
        ids = [rng.randrange(tok.vocab_size) for _ in range(1000)]
    counting = _CountingDecoder(tok)
    detok = IncrementalDetokenizer(counting)
    for k in range(1, len(ids) + 1):
        detok.text(ids[:k])
    assert detok.text(ids) == tok.decode(ids)
    assert counting.decoded <= DECODES_PER_TOKEN * len(ids), counting.decoded / len(ids)


def test_engine_decode_work_grows_linearly(tiny_granite):
    """Through the engine: a stop string that never matches is checked after every
    token of a long generation, on the request's incremental detokenizer."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(tiny_granite, max_num_seqs=2)
    counting = _CountingDecoder(llm.engine.tokenizer)
    llm.engine.tokenizer = counting
    n = 256
    params = SamplingParams(max_tokens=n, temperature=0.8, seed=3, ignore_eos=True,
                            stop=["\x00never\x00"])
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs
    assert len(out.token_ids) == n and out.text == counting.tokenizer.decode(out.token_ids)
    assert counting.calls >= n  # every token was checked against the stop string
    assert counting.decoded <= DECODES_PER_TOKEN * n + 2 * n, counting.decoded / n


def test_kept_special_tokens_show_and_the_others_stay_skipped(tmp_path):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>", "<eos>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    think, end, eos = (tok.token_to_id(t) for t in ("<think>", "</think>", "<eos>"))
    ids = [think, *tok.encode("é日 a", add_special_tokens=False), end, *tok.encode("b🙂", False), eos]
    rng = random.Random(1)
    for seq in (ids, [rng.choice([think, end, eos, *range(256)]) for _ in range(150)]):
        detok = IncrementalDetokenizer(tok, keep_special_ids=frozenset({think, end}))
        for k in range(1, len(seq) + 1):
            want = tok.decode(seq[:k], skip_special_tokens=False).replace("<eos>", "")
            assert detok.text(seq[:k]) == want, k
    kept = IncrementalDetokenizer(tok, keep_special_ids=frozenset({think, end})).text(ids)
    assert kept == "<think>é日 a</think>b🙂"
    # Without a keep set (and with skipping off) the text is the plain decode, as before.
    assert IncrementalDetokenizer(tok).text(ids) == tok.decode(ids) == "é日 ab🙂"
    off = IncrementalDetokenizer(tok, skip_special_tokens=False, keep_special_ids=frozenset({think}))
    assert off.text(ids) == tok.decode(ids, skip_special_tokens=False)
