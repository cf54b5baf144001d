"""Tool-call parsers: a model's text output split into content and OpenAI tool calls.

Formats, by parser name (vLLM's names where it has one):

- ``hermes``: Qwen3 / Hermes, one JSON object per call in
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (newlines around the
  object are usual).
- ``granite4``: Granite 4.0's chat template asks for the same envelope
  (``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>``).
- ``qwen3_coder``: XML, ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...
  </function></tool_call>``; the format of Qwen3-Coder, Qwen3.5 and Nemotron 3 (vLLM
  serves Nemotron 3 with this parser; ``nemotron_v3`` is an alias here). Values are
  raw text, converted with the function's JSON schema (strings stay strings; numbers,
  booleans, objects and arrays parse as JSON).
- ``nemotron_nano_v2``: Nemotron Nano v2, all calls of a turn in one JSON array,
  ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``.

Text outside the envelopes is content. A call's ``arguments`` is a JSON text: the
model's own text of the arguments value (so a streamed client sees exactly the bytes
the model wrote), or, where the model wrote it as a JSON string or as XML parameters,
that string decoded / the parameters serialised.

One state machine serves both modes. Every parser implements ``_parse(text, final)``, a
pure function of the output so far that returns the content that is safe to show (a
trailing partial envelope tag is held back until it resolves) and each call's name
(once complete) and arguments text so far; the result only grows as text is appended.
:meth:`ToolParser.extract` is ``_parse(text, final=True)``; the streaming side
(:meth:`ToolParser.feed`, :meth:`ToolParser.finish`) emits the growth since the last
call as OpenAI-shaped deltas: a call's id and name first, then argument string
fragments. Streamed in any split, the concatenated deltas equal the non-streamed
result.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output parsed: ``content`` is None when nothing but whitespace is left
    outside the calls."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """One call's part of a stream chunk, as OpenAI streams it: the first delta of a call
    carries its ``id`` and ``name``; later ones only ``arguments`` fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class _Parsed:
    content: str
    calls: list[tuple[str | None, str]]  # (name once complete, arguments text so far)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


# --- incremental JSON scanning ------------------------------------------------------

_WS = " \t\r\n"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at ``s[i] == '"'``, or None if incomplete."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int, final: bool) -> int | None:
    """Index after the JSON value starting at ``i``, or None if it may still grow."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if (j < len(s) or final) else None


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _partial_string(raw: str) -> str:
    """The decoded text of a JSON string's prefix ``raw`` (opening quote included, the
    closing one possibly absent), up to its last complete character or escape (so it
    only grows as ``raw`` does)."""
    out: list[str] = []
    i = 1
    while i < len(raw):
        c = raw[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        e = raw[i + 1]
        if e != "u":
            out.append(_ESCAPES.get(e, e))
            i += 2
            continue
        if i + 6 > len(raw):
            break
        code = int(raw[i + 2 : i + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or nothing
            if i + 12 > len(raw):
                break
            low = int(raw[i + 8 : i + 12], 16)
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
            i += 12
            continue
        out.append(chr(code))
        i += 6
    return "".join(out)


def _scan_call(s: str, i: int, final: bool) -> tuple[str | None, str, int | None]:
    """Scan a ``{"name": ..., "arguments": ...}`` object at ``s[i]``: the name (once its
    string is complete), the arguments text so far, and the index after the object
    (None while incomplete). ``parameters`` is taken as a synonym of ``arguments``."""
    name: str | None = None
    args = ""
    i = _skip_ws(s, i)
    if i >= len(s) or s[i] != "{":
        return None, "", None
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return name, args, None
        if s[i] == "}":
            return name, args, i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            return name, args, None  # not JSON: stop scanning, keep what is known
        key_end = _string_end(s, i)
        if key_end is None:
            return name, args, None
        key = json.loads(s[i:key_end])
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return name, args, None
        if s[i] != ":":
            return name, args, None
        v = _skip_ws(s, i + 1)
        end = _value_end(s, v, final)
        if key == "name":
            if end is not None and v < len(s) and s[v] == '"':
                name = json.loads(s[v:end])
        elif key in ("arguments", "parameters"):
            raw = s[v:end] if end is not None else s[v:]
            args = _partial_string(raw) if raw.startswith('"') else raw
        if end is None:
            return name, args, None
        i = end


def held_back(tail: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``tail`` that is a proper prefix of a tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(tail)), best, -1):
            if tail.endswith(tag[:k]):
                best = k
                break
    return best


# --- parsers --------------------------------------------------------------------------


class ToolParser:
    """Base: the streaming driver over a format's ``_parse``. One instance per output
    (it holds the stream's state). ``tools``: the request's tool definitions (OpenAI
    shape; the XML format reads parameter types from them)."""

    name = ""

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None,
                 id_factory: Callable[[], str] = new_call_id) -> None:
        self.tools = list(tools or [])
        self._new_id = id_factory
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._names_sent: list[bool] = []
        self._args_sent: list[int] = []

    def _parse(self, text: str, final: bool) -> _Parsed:
        raise NotImplementedError

    # -- non-streaming
    def extract(self, text: str) -> ExtractedToolCalls:
        parsed = self._parse(text, final=True)
        calls = [ToolCall(self._new_id(), name, args) for name, args in parsed.calls if name is not None]
        content = parsed.content if parsed.content.strip() else None
        return ExtractedToolCalls(content, calls)

    # -- streaming
    def feed(self, delta_text: str) -> StreamDelta:
        """Take the next piece of output text; returns what became safe to emit."""
        self._text += delta_text
        return self._diff(self._parse(self._text, final=False))

    def finish(self) -> StreamDelta:
        """The output ended: release held-back text and close the calls."""
        return self._diff(self._parse(self._text, final=True))

    def _diff(self, parsed: _Parsed) -> StreamDelta:
        out = StreamDelta(content=parsed.content[self._content_sent :])
        self._content_sent = len(parsed.content)
        for idx, (name, args) in enumerate(parsed.calls):
            if idx == len(self._ids):
                self._ids.append(self._new_id())
                self._names_sent.append(False)
                self._args_sent.append(0)
            if name is None:
                continue  # name first: nothing of a call goes out before its name
            delta = ToolCallDelta(index=self._index(idx))
            if not self._names_sent[idx]:
                self._names_sent[idx] = True
                delta.id, delta.name = self._ids[idx], name
            if len(args) > self._args_sent[idx]:
                delta.arguments = args[self._args_sent[idx] :]
                self._args_sent[idx] = len(args)
            if delta.name is not None or delta.arguments:
                out.tool_calls.append(delta)
        return out

    def _index(self, idx: int) -> int:
        """The OpenAI index of call ``idx``: its position among the named calls."""
        return sum(self._names_sent[:idx])

    def tool_schema(self, function: str) -> dict[str, Any]:
        for t in self.tools:
            fn = t.get("function", t)
            if fn.get("name") == function:
                return fn.get("parameters") or {}
        return {}


class _EnvelopeParser(ToolParser):
    """Calls inside ``start ... end`` envelopes; text between envelopes is content."""

    start = ""
    end = ""

    def _calls_in(self, body: str, final: bool) -> list[tuple[str | None, str]]:
        raise NotImplementedError

    def _parse(self, text: str, final: bool) -> _Parsed:
        content: list[str] = []
        calls: list[tuple[str | None, str]] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - held_back(tail, [self.start])]
                content.append(tail)
                break
            content.append(text[pos:i])
            body_start = i + len(self.start)
            j = text.find(self.end, body_start)
            closed = j >= 0
            calls += self._calls_in(text[body_start : j if closed else len(text)], final or closed)
            if not closed:
                break
            pos = j + len(self.end)
        return _Parsed("".join(content), calls)


class HermesToolParser(_EnvelopeParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _calls_in(self, body: str, final: bool) -> list[tuple[str | None, str]]:
        name, args, _ = _scan_call(body, 0, final)
        return [(name, args)]


class Granite4ToolParser(HermesToolParser):
    name = "granite4"


class NemotronNanoV2ToolParser(_EnvelopeParser):
    name = "nemotron_nano_v2"
    start = "<TOOLCALL>"
    end = "</TOOLCALL>"

    def _calls_in(self, body: str, final: bool) -> list[tuple[str | None, str]]:
        i = _skip_ws(body, 0)
        if i >= len(body) or body[i] != "[":
            return []
        i += 1
        calls = []
        while True:
            i = _skip_ws(body, i)
            if i < len(body) and body[i] == ",":
                i += 1
                continue
            if i >= len(body) or body[i] != "{":
                return calls
            name, args, end = _scan_call(body, i, final)
            calls.append((name, args))
            if end is None:
                return calls
            i = end


class Qwen3CoderToolParser(_EnvelopeParser):
    """The XML format. Arguments grow by whole parameters: ``{"p": v`` once the first
    parameter closes, ``, "q": w`` per further one, ``}`` when the function closes."""

    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"

    def _calls_in(self, body: str, final: bool) -> list[tuple[str | None, str]]:
        calls = []
        pos = 0
        while True:
            f = body.find("<function=", pos)
            if f < 0:
                return calls
            gt = body.find(">", f)
            if gt < 0:
                return calls
            name = body[f + len("<function=") : gt].strip()
            schema = self.tool_schema(name).get("properties") or {}
            fn_end = body.find("</function>", gt)
            region = body[gt + 1 : fn_end if fn_end >= 0 else len(body)]
            parts = []
            p = 0
            while True:
                s = region.find("<parameter=", p)
                if s < 0:
                    break
                pg = region.find(">", s)
                e = region.find("</parameter>", pg if pg >= 0 else s)
                if pg < 0 or e < 0:
                    # An unclosed last parameter counts once its function or the output ends.
                    if pg >= 0 and (fn_end >= 0 or final):
                        e = len(region)
                    else:
                        break
                pname = region[s + len("<parameter=") : pg].strip()
                value = _convert(region[pg + 1 : e], schema.get(pname, {}))
                parts.append(json.dumps(pname, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))
                p = e + len("</parameter>")
            args = ""
            if parts:
                args = "{" + ", ".join(parts)
            closed = fn_end >= 0 or final
            if closed:
                args = (args or "{") + "}"
            calls.append((name, args))
            if fn_end < 0:
                return calls
            pos = fn_end + len("</function>")


def _convert(raw: str, schema: dict[str, Any]) -> Any:
    """An XML parameter's value as the JSON value its schema asks for."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "granite4": Granite4ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "nemotron_v3": Qwen3CoderToolParser,
    "nemotron_nano_v2": NemotronNanoV2ToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError naming the choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--tool-call-parser {name!r} is not supported; choose one of {sorted(TOOL_PARSERS)}"
        ) from None
