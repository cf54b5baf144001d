"""Real chat templates render as transformers' ``apply_chat_template`` renders them.

Two sources, nothing downloaded: the published models' templates vendored under
``tests/server/chat_templates/`` (their README names each model, the package they were
taken from and the licence), and the real ones that ship inside installed packages: the
tokenizer configs litellm bundles (Mistral, Llama 3, DeepSeek-R1), the default templates
of transformers' multimodal processors (Llama 4 with its tool format, SmolVLM,
Qwen2-Audio), and the embedded default model's (those are read from the packages' source
text, so neither package is imported for them). Each is rendered over a set of
conversations (system prompts, several turns, tools, single and parallel tool calls and
their results, reasoning in ``reasoning_content`` and in the content, thinking turned
off, documents, a continued final message; generation prompt on and off); both renderers
must give the same text, or both refuse the conversation."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from hybridserve.chat_template import ChatTemplateError, compile_chat_template, render_chat

ROOT = Path(__file__).resolve().parents[2]


def _package_file(package: str, *parts: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return path if path.is_file() else None


def _module_strings(path: Path, names: set[str]) -> dict[str, str]:
    """Module-level string constants (and string-returning properties) named ``names``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names and isinstance(node.value, ast.Constant):
                    found[t.id] = node.value.value
        elif isinstance(node, ast.FunctionDef) and node.name in names:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Constant):
                    found[node.name] = sub.value.value
    return {k: v for k, v in found.items() if isinstance(v, str) and "{%" in v}


def real_templates() -> dict[str, dict[str, Any]]:
    """name -> {"template", "bos_token", "eos_token"}."""
    out: dict[str, dict[str, Any]] = {}
    constants = _package_file("litellm", "constants.py")
    if constants is not None:
        tree = ast.parse(constants.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "known_tokenizer_config":
                for model, cfg in ast.literal_eval(node.value).items():
                    tok = cfg["tokenizer"]
                    out[f"litellm:{model}"] = {
                        "template": tok["chat_template"],
                        "bos_token": _text(tok.get("bos_token")),
                        "eos_token": _text(tok.get("eos_token")),
                    }
    for model, names in (("llama4", {"chat_template"}), ("smolvlm", {"DEFAULT_CHAT_TEMPLATE"}),
                         ("qwen2_audio", {"default_chat_template"})):
        path = _package_file("transformers", "models", model, f"processing_{model}.py")
        if path is None:
            continue
        for name, text in _module_strings(path, names).items():
            out[f"transformers:{model}.{name}"] = {"template": text, "bos_token": "<s>", "eos_token": "</s>"}
    cfg = json.loads((ROOT / "hybridserve" / "default_model" / "tokenizer_config.json").read_text())
    out["hybridserve:default_model"] = {
        "template": cfg["chat_template"], "bos_token": cfg["bos_token"], "eos_token": cfg["eos_token"],
    }
    return out


VENDORED = ROOT / "tests" / "server" / "chat_templates"


def vendored_templates() -> dict[str, dict[str, Any]]:
    """The published models' templates kept as test data: name -> spec."""
    return {
        f"model:{path.stem}": {"template": path.read_text(encoding="utf-8"), "bos_token": "<s>", "eos_token": "</s>"}
        for path in sorted(VENDORED.glob("*.jinja"))
    }


def _text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    # Arguments as an object: what the server hands templates (they write it with tojson).
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS: dict[str, dict[str, Any]] = {
    "one_user": {"messages": [{"role": "user", "content": "Hello <b>&</b> there"}]},
    "system_first": {"messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "hi"}]},
    "multi_turn": {"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hello! How can I help?"},
                                {"role": "user", "content": "A joke,\nplease."}]},
    "with_tools": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
    "tool_call_history": {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": TOOLS,
    },
    "system_and_tools": {"messages": [{"role": "system", "content": "You help."},
                                      {"role": "user", "content": "Weather in Oslo?"}], "tools": TWO_TOOLS},
    "parallel_calls": {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Oslo and Rome?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [
                _call(1, "get_weather", {"city": "Oslo"}), _call(2, "get_weather", {"city": "Rome", "unit": "c"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "Oslo is sunny, Rome 21C."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": TWO_TOOLS,
    },
    "reasoning_history": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "and 3+3?"}]},
    "think_in_content": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "ok"}]},
    "reasoning_then_call": {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
             "tool_calls": [_call(1, "get_weather", {"city": "Oslo"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        "tools": TWO_TOOLS,
    },
    "thinking_off": {"messages": [{"role": "user", "content": "quick: hi"}],
                     "kwargs": {"enable_thinking": False}},
    "documents": {"messages": [{"role": "user", "content": "What does the note say?"}],
                  "kwargs": {"documents": [{"title": "Note", "text": "The sky is green."}]}},
    "continue_final": {"messages": [{"role": "user", "content": "Write a haiku."},
                                    {"role": "assistant", "content": "Autumn moonlight,"}],
                       "continue": True},
}

TEMPLATES = {**real_templates(), **vendored_templates()}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory, byte_tokenizer) -> Any:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tok")
    byte_tokenizer(path)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


def test_the_real_templates_were_found() -> None:
    # What the installed packages ship today; a package update that moves them fails here.
    assert len(TEMPLATES) - len(vendored_templates()) >= 6, sorted(TEMPLATES)
    # Every vendored template is listed, with its model, in the README, and vice versa.
    readme = (VENDORED / "README.md").read_text(encoding="utf-8")
    listed = {line.split("`")[1] for line in readme.splitlines() if line.startswith("| `")}
    assert listed == {p.name for p in VENDORED.glob("*.jinja")}
    assert len(listed) >= 30


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(name: str, hf_tokenizer: Any) -> None:
    spec = TEMPLATES[name]
    ours = compile_chat_template(spec["template"])
    hf_tokenizer.bos_token = spec["bos_token"]
    hf_tokenizer.eos_token = spec["eos_token"]
    compared = 0
    for conv_name, conv in CONVERSATIONS.items():
        cont = bool(conv.get("continue"))
        # transformers refuses a generation prompt after a message being continued.
        for gen in (False,) if cont else (True, False):
            extra = {"tools": conv["tools"]} if "tools" in conv else {}
            extra.update(conv.get("kwargs", {}))
            try:
                want = hf_tokenizer.apply_chat_template(
                    conv["messages"], tokenize=False, add_generation_prompt=gen,
                    continue_final_message=cont, chat_template=spec["template"], **extra,
                )
            except Exception as e:  # the template refuses this conversation
                with pytest.raises(ChatTemplateError):
                    render_chat(ours, conv["messages"], add_generation_prompt=gen, continue_final_message=cont,
                                bos_token=spec["bos_token"], eos_token=spec["eos_token"], **extra)
                # The template's own failure (jinja2's errors, or Python's from its code),
                # not a crash of the comparison.
                assert isinstance(e, (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
                                      IndexError, AttributeError)), repr(e)
                continue
            got = render_chat(ours, conv["messages"], add_generation_prompt=gen, continue_final_message=cont,
                              bos_token=spec["bos_token"], eos_token=spec["eos_token"], **extra)
            assert got == want, (conv_name, gen)
            compared += 1
    assert compared >= 2, f"{name}: too few conversations rendered to compare"


# The server's own path: an OpenAI request (tool-call arguments as JSON text, content as
# text parts, reasoning_content on an assistant turn) through the chat handler's message
# conversion and rendering, against transformers over the messages a client library
# would hand it (arguments as objects, content as one string).
API_CASES: dict[str, dict[str, Any]] = {
    "tools_calls_results": {
        "request": {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": "Oslo and Rome?"},
                {"role": "assistant", "content": None, "reasoning_content": "Both cities.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            ],
            "tools": TWO_TOOLS,
        },
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Oslo and Rome?"},
            {"role": "assistant", "reasoning_content": "Both cities.", "tool_calls": [
                _call(1, "get_weather", {"city": "Oslo"}), _call(2, "get_weather", {"city": "Rome", "unit": "c"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        ],
        "kwargs": {"tools": TWO_TOOLS},
    },
    "thinking_off_documents": {
        "request": {"messages": [{"role": "user", "content": "What does the note say?"}],
                    "chat_template_kwargs": {"enable_thinking": False},
                    "documents": [{"title": "Note", "text": "The sky is green."}]},
        "messages": [{"role": "user", "content": "What does the note say?"}],
        "kwargs": {"enable_thinking": False, "documents": [{"title": "Note", "text": "The sky is green."}]},
    },
    "continue_final": {
        "request": {"messages": [{"role": "user", "content": "Write a haiku."},
                                 {"role": "assistant", "content": "Autumn moonlight,"}],
                    "add_generation_prompt": False, "continue_final_message": True},
        "messages": [{"role": "user", "content": "Write a haiku."},
                     {"role": "assistant", "content": "Autumn moonlight,"}],
        "kwargs": {"add_generation_prompt": False, "continue_final_message": True},
    },
}


@pytest.fixture(scope="module")
def byte_tokenizers(tmp_path_factory: pytest.TempPathFactory, byte_tokenizer) -> tuple[Any, Any]:
    """(the server's tokenizer, transformers' over the same files)."""
    transformers = pytest.importorskip("transformers")
    from hybridserve.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("server-tok")
    byte_tokenizer(path, "{{ messages }}", eos_special=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "Ā"  # byte 1's character: templates that write a BOS get one
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                                   bos_token=ours.bos_token, eos_token=ours.eos_token)
    return ours, theirs


@pytest.mark.parametrize("name", sorted(vendored_templates()))
def test_the_server_renders_requests_as_transformers(name: str, byte_tokenizers: tuple[Any, Any]) -> None:
    import asyncio

    from hybridserve.server.protocol import ChatCompletionRequest
    from hybridserve.server.serving import APIError, OpenAIServing, ServingConfig

    ours, theirs = byte_tokenizers
    source = vendored_templates()[name]["template"]
    serving = OpenAIServing(None, ServingConfig(  # the engine is not needed to render
        model_name="m", model_aliases=frozenset({"m"}), max_model_len=1 << 20, tokenizer=ours,
        chat_template=compile_chat_template(source)))
    try:
        compared = 0
        for case, spec in API_CASES.items():
            req = ChatCompletionRequest.model_validate({"model": "m", **spec["request"]})
            tools = [t.to_dict() for t in req.tools or []]
            try:
                want = theirs.apply_chat_template(spec["messages"], tokenize=False, chat_template=source,
                                                  **{"add_generation_prompt": True, **spec["kwargs"]})
            except Exception:
                with pytest.raises(APIError):
                    asyncio.run(serving._chat_prompt(req, tools))
                continue
            text, ids = asyncio.run(serving._chat_prompt(req, tools))
            assert text == want, case
            assert ids == ours.encode(want, add_special_tokens=False)
            compared += 1
        assert compared >= 1, f"{name}: no request rendered to compare"
    finally:
        serving.close()
