"""Stop strings offline: the text ends before the stop string, or after it with
``include_stop_str_in_output``; the tokens stop at the one that completed it."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams

PROMPT = "def g(y):"


@pytest.fixture(scope="module")
def llm(tiny_granite) -> LLM:
    return LLM(tiny_granite, max_num_seqs=4)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("which", [0, -1])
def test_include_stop_str_in_output(llm, include, which):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    text = full[0].outputs[0].text
    # Three characters, none a replacement character (bytes that are not text yet), so
    # the stop string spans tokens.
    clean = [i for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[which] : clean[which] + 3]
    at = text.index(stop)
    params = SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True,
                            include_stop_str_in_output=include)
    (out,) = llm.generate(PROMPT, params)[0].outputs
    assert out.text == (text[: at + len(stop)] if include else text[:at])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Generation stopped at the token that completed the stop string.
    tokens = full[0].outputs[0].token_ids
    assert out.token_ids == tokens[: len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
