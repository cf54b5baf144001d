"""Many clients at once: every request completes exactly once, equal to its offline
result, while new requests keep joining the running batch."""

from __future__ import annotations

import asyncio

import openai

from hybridserve import SamplingParams

NUM_REQUESTS = 200
MAX_TOKENS = 8


def test_200_concurrent_streams(server, reference_llm) -> None:
    prompts = [f"request {i}: {'ab' * (i % 7)} tail" for i in range(NUM_REQUESTS)]
    expected = [
        o.outputs[0].text
        for o in reference_llm.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False
        )
    ]
    before = server.engine.stats()["requests_finished"]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, list[str]]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        ids, text, reasons = set(), "", []
        async for chunk in stream:
            ids.add(chunk.id)
            for c in chunk.choices:
                assert c.index == 0
                text += c.text
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        (rid,) = ids
        return rid, text, reasons

    async def run_all() -> list[tuple[str, str, list[str]]]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=150
            )

    results = asyncio.run(run_all())
    assert len(results) == NUM_REQUESTS
    assert len({rid for rid, _, _ in results}) == NUM_REQUESTS  # no response reused
    for i, ((_, text, reasons), want) in enumerate(zip(results, expected)):
        assert len(reasons) == 1, f"request {i} finished {len(reasons)} times"
        assert text == want, f"request {i} differs from the offline result"
    stats = server.wait_idle()
    assert stats["requests_finished"] - before == NUM_REQUESTS
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
