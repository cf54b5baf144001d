"""Nemotron-H's dt clamp quirk.

transformers clamps Nemotron-H's ``dt`` to ``[time_step_min, inf)`` in its chunked path
(prefill) but not in its single-token decode step. By default we do the same, so logits
match it for prefill and decode; ``MambaParams.clamp_dt_in_single_token_step`` clamps
everywhere instead, which makes a token's result independent of how the sequence is cut
into forwards. A large ``time_step_min`` makes the clamp bite on most tokens here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_driver import PagedDriver

from hybridserve.models import ModelConfig, load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(
        "nemotron_h",
        tmp_path_factory.mktemp("n"),
        seed=21,
        layers="M*-M",
        time_step_min=0.6,
        time_step_max=1.0,
    )


def _load(path, clamp_everywhere: bool):
    config = ModelConfig.from_pretrained(path)
    mamba = dataclasses.replace(config.mamba, clamp_dt_in_single_token_step=clamp_everywhere)
    return load_model(path, config=config.with_overrides(mamba=mamba))


def _decode_logits(model, prompt, tokens):
    driver = PagedDriver(model)
    driver.step([(0, prompt)])
    return torch.cat([driver.step([(0, [t])])[0] for t in tokens])


def test_default_matches_transformers_prefill_and_decode(path):
    ours = load_model(path)
    assert ours.config.mamba.time_step_limit[0] == 0.6
    assert not ours.config.mamba.clamp_dt_in_single_token_step
    ref = transformers.NemotronHForCausalLM.from_pretrained(
        path, attn_implementation="eager"
    ).eval()
    prompt = torch.randint(3, 256, (21,)).tolist()
    with torch.no_grad():
        expected_prefill = ref(torch.tensor([prompt])).logits[0].float()
        expected = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    got, _ = PagedDriver(ours).step([(0, prompt)])
    assert ((got - expected_prefill).abs().max() / expected_prefill.abs().max()).item() < 1e-4
    assert PagedDriver(ours).greedy(0, prompt, 32) == expected


def test_the_quirk_is_exercised_and_the_option_removes_it(path):
    reference, consistent = load_model(path), _load(path, clamp_everywhere=True)
    prompt, draft = torch.randint(3, 256, (9,)).tolist(), torch.randint(3, 256, (4,)).tolist()

    # Decode steps differ between the two modes: the clamp really bites here.
    step_ref = _decode_logits(reference, prompt, draft)
    step_con = _decode_logits(consistent, prompt, draft)
    assert (step_ref - step_con).abs().max() > 1e-2

    # Clamping everywhere: a 4-token verify row equals 4 decode steps.
    d = PagedDriver(consistent)
    d.step([(0, prompt)])
    verify, _ = d.step([(0, draft)])
    torch.testing.assert_close(verify, step_con, rtol=1e-5, atol=1e-5)

    # Prefill (several tokens per forward) is the same in both modes.
    a, _ = PagedDriver(reference).step([(0, prompt + draft)])
    b, _ = PagedDriver(consistent).step([(0, prompt + draft)])
    assert torch.equal(a, b)
