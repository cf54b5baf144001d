"""The indexed n-gram drafter proposes exactly what the brute-force scan does."""

from __future__ import annotations

import random

from hybridserve.config import SpecConfig
from hybridserve.drafters.ngram import NgramDrafter, propose_reference


def test_indexed_drafter_equals_the_scan_as_a_sequence_grows():
    rng = random.Random(0)
    for trial in range(20):
        cfg = SpecConfig(num_speculative_tokens=4, prompt_lookup_min=rng.randint(1, 2),
                         prompt_lookup_max=rng.randint(2, 5))
        drafter = NgramDrafter(cfg)
        vocab = rng.choice([3, 5, 20])  # small vocabularies repeat often
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        for _ in range(80):
            k = rng.randint(0, 5)
            got = drafter.propose(toks, k, key=trial)
            assert got == propose_reference(toks, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            toks += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        drafter.forget(trial)
        assert not drafter._indexes
