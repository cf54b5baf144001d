"""Every stream says why it ended: exactly one chunk per choice carries a
``finish_reason``, it is the last chunk of that choice, and it is the reason the
non-streamed response gives, for completions and chat, when a stop string, a stop
token, the length limit or EOS ends the sequence. Cases include finals that add no
text: a stop string's first character is held back until the next token shows whether
it completes the stop string, so when it does, the final output adds nothing and the
finish chunk is all that step has to send. Streams here are ``n = 1``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from hybridserve import LLM, SamplingParams


def _events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON chunks of one streamed request (the wire format, no client library)."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [ev for ev in raw.split("\n\n") if ev]
    assert events[-1] == "data: [DONE]"
    return [json.loads(ev.removeprefix("data: ")) for ev in events[:-1]]


def _text_of(chunk_choice: dict, chat: bool) -> str:
    if chat:
        return chunk_choice["delta"].get("content") or ""
    return chunk_choice["text"]


def _check_stream(client: httpx.Client, chat: bool, body: dict, reason: str) -> str:
    """Stream ``body`` and request it whole; assert one finish chunk, last, with
    ``reason``, and the same text both ways. Returns the text."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    whole = client.post(path, json=body)
    assert whole.status_code == 200, whole.text
    (choice,) = whole.json()["choices"]
    assert choice["finish_reason"] == reason
    want = choice["message"]["content"] if chat else choice["text"]
    chunks = _events(client, path, body)
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert all(c["index"] == 0 for c in choices)
    finals = [i for i, c in enumerate(choices) if c["finish_reason"] is not None]
    assert len(finals) == 1, f"{len(finals)} finish chunks in {choices}"
    assert finals[0] == len(choices) - 1, "a chunk came after the finish chunk"
    assert choices[-1]["finish_reason"] == reason
    assert "".join(_text_of(c, chat) for c in choices) == want
    return want


def _greedy(llm: LLM, prompt, n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


PROMPT = "why it ended"
MESSAGES = [{"role": "user", "content": "why it ended"}]


def _prompt_ids(llm: LLM, chat: bool):
    if not chat:
        return llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    eos = llm.tokenizer.eos_token
    text = "".join(f"<{m['role']}>{m['content']}{eos}\n" for m in MESSAGES) + "<assistant>"
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _body(chat: bool, **kw) -> dict:
    body = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    return {**body, "temperature": 0, "max_tokens": 10, **kw}


CHAT = pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])


@CHAT
def test_length(client, chat) -> None:
    assert _check_stream(client, chat, _body(chat, max_tokens=5, ignore_eos=True), "length")


@CHAT
@pytest.mark.parametrize("where", ["first", "middle"])
def test_stop_string(client, reference_llm, chat, where) -> None:
    tokens = _greedy(reference_llm, _prompt_ids(reference_llm, chat), 10)
    text = reference_llm.tokenizer.decode(tokens)
    # One printable byte-level character per token: pick a two-character stop string
    # whose characters are whole tokens.
    starts = [i for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    start = starts[0] if where == "first" else starts[len(starts) // 2]
    stop = text[start : start + 2]
    got = _check_stream(client, chat, _body(chat, stop=[stop], ignore_eos=True), "stop")
    assert got == text[: text.index(stop)]


@CHAT
@pytest.mark.parametrize("position", [0, 3])
def test_stop_token(client, reference_llm, chat, position) -> None:
    tokens = _greedy(reference_llm, _prompt_ids(reference_llm, chat), 10)
    stop = tokens[position]
    got = _check_stream(client, chat, _body(chat, stop_token_ids=[stop], ignore_eos=True), "stop")
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
    offline = reference_llm.generate([_prompt_ids(reference_llm, chat)], params, use_tqdm=False)
    assert offline[0].outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert got == offline[0].outputs[0].text


@pytest.fixture(scope="module")
def eos_model(chat_model, reference_llm, tmp_path_factory) -> Path:
    """A copy of the chat model whose EOS is a token of the greedy chat answer, first
    generated as its third token or later (so greedy generation ends on EOS within ten
    tokens, after some text)."""
    tokens = _greedy(reference_llm, _prompt_ids(reference_llm, True), 10)
    eos = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(chat_model, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_eos(eos_model, server_factory, reference_llm) -> None:
    srv = server_factory(eos_model, served_model_name="tiny")
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        # Completions get the chat prompt's token ids: the same greedy answer.
        ids = _prompt_ids(reference_llm, True)  # the same tokenizer
        for chat, extra in ((False, {"prompt": ids}), (True, {})):
            _check_stream(client, chat, _body(chat, max_tokens=16, **extra), "stop")
            # The same request with EOS ignored runs to its length.
            body = _body(chat, max_tokens=16, ignore_eos=True, **extra)
            _check_stream(client, chat, body, "length")
