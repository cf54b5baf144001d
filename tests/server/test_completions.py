"""Completions over HTTP equal the offline API; models, health and the error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from hybridserve import SamplingParams

PROMPTS = ["def add(a, b):", "hello world", "The quick brown fox", "x = [1, 2, 3]\nfor i in x:"]


def offline_texts(llm, prompts, **kw) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    return [c.text for o in outs for c in o.outputs]


def test_models_and_health(client: httpx.Client) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    (model,) = r.json()["data"]
    assert model["id"] == "tiny" and model["object"] == "model"
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_greedy_completions_equal_offline(server, reference_llm) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    expected = offline_texts(reference_llm, PROMPTS, max_tokens=12, temperature=0)
    for prompt, want in zip(PROMPTS, expected):
        resp = oai.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert resp.choices[0].text == want
        assert resp.choices[0].finish_reason in ("length", "stop")
        assert resp.usage.prompt_tokens == len(reference_llm.tokenizer.encode(prompt))
        assert resp.usage.completion_tokens == 12 or resp.choices[0].finish_reason == "stop"


def test_batch_prompts_and_n(client: httpx.Client, reference_llm) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[:3], "max_tokens": 6, "temperature": 0, "n": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    expected = offline_texts(reference_llm, PROMPTS[:3], max_tokens=6, temperature=0)
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    # Choice i * n + j is sequence j of prompt i; greedy sequences of one prompt agree.
    assert [c["text"] for c in choices] == [t for t in expected for _ in range(2)]
    assert data["usage"]["completion_tokens"] == 6 * 6


def test_token_id_prompt_and_logprobs(client: httpx.Client, reference_llm) -> None:
    ids = reference_llm.tokenizer.encode("token ids work too")
    outs = reference_llm.generate(
        [ids], SamplingParams(max_tokens=5, temperature=0, logprobs=2), use_tqdm=False
    )
    want = outs[0].outputs[0]
    r = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": ids,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 2,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    tok = reference_llm.tokenizer
    assert choice["text"] == want.text
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    for got, cands, t in zip(lp["token_logprobs"], want.logprobs, want.token_ids):
        assert got == pytest.approx(cands[t].logprob, abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    body = {"prompt": "seeded", "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    texts = [
        client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_cached_tokens_reported(client: httpx.Client) -> None:
    # A long shared prefix is checkpointed by the first request and hit by the second.
    prefix = "shared prefix " * 12
    client.post("/v1/completions", json={"prompt": prefix + "one", "max_tokens": 2})
    r = client.post("/v1/completions", json={"prompt": prefix + "two", "max_tokens": 2})
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0
    assert details["cached_tokens"] < r.json()["usage"]["prompt_tokens"]
