"""The draft model shipped for the embedded default model: a real checkpoint that loads
by its short name, leaves greedy output unchanged, and has its drafts accepted far
more often than a random model of the same shape."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.default_model import DRAFT_PATH, PATH
from hybridserve.drafters.draft_model import resolve_draft_model

# Code of our own in the corpus' style (not corpus text), so the test needs no
# particular Python installation.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __repr__(self):",
    "import unittest\n\n\nclass TestQueue(unittest.TestCase):\n\n    def test_empty(self):",
    'def read_config(path):\n    """Read the configuration file at *path*."""\n    with open(path) as f:',
]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
K = 3
# Measured when the draft model was shipped (k = 3, float32 on the CPU): 0.547 of the
# drafts accepted on these prompts (2.63 tokens per verify step); the random draft model
# of the test below: 0.0. The floor sits well below the first, far above the second.
ACCEPTANCE_FLOOR = 0.35


def _run(spec, params=GREEDY):
    llm = LLM(max_num_seqs=len(PROMPTS), speculative_config=spec)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.stats()
    rate = stats["spec_accepted_tokens"] / max(1, stats["spec_draft_tokens"])
    return [o.outputs[0].token_ids for o in outs], rate, stats


@pytest.fixture(scope="module")
def plain():
    return _run(None)[0]


def test_shipped_draft_is_a_small_bf16_checkpoint_with_the_targets_vocabulary():
    from safetensors.torch import load_file

    config = json.loads((DRAFT_PATH / "config.json").read_text())
    target = json.loads((PATH / "config.json").read_text())
    assert config["vocab_size"] == target["vocab_size"] == 4096
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert (DRAFT_PATH / "tokenizer.json").read_bytes() == (PATH / "tokenizer.json").read_bytes()
    weights = load_file(DRAFT_PATH / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert 0.5e6 < sum(w.numel() for w in weights.values()) < 3e6
    # The size budget for the model folder, draft included.
    total = sum(p.stat().st_size for p in PATH.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total <= 24 * 2**20


def test_short_name_resolves_to_the_shipped_folder(tmp_path):
    assert resolve_draft_model("default-draft") == DRAFT_PATH
    assert resolve_draft_model(str(tmp_path)) == tmp_path


def test_trained_draft_keeps_greedy_output_and_is_accepted(plain):
    tokens, rate, stats = _run({"method": "draft_model", "model": "default-draft",
                                "num_speculative_tokens": K})
    assert tokens == plain
    assert stats["spec_verify_rows"] > 0
    assert rate > ACCEPTANCE_FLOOR, rate


def test_random_draft_of_the_same_shape_is_not(plain, tmp_path):
    """The control: the floor above separates a trained draft from an untrained one."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(DRAFT_PATH)
    torch.manual_seed(0)
    transformers.GraniteMoeHybridForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    # The first 16 tokens of each prompt (greedy: a prefix of the 48 above): every draft
    # of a random model is rejected, so each of its verify steps gains one token only.
    short = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens, rate, stats = _run({"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": K}, short)
    assert tokens == [t[:16] for t in plain]
    assert stats["spec_draft_tokens"] >= 16 * K
    assert rate < ACCEPTANCE_FLOOR / 3, rate
