"""``EngineCore.add_request``'s token-id check (every id an ``int`` in ``[0, vocab)``), done
per distinct type and by the range of the ids: the same rule as a per-token check."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve import LLM, SamplingParams


@pytest.mark.parametrize("bad", [
    [3, -1, 5], [3, "vocab", 5], [3, 4.0, 5], [np.int64(3)], [3, None], ["a"],
    [3, 2**64], [-(2**70), 3],
])
def test_bad_token_ids_are_refused_and_nothing_is_queued(tiny_nemotron, bad):
    eng = LLM(tiny_nemotron).engine
    vocab = eng.vocab_size
    with pytest.raises(ValueError, match=rf"integers in \[0, {vocab}\)"):
        eng.add_request("r", bad, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=rf"integers in \[0, {vocab}\)"):
        eng.add_request("r", [1, vocab], SamplingParams(max_tokens=1))
    assert not eng.groups and not eng.scheduler.waiting


def test_good_token_ids_are_queued(tiny_nemotron):
    eng = LLM(tiny_nemotron).engine
    eng.add_request("r", [0, eng.vocab_size - 1, True, 7], SamplingParams(max_tokens=1))
    assert "r" in eng.groups

    class Id(int):
        pass

    eng.add_request("s", (Id(5), 6), SamplingParams(max_tokens=1))
    assert eng.scheduler.waiting[-1].prompt_token_ids == [5, 6]
