"""The shipped default model: it loads, its recorded held-out loss reproduces, and it
writes parseable Python for most of the fixed prompts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "hybridserve" / "default_model"


def _load_eval_module():
    spec = importlib.util.spec_from_file_location(
        "eval_default_model", REPO / "scripts" / "eval_default_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


ev = _load_eval_module()


@pytest.fixture(scope="module")
def model_and_tokenizer():
    # The suite pins one thread for its tiny models; this one is large enough to use two.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield ev.load_model(MODEL_DIR)
    finally:
        torch.set_num_threads(previous)


def test_shipped_files_load_as_dense_granite_hybrid(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert config["num_local_experts"] == 0
    assert set(config["layer_types"]) == {"mamba", "attention"}
    assert all(layer.block_sparse_moe is None for layer in model.model.layers)
    assert [layer.mamba is None for layer in model.model.layers] == [
        t == "attention" for t in config["layer_types"]
    ]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert len(tokenizer) == config["vocab_size"]


def test_cut_function_stops_at_next_top_level_line():
    text = "def f(x):\n    y = x\n\n    return y\n\ndef g():\n    pass\n"
    assert ev.cut_function(text, hit_limit=False) == "def f(x):\n    y = x\n\n    return y\n"
    # At the token limit the last (possibly partial) line is dropped.
    assert ev.cut_function("def f(x):\n    y = x\n    ret", hit_limit=True) == (
        "def f(x):\n    y = x\n"
    )


def test_heldout_slice_loss_matches_shipped_metrics(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    try:
        stream = ev.heldout_stream(tokenizer, MODEL_DIR)
    except ev.CorpusMismatch as exc:
        pytest.skip(f"standard library differs from the training corpus: {exc}")
    shipped = json.loads((MODEL_DIR / ev.METRICS_FILE).read_text())["eval"]["slice"]
    result = ev.evaluate(model, tokenizer, stream, ev.SLICE_WINDOWS)
    assert result.tokens == shipped["tokens"] and result.bytes == shipped["bytes"]
    rel = abs(result.loss_nats_per_token - shipped["loss_nats_per_token"])
    assert rel / shipped["loss_nats_per_token"] < 0.02, (result, shipped)
    assert abs(result.bits_per_byte - shipped["bits_per_byte"]) / shipped["bits_per_byte"] < 0.02


def test_greedy_completions_parse(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    codes = [ev.complete_function(model, tokenizer, p) for p in ev.TEST_PROMPTS]
    ok = [ev.parses(code) for code in codes]
    assert sum(ok) >= 2, codes
    for prompt, code in zip(ev.TEST_PROMPTS, codes):
        assert code.startswith(prompt)
