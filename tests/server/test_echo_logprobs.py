"""``/v1/completions`` with ``echo``, prompt logprobs and ``logit_bias`` over HTTP, and
lm-eval's ``local-completions`` loglikelihood and multiple-choice scoring against the
server, checked against log-likelihoods the offline engine computes itself."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve import SamplingParams


@pytest.fixture(scope="module")
def info_server(chat_model: Path, launch) -> Iterator[Any]:
    """The chat model served with ``/tokenizer_info`` (lm-eval's remote tokenizer)."""
    srv = launch(chat_model, served_model_name="tiny", enable_tokenizer_info_endpoint=True)
    yield srv
    srv.stop()


@pytest.fixture
def c(info_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=info_server.base_url, timeout=120) as client:
        yield client


def engine_prompt_logprobs(llm, ids: list[int], k: int = 0) -> list[dict | None]:
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out.prompt_logprobs


def loglikelihood(llm, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The engine's own log P(continuation | context) and whether it is greedy."""
    ids = context + continuation
    lps = engine_prompt_logprobs(llm, ids, 1)
    total, greedy = 0.0, True
    for p in range(len(context), len(ids)):
        entry = lps[p]
        total += entry[ids[p]].logprob
        greedy &= entry[ids[p]].rank == 1
    return total, greedy


def test_echo_returns_the_prompt_and_its_logprobs(c, reference_llm) -> None:
    tok = reference_llm.tokenizer
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                        "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (gen,) = reference_llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, logprobs=2),
                                    use_tqdm=False)
    assert choice["text"] == prompt + gen.outputs[0].text
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 3
    assert "".join(lp["tokens"][:n]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = engine_prompt_logprobs(reference_llm, ids, 2)
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(want[p][ids[p]].logprob, abs=1e-5)
        # The 2 most likely tokens and the prompt's own (3 when it is not among them).
        assert 2 <= len(lp["top_logprobs"][p]) <= 3
    for j, t in enumerate(gen.outputs[0].token_ids):
        assert lp["token_logprobs"][n + j] == pytest.approx(gen.outputs[0].logprobs[j][t].logprob, abs=1e-5)
    offsets = lp["text_offset"]
    assert offsets == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(offsets))]


def test_echo_without_logprobs_and_with_token_prompts(c, reference_llm) -> None:
    ids = reference_llm.tokenizer.encode("token prompt")
    r = c.post("/v1/completions", json={"prompt": [ids, ids[:5]], "max_tokens": 2,
                                        "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    tok = reference_llm.tokenizer
    texts = [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
    assert texts[0].startswith(tok.decode(ids, skip_special_tokens=False))
    assert texts[1].startswith(tok.decode(ids[:5], skip_special_tokens=False))
    assert r.json()["choices"][0]["logprobs"] is None


def test_prompt_logprobs_field_as_vllm(c, reference_llm) -> None:
    ids = reference_llm.tokenizer.encode("prompt logprobs over http")
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    want = engine_prompt_logprobs(reference_llm, ids, 3)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert set(got[p]) == {str(t) for t in want[p]}
        for t, lp in want[p].items():
            assert got[p][str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert got[p][str(t)]["rank"] == lp.rank


def test_streamed_echo_equals_the_whole_response(c) -> None:
    body = {"prompt": "stream me", "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1}
    whole = c.post("/v1/completions", json=body).json()["choices"][0]
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert text == whole["text"]
    tokens = [t for ch in chunks if ch["choices"][0]["logprobs"]
              for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    lps = [v for ch in chunks if ch["choices"][0]["logprobs"]
           for v in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == whole["logprobs"]["token_logprobs"]


def test_logit_bias_over_http(c, reference_llm) -> None:
    tok = reference_llm.tokenizer
    target = tok.encode("Z")[0]
    r = c.post("/v1/completions", json={"prompt": "bias", "max_tokens": 4, "temperature": 0,
                                        "ignore_eos": True, "logit_bias": {str(target): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ZZZZ"
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "logit_bias": {str(target): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ZZZ"
    for bad in ({"x": 1}, {"-3": 1}, {"99999": 1}):
        r = c.post("/v1/completions", json={"prompt": "bias", "logit_bias": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "logit_bias"


def test_tokenizer_info(c, reference_llm, chat_template_text) -> None:
    info = c.get("/tokenizer_info").json()
    tok = reference_llm.tokenizer
    assert info["eos_token"] == tok.eos_token and info["eos_token_id"] == tok.eos_token_id
    assert info["chat_template"] == chat_template_text
    assert info["model_max_length"] == reference_llm.config.scheduler.max_model_len


def test_tokenizer_info_is_off_by_default(client) -> None:
    assert client.get("/tokenizer_info").status_code == 404


# ---- lm-eval ---------------------------------------------------------------------

# Contexts end in a non-space so lm-eval's trailing-space move does not apply.
PAIRS = [
    ("The capital of France is", " Paris"),
    ("def add(a, b):", "\n    return a + b"),
    ("1, 2, 3,", " 4, 5"),
]

# lm-eval scores "question" + " " + choice (its default target delimiter).
MC_DOCS = [
    {"question": "Question: 2 + 2 =", "choices": ["4", "5", "fish"], "answer": 0},
    {"question": "Question: the sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Question: a cat says", "choices": ["woof", "meow", "moo"], "answer": 1},
    {"question": "Question: ice is", "choices": ["hot", "cold"], "answer": 1},
]


@pytest.fixture(scope="module")
def lm(info_server):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # tokenizer_backend "auto" finds /tokenizer_info and tokenizes through the server:
    # no tokenizer is fetched from anywhere else.
    model = LocalCompletionsAPI(
        model="tiny", base_url=info_server.base_url + "/v1/completions", max_retries=1,
    )
    assert model.tokenizer_backend == "remote"
    return model


def test_lm_eval_loglikelihood_equals_the_engine(lm, reference_llm) -> None:
    from lm_eval.api.instance import Instance

    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(PAIRS)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    tok = reference_llm.tokenizer
    for (context, continuation), (ll, greedy) in zip(PAIRS, got):
        want, want_greedy = loglikelihood(
            reference_llm,
            tok.encode(context, add_special_tokens=False),
            tok.encode(continuation, add_special_tokens=False),
        )
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
        assert ll < 0


def test_lm_eval_multiple_choice_task(lm, reference_llm, tmp_path, monkeypatch) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: hybridserve_tiny_mc\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["hybridserve_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        cache_requests=False,
    )
    tok = reference_llm.tokenizer
    correct = 0
    samples = sorted(results["samples"]["hybridserve_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    for doc, sample in zip(MC_DOCS, samples):
        context = tok.encode(doc["question"], add_special_tokens=False)
        lls = [loglikelihood(reference_llm, context, tok.encode(" " + ch, add_special_tokens=False))[0]
               for ch in doc["choices"]]
        got = [r[0] for r in sample["filtered_resps"]]
        assert got == pytest.approx(lls, abs=1e-4)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])
    acc = results["results"]["hybridserve_tiny_mc"]["acc,none"]
    assert math.isclose(acc, correct / len(MC_DOCS))
