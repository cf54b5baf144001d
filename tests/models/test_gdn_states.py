"""Gated DeltaNet state pages in bfloat16: the carried state is rounded to the page dtype
after every token, so how a sequence is split over forwards cannot change the result.

A float64 model keeps everything else exact (rounding noise ~1e-16), which isolates the
bfloat16 page rounding: a verify row writing every offset must equal single-token steps,
and a chunked prefill one forward, to float64 precision, not to bfloat16 precision.
"""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver

from hybridserve.models.loader import load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def model(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=31,
                                layers="MAMM")
    return load_model(path, dtype=torch.float64)


def _tokens(n: int) -> list[int]:
    return torch.randint(3, 256, (n,)).tolist()


def _max_state_err(a: PagedDriver, pa: int, b: PagedDriver, pb: int) -> float:
    err = 0.0
    for layer in a.caches.conv:
        for x, y in ((a.conv_state(layer, pa), b.conv_state(layer, pb)),
                     (a.ssm_state(layer, pa), b.ssm_state(layer, pb))):
            err = max(err, (x.double() - y.double()).abs().max().item())
    return err


def test_verify_row_equals_single_token_steps_in_bfloat16_pages(model):
    prompt, draft = _tokens(11), _tokens(4)
    spec = PagedDriver(model, ssm_dtype=torch.bfloat16)
    spec.step([(0, prompt)])
    verify_logits, pages = spec.step([(0, draft)], extra_state_offsets={0: [0, 1, 2, 3]})
    step = PagedDriver(model, ssm_dtype=torch.bfloat16)
    step.step([(0, prompt)])
    for j, tok in enumerate(draft):
        logits, _ = step.step([(0, [tok])])
        assert (verify_logits[j] - logits[0]).abs().max() < 1e-10
        assert _max_state_err(spec, pages[0][j], step, step.seqs[0].state_page) < 1e-10
    assert all(t.dtype == torch.bfloat16 for t in spec.caches.ssm.values())


def test_chunked_prefill_equals_one_forward_in_bfloat16_pages(model):
    prompt = _tokens(30)
    whole = PagedDriver(model, ssm_dtype=torch.bfloat16)
    expected, _ = whole.step([(0, prompt)])
    chunked = PagedDriver(model, ssm_dtype=torch.bfloat16)
    got = []
    for s, e in ((0, 7), (7, 8), (8, 10), (10, 30)):
        logits, _ = chunked.step([(0, prompt[s:e])])
        got.append(logits)
    assert (torch.cat(got) - expected).abs().max() < 1e-10
    assert _max_state_err(chunked, chunked.seqs[0].state_page, whole, whole.seqs[0].state_page) < 1e-10
