"""Real chat templates render as transformers' ``apply_chat_template`` renders them.

The templates are the real ones that ship inside installed packages (nothing is
downloaded): the tokenizer configs litellm bundles (Mistral, Llama 3, DeepSeek-R1),
the default templates of transformers' multimodal processors (Llama 4 with its tool
format, SmolVLM, Qwen2-Audio), and the embedded default model's. They are read from
the packages' source text, so neither package is imported for them. Each is rendered
over a set of conversations (system turns, multi-turn, tools, tool calls and results,
generation prompt on and off); both renderers must give the same text, or both
refuse the conversation."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

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


def _text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

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
}

TEMPLATES = real_templates()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory, byte_tokenizer) -> Any:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tok")
    byte_tokenizer(path)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


def test_the_real_templates_were_found() -> None:
    # What the installed packages ship today; a package update that moves them fails here.
    assert len(TEMPLATES) >= 6, sorted(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(name: str, hf_tokenizer: Any) -> None:
    spec = TEMPLATES[name]
    ours = compile_chat_template(spec["template"])
    hf_tokenizer.bos_token = spec["bos_token"]
    hf_tokenizer.eos_token = spec["eos_token"]
    compared = 0
    for conv_name, conv in CONVERSATIONS.items():
        for gen in (True, False):
            extra = {"tools": conv["tools"]} if "tools" in conv else {}
            try:
                want = hf_tokenizer.apply_chat_template(
                    conv["messages"], tokenize=False, add_generation_prompt=gen,
                    chat_template=spec["template"], **extra,
                )
            except Exception as e:  # the template refuses this conversation
                with pytest.raises(ChatTemplateError):
                    render_chat(ours, conv["messages"], add_generation_prompt=gen,
                                bos_token=spec["bos_token"], eos_token=spec["eos_token"], **extra)
                assert type(e).__name__ in ("TemplateError", "TypeError", "UndefinedError",
                                            "ValueError", "KeyError")
                continue
            got = render_chat(ours, conv["messages"], add_generation_prompt=gen,
                              bos_token=spec["bos_token"], eos_token=spec["eos_token"], **extra)
            assert got == want, (conv_name, gen)
            compared += 1
    assert compared >= 2, f"{name}: too few conversations rendered to compare"
