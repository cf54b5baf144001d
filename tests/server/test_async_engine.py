"""The engine worker thread on its own: joining a running batch, validation,
and stopping with requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.server.async_engine import AsyncEngine, EngineStopped


def test_requests_join_running_batch(chat_model, reference_llm) -> None:
    llm = LLM(chat_model, max_num_seqs=8)
    prompts = ["first", "second one", "third prompt"]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in reference_llm.generate(prompts, greedy, use_tqdm=False)]
    tok = llm.tokenizer

    async def run() -> list[str]:
        eng = AsyncEngine(llm.engine)
        eng.start()
        try:
            first = await eng.add_request("r0", tok.encode(prompts[0]), greedy, prompts[0])
            await first.next_output()  # r0 is running before the others arrive
            rest = [
                await eng.add_request(f"r{i}", tok.encode(p), greedy, p)
                for i, p in enumerate(prompts[1:], start=1)
            ]
            outs = [await s.final_output() for s in [first, *rest]]
            with pytest.raises(ValueError, match="prompt_token_ids"):
                await eng.add_request("bad", [10**6], greedy)
            stats = await eng.call(lambda e: e.stats())
            assert stats["requests_running"] == stats["requests_waiting"] == 0
            return [o.outputs[0].text for o in outs]
        finally:
            eng.shutdown()

    assert asyncio.run(run()) == want


def test_shutdown_with_requests_in_flight(chat_model) -> None:
    llm = LLM(chat_model, max_num_seqs=8)
    long = SamplingParams(max_tokens=3000, ignore_eos=True)

    async def run() -> None:
        eng = AsyncEngine(llm.engine)
        eng.start()
        stream = await eng.add_request("long", [5, 6, 7], long)
        await stream.next_output()
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(EngineStopped):
            await stream.final_output()
        with pytest.raises(EngineStopped):
            await eng.add_request("late", [5], long)
        assert not eng.running

    asyncio.run(run())
    # The worker is gone; its last act was to abort what ran and free its pages.
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()
