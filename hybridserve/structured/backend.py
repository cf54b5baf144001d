"""The grammar backend: structured-output params compiled to token matchers (llguidance).

Why llguidance (numbers in ``benchmarks/results/grammar_backends.json``, from
``benchmarks/bench_grammar.py``): compiling a grammar costs about a millisecond whatever
the vocabulary (its masks are computed lazily, so a request with a schema never seen
before does not stall the step loop), one per-token mask costs tens of microseconds on
the CPU, it has no Python dependencies (the engine never imports ``transformers``), and
one grammar language covers JSON schemas, regexes and Lark grammars that embed JSON
schemas (``%json``), which the tool-call grammars need.

Who owns what:

- :class:`GrammarBackend` (one per engine) holds the llguidance view of the tokenizer
  and a bounded LRU cache of compiled grammars keyed by
  :meth:`StructuredOutputsParams.key`. Compiling is the only step that can fail on the
  user's input; it raises ``ValueError`` naming the field, before the request exists.
- :class:`GrammarMatcher` (one per sequence: ``n > 1`` gets one per child) is the parse
  state after the sequence's committed output tokens. It advances only on tokens the
  engine commits (:meth:`GrammarMatcher.accept`); speculative drafts are checked with
  :meth:`GrammarMatcher.valid_prefix` (a draft the grammar rejects ends the run the
  verifier may accept) and walked, then rolled back, when the step's bitmasks are
  filled (:meth:`GrammarMatcher.fill_bitmasks`), so the committed state never holds an
  unverified token.

Bitmasks of a step are filled by :func:`fill_step_bitmasks`, one call per step for all
constrained rows. By default on the calling thread: llguidance's thread pool
(``GrammarBackend(mask_threads=k)``) fills the rows in parallel outside the GIL, but its
workers spin while they wait for work, and on a host whose cores the step's own host
work needs they made steps slower, not faster (``benchmarks/bench_structured.py``).

EOS: the engine stops a sequence at an EOS id, so a mask allows EOS only where the
grammar accepts, and once the grammar is complete EOS is the only token allowed. The
backend's copy of the tokenizer marks every EOS id special, so that a vocabulary whose
EOS id is also an ordinary byte (byte-level test tokenizers) never offers it mid-string.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridserve.structured.params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask (bit ``t % 32`` of word ``t // 32`` is token t)."""
    return (vocab_size + 31) // 32


def _close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does
    not say otherwise (``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly (JSON escapes are Lark's)."""
    return json.dumps(text)


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) that ``params`` asks for."""
    from llguidance import LLMatcher

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = _close_objects(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if params.disable_any_whitespace:
            options["item_separator"] = ","
            options["key_separator"] = ":"
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(lark_string(c) for c in params.choice))
    return LLMatcher.grammar_from_lark(params.grammar)


class GrammarMatcher:
    """The grammar state of one sequence after its committed tokens (see the module
    docstring for the rules). Not thread safe; the engine's step loop owns it."""

    def __init__(self, matcher: Any, vocab_size: int, executor: Any = None) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.executor = executor  # the backend's llguidance thread pool, or None
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from the committed state
        (changes nothing)."""
        if not tokens or self._m.is_stopped():
            return 0
        return self._m.validate_tokens(list(tokens))

    def accept(self, token: int) -> None:
        """Commit one sampled token. Tokens after the grammar completed (EOS, again
        under ``ignore_eos``) leave the state as it is."""
        if self._m.is_stopped():
            return
        if not self._m.consume_token(int(token)):
            raise RuntimeError(
                f"token {token} was committed but the grammar rejects it: {self._m.get_error()}"
            )
        self.num_accepted += 1

    def fill_bitmasks(self, drafts: Sequence[int], out: np.ndarray) -> None:
        """Fill ``out`` (int32 ``[len(drafts) + 1, words]``, C-contiguous) with the
        allowed tokens after the committed output plus ``drafts[:j]`` for every j. The
        drafts must be a valid prefix (:meth:`valid_prefix`); the committed state is
        restored before returning."""
        if out.shape != (len(drafts) + 1, self.words) or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous int32 [{len(drafts) + 1}, {self.words}]")
        walked = 0
        try:
            for j in range(len(drafts) + 1):
                row = out[j]
                self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                if j < len(drafts):
                    if not self._m.consume_token(int(drafts[j])):
                        raise RuntimeError(f"draft token {drafts[j]} is not a valid continuation")
                    walked += 1
        finally:
            if walked:
                self._m.rollback(walked)

    def allowed(self) -> list[int]:
        """The tokens allowed next from the committed state (for tests and debugging)."""
        mask = np.zeros((1, self.words), dtype=np.int32)
        self.fill_bitmasks([], mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.nonzero(bits)[0].tolist()


def fill_step_bitmasks(
    rows: Sequence[tuple[Any, Sequence[int]]], out: np.ndarray, starts: Sequence[int] | None = None
) -> None:
    """Fill the bitmasks of a step's constrained rows: ``rows`` are ``(matcher,
    drafts)`` pairs whose ``len(drafts) + 1`` positions are consecutive rows of ``out``
    (int32 ``[positions, words]``, C-contiguous), in order, or, with ``starts``, rows
    ``starts[k] ...`` of ``out`` for pair ``k`` (a decode graph's static buffer, whose
    rows sit at fixed strides; the rows of ``out`` no pair names are left as they are).
    Same result as each matcher's :meth:`GrammarMatcher.fill_bitmasks`; rows of
    matchers with a thread pool go to it in (at most) two calls, the others fill their
    own rows in turn."""
    if out.dtype != np.int32 or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous int32 array")
    if starts is not None and len(starts) != len(rows):
        raise ValueError(f"starts has {len(starts)} entries for {len(rows)} rows")
    plain: dict[int, tuple[Any, list]] = {}
    drafted: dict[int, tuple[Any, list]] = {}
    at = 0
    for k, (grammar, drafts) in enumerate(rows):
        n = len(drafts) + 1
        if starts is not None:
            at = starts[k]
            if not 0 <= at <= out.shape[0] - n:
                raise ValueError(f"row {k}'s {n} positions from {at} are outside out's {out.shape[0]} rows")
        if isinstance(grammar, GrammarMatcher) and grammar.executor is not None and grammar.words == out.shape[1]:
            group = drafted if drafts else plain
            _, entries = group.setdefault(id(grammar.executor), (grammar.executor, []))
            entries.append((grammar._m, at, list(drafts)) if drafts else (grammar._m, at))
        else:
            grammar.fill_bitmasks(drafts, out[at : at + n])
        at += n
    if starts is None and at != out.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows for {at} positions")
    row_bytes = out.shape[1] * 4
    for executor, entries in plain.values():
        executor.unsafe_compute_mask_ptr(entries, out.ctypes.data, row_bytes, out.shape[0])
    for executor, entries in drafted.values():
        executor.unsafe_compute_mask_ptr_with_draft_token(entries, out.ctypes.data, row_bytes, out.shape[0])


def _mark_eos_special(tokenizer_json: str, eos_token_ids: Sequence[int]) -> str:
    """``tokenizer_json`` with every EOS id an added special token."""
    tok = json.loads(tokenizer_json)
    added = tok.setdefault("added_tokens", [])
    by_id = {t["id"]: t for t in added}
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        names = {i: t for t, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        names = {i: entry[0] for i, entry in enumerate(vocab)}
    else:
        names = {}
    for t in eos_token_ids:
        if t in by_id:
            by_id[t]["special"] = True
        elif t in names:
            added.append({"id": t, "content": names[t], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True})
    return json.dumps(tok)


class GrammarBackend:
    """Compiles structured-output params for one tokenizer and vocabulary width."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
        mask_threads: int = 0,
    ) -> None:
        """``tokenizer_json``: the Hugging Face ``tokenizer.json`` text; ``vocab_size``:
        the model's logits width (at least the tokenizer's); ``eos_token_ids``: the
        engine's stop ids (the grammar's end); ``mask_threads``: fill bitmasks on a
        pool of that many threads (0: on the caller's thread)."""
        from llguidance import LLExecutor, LLTokenizer

        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token id (the model and tokenizer name none)")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        try:
            self._tokenizer = LLTokenizer(
                _mark_eos_special(tokenizer_json, self.eos_token_ids), n_vocab=vocab_size,
                eos_token=list(self.eos_token_ids),
            )
        except Exception as e:  # the library raises plain exceptions on bad input
            raise ValueError(f"cannot build the grammar tokenizer: {e}") from e
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0
        if mask_threads < 0:
            raise ValueError(f"mask_threads must be >= 0, got {mask_threads}")
        self.executor = LLExecutor(num_threads=mask_threads) if mask_threads else None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A pristine compiled matcher for ``params`` (cached by key; callers copy it).
        Raises ValueError naming the field when the grammar is invalid."""
        from llguidance import LLMatcher

        key = params.key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        source = grammar_source(params)
        matcher = LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}")
        self.num_compiled += 1
        self._cache[key] = matcher
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh per-sequence matcher for ``params``."""
        return GrammarMatcher(self.compile(params).deep_copy(), self.vocab_size, self.executor)

    def tokenize(self, text: str) -> list[int]:
        """``text`` in the grammar tokenizer's ids (for tests)."""
        return self._tokenizer.tokenize_str(text)
