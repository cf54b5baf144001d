"""The grammar backend on its own: params validation, the compiled-grammar cache, the
per-sequence matcher's walk over drafts and its EOS rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridserve.llm import DEFAULT_MODEL
from hybridserve.structured.backend import GrammarBackend, bitmask_words
from hybridserve.structured.params import StructuredOutputsParams as S

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend((DEFAULT_MODEL / "tokenizer.json").read_text(), 4096, (0,))


def _bits(mask_row: np.ndarray, vocab: int) -> set[int]:
    return set(np.nonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab])[0].tolist())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "exactly one"),
        ({"json": SCHEMA, "regex": "a"}, "exactly one"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": [1]}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": 5}, "structured_outputs.grammar"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        S(**kwargs)


def test_params_keys_and_sampling_params_dict_form():
    from hybridserve import SamplingParams

    assert S(json=SCHEMA).key() == S(json=json.dumps(SCHEMA)).key()
    assert S(json=SCHEMA).key() != S(json=SCHEMA, disable_any_whitespace=True).key()
    assert S(regex="a+").key() != S(grammar="a+").key()
    sp = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert isinstance(sp.structured_outputs, S) and sp.structured_outputs.kind == "choice"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


def test_bad_grammar_raises_naming_the_kind(backend):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        backend.compile(S(regex="(("))
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        backend.compile(S(grammar="start: undefined_rule"))


def test_compiled_grammars_are_cached_by_key(backend):
    before = backend.num_compiled
    a = backend.compile(S(json=SCHEMA, disable_any_whitespace=True))
    b = backend.compile(S(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    assert a is b and backend.num_compiled == before + 1
    small = GrammarBackend((DEFAULT_MODEL / "tokenizer.json").read_text(), 4096, (0,), cache_size=1)
    first = small.compile(S(regex="a"))
    small.compile(S(regex="b"))
    assert small.compile(S(regex="a")) is not first  # evicted, recompiled


def test_matchers_of_one_grammar_are_independent(backend):
    p = S(regex="(ab|cd)e")
    m1, m2 = backend.matcher(p), backend.matcher(p)
    for t in backend.tokenize("ab"):
        m1.accept(t)
    assert m1.allowed() != m2.allowed()
    assert m2.allowed() == backend.matcher(p).allowed()


def test_draft_walk_masks_each_position_and_restores_state(backend):
    p = S(json=SCHEMA, disable_any_whitespace=True)
    doc = '{"a":12,"b":"xy"}'
    ids = backend.tokenize(doc)
    m = backend.matcher(p)
    assert m.valid_prefix(ids) == len(ids)
    before = m.allowed()
    out = np.zeros((len(ids) + 1, bitmask_words(4096)), dtype=np.int32)
    m.fill_bitmasks(ids, out)
    assert m.allowed() == before and m.num_accepted == 0  # nothing committed
    ref = backend.matcher(p)
    for j, t in enumerate(ids):
        assert _bits(out[j], 4096) == set(ref.allowed())
        assert t in _bits(out[j], 4096)
        ref.accept(t)
    assert _bits(out[len(ids)], 4096) == {0}  # complete: only EOS


def test_rejected_draft_ends_the_valid_prefix(backend):
    m = backend.matcher(S(regex="[0-9]+x"))
    ids = backend.tokenize("12") + backend.tokenize("y") + backend.tokenize("x")
    assert m.valid_prefix(ids) == len(backend.tokenize("12"))
    with pytest.raises(RuntimeError, match="rejects"):
        m.accept(backend.tokenize("y")[0])


def test_eos_allowed_only_where_the_grammar_accepts():
    """In a byte vocabulary the EOS id is also a byte; mid-string the mask must not offer
    it (the engine would stop there), and once the grammar accepts it must."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    eos = alphabet.index("#")
    b = GrammarBackend(tok.to_str(), 256, (eos,))
    a, tok_b = b.tokenize("a")[0], b.tokenize("b")[0]
    m = b.matcher(S(regex="a[#b]*"))
    m.accept(a)
    assert set(m.allowed()) == {eos, tok_b}  # accepting: EOS may end it
    inner = b.matcher(S(regex="a[#b]*c"))
    inner.accept(a)
    assert eos not in inner.allowed() and tok_b in inner.allowed()


@pytest.mark.parametrize("threads", [0, 2])
def test_step_fill_equals_each_matchers_own_walk(threads):
    """The step's batched fill (in turn, or on the thread pool; rows with and without
    drafts) writes what each matcher's own walk writes, at each row's offset."""
    import random

    backend = GrammarBackend((DEFAULT_MODEL / "tokenizer.json").read_text(), 4096, (0,), mask_threads=threads)

    rng = random.Random(0)
    words = bitmask_words(4096)
    docs = ['{"a":12,"b":"xy"}', '{"a":-3,"b":""}', "abbc", "cd", "yes"]
    grammars = [S(json=SCHEMA, disable_any_whitespace=True)] * 2 + [S(regex="ab+c")] + [S(regex="(ab|cd)e")] + [
        S(choice=["yes", "no"])]
    rows = []
    for doc, p in zip(docs * 3, grammars * 3):
        ids = backend.tokenize(doc)
        m = backend.matcher(p)
        cut = rng.randint(0, len(ids))
        for t in ids[:cut]:
            m.accept(t)
        drafts = ids[cut : cut + rng.randint(0, 3)]
        rows.append((m, drafts))
    total = sum(len(d) + 1 for _, d in rows)
    batched = np.zeros((total, words), dtype=np.int32)
    from hybridserve.structured.backend import fill_step_bitmasks

    fill_step_bitmasks(rows, batched)
    at = 0
    for m, drafts in rows:
        own = np.zeros((len(drafts) + 1, words), dtype=np.int32)
        m.fill_bitmasks(drafts, own)
        assert np.array_equal(batched[at : at + len(drafts) + 1], own)
        at += len(drafts) + 1
    assert any(d for _, d in rows) and any(not d for _, d in rows)
    # At fixed strides (a decode graph's buffer: row k from k * 5, 4 positions at most):
    # the same masks there, every other row untouched.
    strided = np.full((len(rows) * 5, words), 7, dtype=np.int32)
    fill_step_bitmasks(rows, strided, [5 * k for k in range(len(rows))])
    at = 0
    for k, (_, drafts) in enumerate(rows):
        n = len(drafts) + 1
        assert np.array_equal(strided[5 * k : 5 * k + n], batched[at : at + n])
        assert (strided[5 * k + n : 5 * k + 5] == 7).all()
        at += n
    with pytest.raises(ValueError, match="outside"):
        fill_step_bitmasks(rows[:1], strided[:2], [2])
