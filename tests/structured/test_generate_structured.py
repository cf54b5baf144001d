"""Structured outputs end to end through ``LLM.generate``: every constrained output of
a random-weight model (and of the embedded model) parses and validates, with and
without n-gram speculation and prefix caching; constrained and free requests share
steps without changing the free ones' tokens; speculation changes no constrained
token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hybridserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["alpha beta gamma", "omega", "delta"]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}

JSON_SO = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX_SO = StructuredOutputsParams(regex=REGEX)
CHOICE_SO = StructuredOutputsParams(choice=CHOICES)


def _text(llm: LLM, completion) -> str:
    """The completion's text without its final EOS (in the test tokenizer EOS is a byte,
    which decoding keeps)."""
    ids = list(completion.token_ids)
    if completion.finish_reason == "stop" and ids and ids[-1] in llm.engine.eos_token_ids:
        ids = ids[:-1]
    return llm.tokenizer.decode(ids)


def _check(llm: LLM, so: StructuredOutputsParams, completion) -> None:
    assert completion.finish_reason == "stop", completion
    text = _text(llm, completion)
    if so.kind == "json":
        jsonschema.validate(json.loads(text), so.json)
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice, text


# Prompts repeat the choices and JSON-ish text so n-gram drafts get proposed and accepted.
PROMPTS = [
    "pick: alpha beta gamma or omega or delta; alpha beta gamma",
    '{"id":12,"name":"ab","kind":"cat","tags":[],"ok":true} {"id":',
    "abc-12 bca-7 abc-12 abc-",
    "free text that is not constrained at all, free text",
]


def _batch(temperature: float, seed: int = 0) -> list[tuple[str, SamplingParams]]:
    out = []
    for i, so in enumerate([JSON_SO, REGEX_SO, CHOICE_SO]):
        for j, prompt in enumerate(PROMPTS):
            out.append((prompt, SamplingParams(
                max_tokens=120, temperature=temperature, seed=seed + 10 * i + j, structured_outputs=so,
            )))
    return out


@pytest.mark.parametrize(
    "spec, prefix_caching, temperature",
    [(None, True, 0.0), (SPEC, True, 1.0), (SPEC, False, 0.0), (None, False, 1.0)],
    ids=["plain-cache-greedy", "ngram-cache-sampled", "ngram-nocache-greedy", "plain-nocache-sampled"],
)
def test_every_constrained_output_validates(tiny_granite, spec, prefix_caching, temperature):
    llm = LLM(tiny_granite, max_num_seqs=16, max_model_len=512, speculative_config=spec,
              enable_prefix_caching=prefix_caching)
    llm.engine.check_integrity_every_step = True
    batch = _batch(temperature)
    # With the prefix cache on, twice: the second round's prompts hit it.
    for _ in range(2 if prefix_caching else 1):
        outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        for (_, sp), out in zip(batch, outs):
            _check(llm, sp.structured_outputs, out.outputs[0])
    if prefix_caching:
        assert llm.stats()["prefix_hit_tokens"] > 0
    if spec:
        assert llm.stats()["spec_accepted_tokens"] > 0


def test_speculation_changes_no_constrained_token(tiny_granite):
    """Every emitted token is drawn from the masked distribution at its position with
    the request's counter-based noise, so drafts (checked against the grammar) change
    nothing: greedy and seeded outputs equal those without speculation."""
    batch = _batch(0.0) + _batch(0.8, seed=100)
    prompts, params = [p for p, _ in batch], [sp for _, sp in batch]
    plain = LLM(tiny_granite, max_num_seqs=16, max_model_len=512)
    spec = LLM(tiny_granite, max_num_seqs=16, max_model_len=512, speculative_config=SPEC)
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == a
    # The choice rows had drafts to check: their forced tails appear in their prompts.
    assert sum(o.metrics["spec_accepted_tokens"] for o in outs) > 0


def test_free_requests_batched_with_constrained_ones_keep_their_tokens(tiny_granite):
    free = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)]
    free_prompts = ["the quick brown fox", "lorem ipsum dolor"]
    llm = LLM(tiny_granite, max_num_seqs=16, max_model_len=512)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]
    batch = _batch(0.0)
    prompts = [p for p, _ in batch] + free_prompts
    params = [sp for _, sp in batch] + free
    outs = LLM(tiny_granite, max_num_seqs=16, max_model_len=512).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == alone
    for (_, sp), out in zip(batch, outs):
        _check(llm, sp.structured_outputs, out.outputs[0])


def test_unconstrained_output_would_not_have_validated(tiny_granite):
    """The checks above are not vacuous: the same model without the constraint does not
    produce valid JSON or the regex."""
    llm = LLM(tiny_granite, max_num_seqs=4, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)
    for out in outs:
        text = _text(llm, out.outputs[0])
        assert not re.fullmatch(REGEX, text)
        with pytest.raises(ValueError):
            json.loads(text)


def test_n_children_get_their_own_grammar_state(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=8, max_model_len=512)
    params = SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=3, structured_outputs=JSON_SO)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    texts = {_text(llm, c) for c in out.outputs}
    assert len(texts) > 1
    for c in out.outputs:
        _check(llm, JSON_SO, c)


def test_json_object_and_lark_grammar(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4, max_model_len=512)
    grammar = StructuredOutputsParams(grammar='start: "x=" NUM ("," NUM)?\nNUM: /[0-9]{1,2}/')
    obj = StructuredOutputsParams(
        json_object=True, disable_any_whitespace=True,
    )
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=grammar),
                                     SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=obj)],
                        use_tqdm=False)
    assert re.fullmatch(r"x=[0-9]{1,2}(,[0-9]{1,2})?", _text(llm, outs[0].outputs[0]))
    # Any JSON object is unbounded, so a random model may run to max_tokens: then the
    # output must still be a prefix the grammar accepts.
    c = outs[1].outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(_text(llm, c)), dict)
    else:
        fresh = llm.engine.grammar_backend().matcher(obj)
        assert _text(llm, c).startswith("{") and fresh.valid_prefix(c.token_ids) == len(c.token_ids)


def test_bad_grammar_is_refused_and_nothing_is_queued(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4, max_model_len=512)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["a"], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["a"], SamplingParams(max_tokens=20, structured_outputs=REGEX_SO), use_tqdm=False)
    _check(llm, REGEX_SO, out[0].outputs[0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_embedded_model_structured_outputs(device):
    """The embedded model's tokenizer (BPE, EOS a special token); on CUDA this is the
    path with decode graphs, which steps with constrained rows replay too."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "maximum": 10**6}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    cases = [
        ("def config():\n    return ", StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
        ("def config():\n    return ", StructuredOutputsParams(json=schema)),
        ("import os\n\ndef ", StructuredOutputsParams(regex=r"[a-z_]{1,12}\(")),
        ("x = True  # or ", StructuredOutputsParams(choice=["True", "False", "None"])),
    ]
    free_prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
    free = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for spec in (None, SPEC):
        llm = LLM(max_model_len=512, speculative_config=spec, device=device)
        alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]
        for temperature in (0.0, 0.7):
            params = [SamplingParams(max_tokens=96, temperature=temperature, seed=1, structured_outputs=so)
                      for _, so in cases]
            outs = llm.generate([p for p, _ in cases] + free_prompts, params + [free, free], use_tqdm=False)
            for (_, so), out in zip(cases, outs):
                _check(llm, so, out.outputs[0])
            assert [o.outputs[0].token_ids for o in outs[-2:]] == alone


def test_steps_without_constrained_rows_do_no_mask_work(tiny_granite, count_calls):
    from hybridserve.runner import sampler

    plans = count_calls(sampler, "plan_draw")
    masks = count_calls(sampler, "apply_bitmasks")
    llm = LLM(tiny_granite, max_num_seqs=4, max_model_len=512)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert not plans and not masks  # plain greedy: the argmax fast path, no parameters sent
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True), use_tqdm=False)
    assert plans and not masks  # sampled, but nothing constrained
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, structured_outputs=REGEX_SO), use_tqdm=False)
    assert masks
