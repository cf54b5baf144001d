"""Grammars that force a tool call: ``tool_choice="required"`` or a named function.

:func:`tool_call_grammar` returns the :class:`StructuredOutputsParams` (a Lark grammar
in llguidance's dialect) whose every output is one call (or, with
``parallel_tool_calls``, one or more) in the format of the given parser
(:mod:`hybridserve.tools.parsers`), naming one of the allowed functions, with
arguments that satisfy that function's JSON schema: JSON arguments are embedded
schemas (``%json``), so even a random-weight model returns arguments that validate.

The JSON inside the envelopes is written as the chat templates write it (``", "`` and
``": "`` separators, no other whitespace). For the XML format (``qwen3_coder``) each
parameter is written in the schema's order, required ones always and optional ones
maybe; a string parameter's value is raw text without ``<`` or newlines (its
``enum``, ``minLength`` and ``maxLength`` hold; a ``pattern`` is not enforced in raw
text), any other type is JSON matching its schema.

The envelope tags (``<tool_call>``, ``</tool_call>``, ``<TOOLCALL>``, ...) are written
as the tokenizer writes them: a tag the tokenizer has as one token (``tag_ids``, from
:func:`single_token_tags`) is that token (the grammar names its id, ``<[id]>``), as a
model trained on that tokenizer has only ever seen it; any other tag is text. Naming
the id matters most for a special token: its text as a grammar literal is a sequence of
byte tokens the model has never seen together, and llguidance's forced-token lookahead
may offer the special token for that literal and then reject it when it is committed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hybridserve.structured.params import StructuredOutputsParams
from hybridserve.tools.parsers import get_tool_parser

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FORMATS = {"hermes": "json", "granite4": "json", "qwen3_coder": "xml", "nemotron_v3": "xml",
            "nemotron_nano_v2": "json_list"}


def envelope_tags(parser: str) -> tuple[str, str]:
    """The open and close tags of ``parser``'s envelope (the parser's own)."""
    cls = get_tool_parser(parser)
    return cls.start, cls.end


def _lit(text: str) -> str:
    return json.dumps(text)


def _tag(text: str, tag_ids: Mapping[str, int]) -> str:
    """The grammar item writing ``text``: its token when the tokenizer has it as one."""
    token = tag_ids.get(text)
    return f"<[{int(token)}]>" if token is not None else _lit(text)


def single_token_tags(parser: str, encode: Any, decode: Any) -> dict[str, int]:
    """The envelope tags of ``parser`` that the tokenizer writes as one token: tag ->
    id. ``encode(text)`` gives ids without added BOS/EOS, ``decode(ids)`` the text with
    special tokens shown. A tag qualifies when it encodes to one id whose text is the
    tag (an added token, special or not)."""
    out = {}
    for tag in envelope_tags(parser):
        ids = encode(tag)
        if len(ids) == 1 and decode(ids) == tag:
            out[tag] = ids[0]
    return out


def _functions(tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    fns = [t.get("function", t) for t in tools]
    if not fns:
        raise ValueError("tool_choice needs tools: the request names none")
    for fn in fns:
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("tools[].function.name must be a non-empty string")
    if tool_choice == "required":
        return fns
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [fn for fn in fns if fn["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
        return chosen
    raise ValueError(f"tool_choice={tool_choice!r} is not forced: use 'required' or a named function")


def _schema(fn: dict[str, Any]) -> dict[str, Any]:
    schema = fn.get("parameters") or {"type": "object", "properties": {}}
    return {**schema, "x-guidance": _JSON_STYLE}


def _json_call_rules(fns: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Rules ``fn_i`` writing ``{"name": NAME, "arguments": ARGS}``; returns the rules
    and the alternative over them."""
    rules = []
    for i, fn in enumerate(fns):
        head = '{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
        rules.append(f"fn_{i}: {_lit(head)} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: %json {json.dumps(_schema(fn))}")
    return rules, "(" + " | ".join(f"fn_{i}" for i in range(len(fns))) + ")"


def _xml_value_rule(name: str, schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        if "enum" in schema:
            options = [v for v in schema["enum"] if isinstance(v, str) and "<" not in v and "\n" not in v]
            if not options:
                raise ValueError(f"parameter {name!r}: no enum value can be written as raw text")
            return f"{name}: " + " | ".join(_lit(v) for v in options)
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        bound = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
        return f"{name}: /[^<\\n]{bound}/"
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': _JSON_STYLE})}"


def _xml_call_rules(fns: list[dict[str, Any]]) -> tuple[list[str], str]:
    rules = []
    for i, fn in enumerate(fns):
        schema = fn.get("parameters") or {}
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            head = f"<parameter={pname}>\n"
            rules.append(f"p_{i}_{j}: {_lit(head)} v_{i}_{j} {_lit(chr(10) + '</parameter>' + chr(10))}")
            rules.append(_xml_value_rule(f"v_{i}_{j}", pschema or {}))
            parts.append(f"p_{i}_{j}" + ("" if pname in required else "?"))
        head = f"<function={fn['name']}>\n"
        rules.append(f"fn_{i}: {_lit(head)} {' '.join(parts)} {_lit('</function>' + chr(10))}")
    return rules, "(" + " | ".join(f"fn_{i}" for i in range(len(fns))) + ")"


def tool_call_grammar(
    parser: str,
    tools: Sequence[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool = True,
    tag_ids: Mapping[str, int] | None = None,
) -> StructuredOutputsParams:
    """The constraint forcing ``tool_choice`` (``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) in ``parser``'s format.
    ``tag_ids``: the envelope tags the tokenizer has as single tokens
    (:func:`single_token_tags`); they are written as those tokens. ValueError names
    the bad field."""
    fns = _functions(tools, tool_choice)
    more = parallel_tool_calls and tool_choice == "required"
    if parser not in _FORMATS:
        raise ValueError(f"no tool-call grammar for parser {parser!r}")
    open_tag, close_tag = (_tag(t, tag_ids or {}) for t in envelope_tags(parser))
    nl = _lit("\n")
    if _FORMATS[parser] == "json":
        rules, alt = _json_call_rules(fns)
        call = f"call: {open_tag} {nl} {alt} {nl} {close_tag}"
        start = f"start: call ({nl} call)*" if more else "start: call"
    elif _FORMATS[parser] == "xml":
        rules, alt = _xml_call_rules(fns)
        call = f"call: {open_tag} {nl} {alt} {close_tag}"
        start = f"start: call ({nl} call)*" if more else "start: call"
    else:  # one envelope around a JSON list of calls
        rules, alt = _json_call_rules(fns)
        call = f"call: {alt}"
        calls = f'call ({_lit(", ")} call)*' if more else "call"
        start = f'start: {open_tag} {_lit("[")} {calls} {_lit("]")} {close_tag}'
    return StructuredOutputsParams(grammar="\n".join([start, call, *rules]) + "\n")
