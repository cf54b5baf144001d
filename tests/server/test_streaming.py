"""Streaming (server-sent events) through the official client: deltas concatenate to
the non-streamed text, which equals the offline API's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from hybridserve import SamplingParams

PROMPTS = ["def add(a, b):", "hello world", "x = [1, 2, 3]\nfor i in x:"]


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_ids(llm, messages: list[dict]) -> list[int]:
    """The test template rendered by hand (no Jinja), then tokenized."""
    eos = llm.tokenizer.eos_token
    text = "".join(f"<{m['role']}>{m['content']}{eos}\n" for m in messages) + "<assistant>"
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_streamed_completion_equals_whole_and_offline(oai, reference_llm) -> None:
    expected = reference_llm.generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False
    )
    for prompt, want in zip(PROMPTS, expected):
        whole = oai.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        chunks = list(
            oai.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text == want.outputs[0].text
        finals = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert finals == [whole.choices[0].finish_reason]
        # The last chunk carries the usage and no choices; the others carry usage: null.
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_equals_whole_and_offline(oai, reference_llm) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = chat_prompt_ids(reference_llm, messages)
    want = reference_llm.generate(
        [ids], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )[0]
    whole = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.outputs[0].text
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(
        oai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_max_completion_tokens_and_content_parts(oai, reference_llm) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        }
    ]
    ids = chat_prompt_ids(reference_llm, [{"role": "user", "content": "hi there"}])
    want = reference_llm.generate(
        [ids], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False
    )[0]
    r = oai.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=5, temperature=0
    )
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_logprobs_streamed_and_whole(oai) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "logprobs"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = oai.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        e
        for c in oai.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def test_stop_string_streamed(oai, reference_llm) -> None:
    prompt = "stop strings"
    full = (
        reference_llm.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    # A stop string taken from the middle of the greedy text (avoiding the replacement
    # character, which stands for bytes that are not text).
    clean = [i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0] : clean[0] + 2]
    cut = full[: full.index(stop)]
    whole = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
    )
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    chunks = list(
        oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_n_and_batch_streamed(oai) -> None:
    kw = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=0.9, seed=7, n=2)
    whole = oai.completions.create(**kw)
    texts: dict[int, str] = {}
    finished: dict[int, int] = {}
    for chunk in oai.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = finished.get(c.index, 0) + 1
    assert finished == {i: 1 for i in range(4)}
    assert texts == {c.index: c.text for c in whole.choices}


def test_sse_wire_format(client: httpx.Client) -> None:
    body = {"prompt": "wire", "max_tokens": 4, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("cmpl-")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        json.loads(ev[len("data: ") :])
