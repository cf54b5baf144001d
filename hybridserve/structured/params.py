"""What a request asks its output to match: :class:`StructuredOutputsParams`, in vLLM's
spelling (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``).

Exactly one constraint per request: ``json`` (a JSON schema, as a dict or its JSON
text), ``regex``, ``choice`` (a list of strings, the output is one of them verbatim),
``grammar`` (a Lark grammar, llguidance's dialect, which also embeds JSON schemas with
``%json {...}``), or ``json_object=True`` (any JSON object). The options shape how a
JSON schema compiles: ``disable_any_whitespace`` (compact JSON, no free whitespace
between tokens), ``disable_additional_properties`` (objects without an explicit
``additionalProperties`` get ``false``), ``whitespace_pattern`` (a regex for the
whitespace allowed between JSON tokens). ``after_token_ids``: the constraint applies
only once the output has written these tokens (the end of a reasoning block: the
server sets it to its reasoning parser's end tag, as vLLM applies grammars after the
reasoning); the tokens up to and including them are free.

The params are plain data, validated on construction (errors name the field); the
grammar backend (:mod:`hybridserve.structured.backend`) compiles them, cached by
:meth:`StructuredOutputsParams.key`.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    after_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of "
                f"{', '.join(CONSTRAINTS)}; got {given or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except _json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty Lark grammar string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")
        if self.after_token_ids is not None:
            ids = self.after_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ValueError("structured_outputs.after_token_ids must be a non-empty list of token ids")
            self.after_token_ids = tuple(ids)

    @property
    def kind(self) -> str:
        """The constraint given: one of :data:`CONSTRAINTS`."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable key equal for params that compile to the same grammar."""
        value = getattr(self, self.kind)
        spec = _json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        opts = (self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern)
        return self.kind, f"{spec}\x00{opts}"
