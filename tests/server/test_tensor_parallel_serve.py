"""The OpenAI server over a two-rank tensor-parallel engine (gloo on the CPU), with the
host tier of checkpoints on: the same completions as one rank serving the same requests
in the same order, with the same checkpoints offloaded and restored. (That the copies run
on every rank is checked directly in tests/distributed/test_tensor_parallel.py: here a
restore often lands in the page the checkpoint left, which still holds it.)"""

from __future__ import annotations

import httpx
import pytest

from hybridserve import LLM, SamplingParams

OPTIONS = dict(max_num_seqs=2, max_model_len=256, num_kv_blocks=96, num_state_pages=10,
               state_interval=16, max_checkpoint_pages=1, checkpoint_offload_pages=16)


@pytest.mark.slow
def test_served_tp2_with_host_tier_matches_one_rank(tiny_granite, server_factory):
    shared = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2
    other = "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 2
    # Prompts that share a prefix, with unrelated ones between them that take the pages.
    prompts = [shared + "    x = ", other + "a", shared + "    y = [", other + "b",
               shared + "    return f"]
    one = LLM(tiny_granite, **OPTIONS)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    # One at a time, as the requests below reach the server.
    want = [one.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    srv = server_factory(tiny_granite, tensor_parallel_size=2, **OPTIONS)
    try:
        got = []
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            for prompt in prompts:
                r = c.post("/v1/completions", json={
                    "model": tiny_granite.name, "prompt": prompt, "max_tokens": 12,
                    "temperature": 0.0,
                })
                assert r.status_code == 200, r.text
                got.append(r.json()["choices"][0]["text"])
        assert got == want
        stats = srv.wait_idle()
        # One device checkpoint page: the shared prefix's checkpoints went to the host
        # tier and came back, as they did on one rank.
        assert stats["host_checkpoints_offloaded"] > 0 and stats["host_checkpoints_restored"] > 0
        assert stats["host_checkpoints_restored"] == one.stats()["host_checkpoints_restored"]
    finally:
        srv.engine.engine.runner.close()
