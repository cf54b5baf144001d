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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hybridserve.structured.params import StructuredOutputsParams

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_FORMATS = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "granite4": ("<tool_call>\n", "\n</tool_call>")}


def _lit(text: str) -> str:
    return json.dumps(text)


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
) -> StructuredOutputsParams:
    """The constraint forcing ``tool_choice`` (``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) in ``parser``'s format.
    ValueError names the bad field."""
    fns = _functions(tools, tool_choice)
    more = parallel_tool_calls and tool_choice == "required"
    if parser in _JSON_FORMATS:
        open_tag, close_tag = _JSON_FORMATS[parser]
        rules, alt = _json_call_rules(fns)
        call = f"call: {_lit(open_tag)} {alt} {_lit(close_tag)}"
        start = 'start: call ("\\n" call)*' if more else "start: call"
    elif parser in ("qwen3_coder", "nemotron_v3"):
        rules, alt = _xml_call_rules(fns)
        call = f"call: {_lit('<tool_call>' + chr(10))} {alt} {_lit('</tool_call>')}"
        start = 'start: call ("\\n" call)*' if more else "start: call"
    elif parser == "nemotron_nano_v2":
        rules, alt = _json_call_rules(fns)
        call = f"call: {alt}"
        start = 'start: "<TOOLCALL>[" call (", " call)* "]</TOOLCALL>"' if more else 'start: "<TOOLCALL>[" call "]</TOOLCALL>"'
    else:
        raise ValueError(f"no tool-call grammar for parser {parser!r}")
    return StructuredOutputsParams(grammar="\n".join([start, call, *rules]) + "\n")
