"""A grammar that starts after a tag (``StructuredOutputsParams.after_token_ids``, what
the server sets to the reasoning parser's end tag): the tokens up to the tag are free,
the tag itself is not fed to the grammar, and from the next token on the output
matches it, with or without speculation."""

from __future__ import annotations

import re

import pytest

from hybridserve import LLM, SamplingParams, StructuredOutputsParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _params(tag: tuple[int, ...], t: int, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={t: 100.0},
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}", after_token_ids=tag), **kw,
    )


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "ngram"])
def test_free_until_the_tag_then_constrained(tiny_granite, spec):
    llm = LLM(tiny_granite, max_num_seqs=4, speculative_config=spec)
    llm.engine.check_integrity_every_step = True
    tok = llm.tokenizer
    t = tok.encode("Q", add_special_tokens=False)[0]
    digits = tok.encode("0123456789", add_special_tokens=False)
    # A prompt that repeats the expected output, so n-gram drafts cross the tag.
    prompt = tok.encode("QQ123QQ123QQ123", add_special_tokens=False)
    for tag in ((t,), (t, t)):
        (out,) = llm.generate([prompt], _params(tag, t), use_tqdm=False)
        ids = out.outputs[0].token_ids
        # The bias makes the free part the tag; the grammar then masks it out.
        assert ids[: len(tag)] == list(tag)
        body = ids[len(tag):]
        if body and body[-1] in llm.engine.eos_token_ids:
            body = body[:-1]
        assert all(i in digits for i in body) and re.fullmatch("[0-9]{3}", tok.decode(body)), ids
        assert out.outputs[0].finish_reason == "stop"
    if spec:
        assert llm.stats()["spec_draft_tokens"] > 0
    # Without the tag the grammar holds from the first token: no Q at all.
    (out,) = llm.generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={t: 100.0},
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")), use_tqdm=False)
    assert t not in out.outputs[0].token_ids


def test_speculation_changes_no_token(tiny_granite):
    tok_llm = LLM(tiny_granite, max_num_seqs=4)
    tok = tok_llm.tokenizer
    t = tok.encode("Q", add_special_tokens=False)[0]
    prompt = tok.encode("QQ123QQ123QQ123", add_special_tokens=False)
    params = _params((t, t), t)
    a = tok_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(tiny_granite, max_num_seqs=4, speculative_config=SPEC)
    b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_drafts_stop_before_the_token_completing_the_tag():
    req = Request("r", [1, 2], _params((7, 8), 7), arrival=0)
    cut = EngineCore._before_grammar_start
    assert cut(req, [7, 8, 9]) == 1  # 7 may be verified; 8 completes the tag
    req.output_token_ids = [5, 7]
    assert cut(req, [8, 9]) == 0
    assert cut(req, [9, 7, 8, 1]) == 2
    assert cut(req, [1, 2, 3]) == 3
    single = Request("s", [1], _params((7,), 7), arrival=0)
    assert cut(single, [3, 7, 7]) == 1


def test_bad_after_token_ids_names_the_field():
    with pytest.raises(ValueError, match="after_token_ids"):
        StructuredOutputsParams(regex="a", after_token_ids=())
    with pytest.raises(ValueError, match="after_token_ids"):
        StructuredOutputsParams(regex="a", after_token_ids=[-1])
