"""The embedded default model through the engine: same greedy text as transformers,
and the README's demo command runs on it."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.llm import DEFAULT_MODEL

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):"]


def test_greedy_continuations_match_transformers():
    import transformers

    llm = LLM()  # no model given: the embedded one, upcast to float32
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    for out in ours:
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=1,
        )[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref


def test_demo_runs(capsys):
    from hybridserve.cli import main

    assert main(["demo", "--num-threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "Shared prefix" in text and "acceptance rate" in text
    assert "NO" not in text.split()  # every cached and speculative output equals the plain one


def test_bad_text_prompts_are_refused_and_serving_continues():
    llm = LLM(max_num_seqs=2, max_model_len=64)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ref = llm.generate(["def f(x):"], params)[0].outputs[0].text
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], params)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["def f(x):", "x = 1\n" * 200], params)
    assert llm.generate(["def f(x):"], params)[0].outputs[0].text == ref
