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
    assert "n-gram: acceptance rate" in text and "draft model: acceptance rate" in text  # the trained draft too
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


def _eval_script():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "eval_default_model.py"
    spec = importlib.util.spec_from_file_location("eval_default_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# Four of the model card's twelve sample prompts (metrics.json "samples"), the test's
# three among them; greedy, 64 new tokens, cut as the card's evaluation cuts them.
CARD_PROMPTS = ["def fibonacci(n):", "def is_prime(n):", "def factorial(n):", "def add(a, b):"]


def test_text_prompts_get_the_bos_the_model_was_trained_with():
    llm = LLM(max_num_seqs=4)
    tok = llm.get_tokenizer()
    assert tok.bos_token == "<|endoftext|>" and tok.bos_token_id == 0
    out = llm.generate("def f(x):", SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == 0
    assert out.prompt_token_ids[1:] == tok.encode("def f(x):", add_special_tokens=False)


def test_greedy_completions_reproduce_the_model_card():
    import json

    ev = _eval_script()
    samples = json.loads((DEFAULT_MODEL / "metrics.json").read_text())["samples"]
    llm = LLM(max_num_seqs=4)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    for prompt, out in zip(CARD_PROMPTS, llm.generate(CARD_PROMPTS, params, use_tqdm=False)):
        comp = out.outputs[0]
        hit_limit = comp.finish_reason == "length"
        assert ev.cut_function(prompt + comp.text, hit_limit) == samples[prompt]["completion"], prompt


def test_cli_generate_reproduces_the_model_card(capsys):
    import json

    from hybridserve.cli import main

    card = json.loads((DEFAULT_MODEL / "metrics.json").read_text())["samples"]["def fibonacci(n):"]
    assert main(["generate", "def fibonacci(n):"]) == 0  # the CLI's defaults: greedy, 64 tokens
    assert capsys.readouterr().out.startswith(card["completion"])
