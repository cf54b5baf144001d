"""The per-request prefix-cache report: ``usage.prompt_tokens_details.cached_tokens``
(vLLM's ``--enable-prompt-tokens-details``, on by default here) is the hit the engine
took for that request, the same tokens ``/metrics`` counts as prefix-cache hits; the
``x-hybridserve-predicted-cached-tokens`` header is the hit the caches held when the
prompt arrived."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.server.serving import PREDICTED_CACHED_HEADER

HITS = "hybridserve:prefix_cache_hits"
PREDICTED = "hybridserve:prefix_cache_predicted_hits"
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short line. " * 2}


def _hits(c: httpx.Client, name: str = HITS) -> float:
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name == name:
            return next(s.value for s in family.samples if s.name == name + "_total")
    raise AssertionError(f"{name} missing from /metrics")


def _ask(c: httpx.Client, path: str, stream: bool, **body: Any) -> tuple[dict[str, Any], httpx.Headers, str]:
    """(usage, headers, output text) of one request; streamed with include_usage."""
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    if not stream:
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return r.json()["usage"], r.headers, choice["message"]["content"] if "message" in choice else choice["text"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join((ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
                   for chunk in chunks for ch in chunk["choices"])
    assert all(chunk["usage"] is None for chunk in chunks[:-1]) and not chunks[-1]["choices"]
    return chunks[-1]["usage"], headers, text


def _counted(c: httpx.Client, path: str, stream: bool, **body: Any) -> tuple[int, int, int, str]:
    """(cached_tokens, the hit /metrics counted for the request, the predicted hit, text)."""
    before, predicted_before = _hits(c), _hits(c, PREDICTED)
    use, headers, text = _ask(c, path, stream, **body)
    cached = use["prompt_tokens_details"]["cached_tokens"]
    predicted = int(headers[PREDICTED_CACHED_HEADER])
    assert _hits(c, PREDICTED) - predicted_before == predicted  # /metrics counts the prediction too
    return cached, int(_hits(c) - before), predicted, text


@pytest.fixture(scope="module")
def cached_server(chat_model: Any, launch: Any) -> Iterator[Any]:
    srv = launch(chat_model, served_model_name="tiny", state_interval=16)
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_second_chat_turn_reports_its_hit(cached_server: Any, stream: bool) -> None:
    bs = cached_server.engine.engine.config.cache.kv_block_size
    # Its own system prompt: a prefix no other test sends.
    system = {"role": "system", "content": f"[{'streamed' if stream else 'whole'}] " + SYSTEM["content"]}
    user = {"role": "user", "content": "first question?"}
    with httpx.Client(base_url=cached_server.base_url, timeout=120) as c:
        first, counted, predicted, reply = _counted(c, "/v1/chat/completions", stream, messages=[system, user])
        # A conversation never seen: nothing cached, and nothing counted or predicted.
        assert first == counted == predicted == 0
        history = [system, user, {"role": "assistant", "content": reply},
                   {"role": "user", "content": "and a follow-up?"}]
        second, counted, predicted, _ = _counted(c, "/v1/chat/completions", stream, messages=history)
    assert second > 0 and second % bs == 0
    assert second == counted  # the engine's own count of this request's hit
    assert predicted == second  # nothing changed the caches between arrival and admission


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_report_their_hit(cached_server: Any, stream: bool) -> None:
    prefix = f"[{'streamed' if stream else 'whole'}] a long shared document. " * 3
    with httpx.Client(base_url=cached_server.base_url, timeout=120) as c:
        first, counted, predicted, _ = _counted(c, "/v1/completions", stream, prompt=prefix + "Q1")
        assert first == counted == predicted == 0
        second, counted, predicted, _ = _counted(c, "/v1/completions", stream, prompt=prefix + "Q2")
    assert 0 < second == counted == predicted <= len(prefix + "Q")  # the shared bytes (tokens)


def test_batched_prompts_sum_their_hits(cached_server: Any) -> None:
    prefix = "the batch's shared instructions, long enough for blocks. " * 2
    with httpx.Client(base_url=cached_server.base_url, timeout=120) as c:
        _counted(c, "/v1/completions", False, prompt=prefix + "seed")
        cached, counted, predicted, _ = _counted(c, "/v1/completions", False,
                                                 prompt=[prefix + "a", prefix + "b"])
    assert cached == counted == predicted > 0


def test_without_prefix_caching_nothing_is_cached(chat_model: Any, server_factory: Any) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", enable_prefix_caching=False)
    body = {"messages": [SYSTEM, {"role": "user", "content": "same question twice"}]}
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        for stream in (False, True, False):
            cached, counted, predicted, _ = _counted(c, "/v1/chat/completions", stream, **body)
            assert cached == counted == predicted == 0


def test_details_off_leave_the_field_null(chat_model: Any, server_factory: Any) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", enable_prompt_tokens_details=False)
    prompt = "a prompt repeated, so that the cache would have it. " * 3
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        for stream in (False, True):
            use, headers, _ = _ask(c, "/v1/completions", stream, prompt=prompt)
            assert use["prompt_tokens_details"] is None and use["prompt_tokens"] > 0
            assert PREDICTED_CACHED_HEADER not in headers
        # The engine still caches: only the report is off.
        assert _hits(c) > 0


def test_the_flag_parses() -> None:
    import argparse

    from hybridserve.server.cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args([]).enable_prompt_tokens_details is True
    assert p.parse_args(["--enable-prompt-tokens-details"]).enable_prompt_tokens_details is True
    assert p.parse_args(["--no-enable-prompt-tokens-details"]).enable_prompt_tokens_details is False


def test_prediction_is_read_only_and_can_differ(chat_model: Any) -> None:
    """Offline: the prediction marks no checkpoint used, and it is what the caches
    held at arrival: a checkpoint evicted before admission makes the hit smaller."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(chat_model, max_num_seqs=4, state_interval=16)
    engine = llm.engine
    prompt = list(range(40, 40 + 50))
    sp = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([prompt], sp, use_tqdm=False)
    states = engine.scheduler.states
    clock = states.clock
    engine.add_request("again", prompt + [7], sp)
    predicted = engine.predicted_cached_tokens("again")
    assert predicted == 48 and states.clock == clock
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].num_cached_tokens == predicted == outs[-1].metrics["predicted_cached_tokens"]
    engine.add_request("evicted", prompt + [8], sp)
    assert engine.predicted_cached_tokens("evicted") == 48
    engine.scheduler.clear_prefix_cache()
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].metrics["predicted_cached_tokens"] == 48 and outs[-1].num_cached_tokens == 0
