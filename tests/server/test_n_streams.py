"""Streams with ``n > 1`` under load: every choice index gets exactly one chunk with a
``finish_reason``, even when its sibling choices keep running for more steps."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx

N = 4
# Half the vocabulary stops a choice, so seeded sampling ends the choices of one
# request at different steps (and a few run to max_tokens).
STOP_IDS = list(range(0, 256, 2))
MAX_TOKENS = 10


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    chunks = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
    return chunks


def _per_choice(chunks: list[dict]) -> tuple[Counter, Counter]:
    """Finish chunks and tokens (counted from the logprobs) per choice index."""
    finishes: Counter = Counter()
    tokens: Counter = Counter()
    for chunk in chunks:
        for choice in chunk["choices"]:
            lps = choice.get("logprobs") or {}
            tokens[choice["index"]] += len(lps.get("tokens") or lps.get("content") or [])
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] += 1
    return finishes, tokens


def test_one_finish_chunk_per_choice_under_load(server) -> None:
    common = {
        "n": N,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "stop_token_ids": STOP_IDS,
        "stream": True,
    }
    requests = []
    cmpl = {**common, "logprobs": 0}
    chat = {**common, "logprobs": True, "top_logprobs": 0}
    for i in range(6):
        requests.append(("/v1/completions", {**cmpl, "prompt": f"load {i}", "seed": i}, N))
    for i in range(2):  # batches: choice i * n + j
        body = {**cmpl, "prompt": [f"batch {i} a", f"batch {i} b"], "seed": 100 + i}
        requests.append(("/v1/completions", body, 2 * N))
    for i in range(6):
        msgs = [{"role": "user", "content": f"chat {i}"}]
        requests.append(("/v1/chat/completions", {**chat, "messages": msgs, "seed": i}, N))

    async def run_all() -> list[list[dict]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream(client, path, body) for path, body, _ in requests)),
                timeout=150,
            )

    results = asyncio.run(run_all())
    staggered = 0
    for (path, body, num_choices), chunks in zip(requests, results):
        finishes, tokens = _per_choice(chunks)
        assert sorted(finishes) == list(range(num_choices)), (path, body, finishes)
        assert all(count == 1 for count in finishes.values()), (path, body, finishes)
        # The finish chunk is each choice's last.
        last = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                last[choice["index"]] = choice["finish_reason"]
        assert all(reason is not None for reason in last.values()), last
        assert all(1 <= tokens[i] <= MAX_TOKENS for i in range(num_choices)), tokens
        staggered += len(set(tokens.values())) > 1
    # The load really had sibling choices finishing at different steps.
    assert staggered >= len(requests) // 2, staggered
    server.wait_idle()
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
