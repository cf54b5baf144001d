"""Shared fixtures: tiny random checkpoints (built once per test session) and a
byte-level tokenizer so text prompts and stop strings can be exercised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridserve.testing.tiny_models import make_tiny_checkpoint

# Tiny models: thread start-up costs more than the matrix products it would split.
torch.set_num_threads(1)


def write_byte_tokenizer(path: Path, eos_id: int = 2) -> None:
    """A tokenizer whose 256 ids are the 256 bytes (matching the tiny models' vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    eos = sorted(alphabet)[eos_id]
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granite"), seed=1)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_nemotron(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron"), seed=2)


@pytest.fixture(scope="session")
def tiny_bamba(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """A Gated DeltaNet hybrid (Qwen3.5: GDN, GDN, attention, GDN)."""
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), seed=4)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(owner, name)`` wraps ``owner.name`` for the test and returns the list
    it appends to on every call (its length is the call count)."""

    def spy(owner, name: str) -> list:
        calls: list = []
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
        return calls

    return spy
