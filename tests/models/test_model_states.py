"""State pages and KV pages through ForwardBatch: the invariants the engine relies on.

- A prompt split over several forwards (each resuming from the previous state page)
  gives the logits of one forward.
- States written at arbitrary offsets inside a forward equal the final states of
  separate forwards stopped at those positions.
- A speculative-verify row of q tokens writing every offset equals q single-token steps.
"""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver

from hybridserve.models.loader import load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint

CASES = [
    ("granitemoehybrid", "MAMMA", {}),
    ("nemotron_h", "*M-M*", {"n_groups": 4}),
    ("bamba", "AMMA", {}),
    ("qwen3_5", "MAMM", {}),
    ("qwen3_next", "AMMA", {"linear_conv_kernel_dim": 3}),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{l}" for a, l, _ in CASES])
def ckpt(request, tmp_path_factory):
    arch, layers, extra = request.param
    seed = 10 + CASES.index(request.param)
    return make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), seed=seed, layers=layers, **extra
    )


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def any_model(request, ckpt):
    """The model in float32 and in float64: float64 shows the identities hold exactly
    (up to 1e-10), float32 that rounding stays at the float32 level."""
    return load_model(ckpt, dtype=request.param)


def _tokens(n: int) -> list[int]:
    return torch.randint(3, 256, (n,)).tolist()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _states(driver: PagedDriver, page: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {
        layer: (driver.conv_state(layer, page), driver.ssm_state(layer, page))
        for layer in driver.caches.conv
    }


def _assert_states_close(got, ref, what: str) -> None:
    """float64: max abs err <= 1e-10. float32: max abs err <= 1e-5 per unit of state
    magnitude (states reach ~20, where one float32 ulp is ~2e-6 and the two runs round
    differently in every layer before)."""
    for layer in ref:
        for name, g, r in zip(("conv", "ssm"), got[layer], ref[layer]):
            err = (g - r).abs().max().item()
            if r.dtype == torch.float64:
                tol = 1e-10
            else:
                tol = 1e-5 * max(1.0, r.abs().max().item())
            assert err <= tol, (
                f"{what}: layer {layer} {name} state max abs err {err:.3g} > {tol:.3g}"
            )


def test_chunked_prefill_matches_single_forward(any_model):
    model = any_model
    prompts = {0: _tokens(37), 1: _tokens(29)}
    # Chunks of 1 and 2 tokens are shorter than the conv window, 13 and 16 cross chunk edges.
    splits = {0: [5, 1, 2, 13, 16], 1: [12, 1, 3, 13]}
    whole = PagedDriver(model)
    expected, _ = whole.step([(0, prompts[0]), (1, prompts[1])])
    expected = {0: expected[:37], 1: expected[37:]}

    driver = PagedDriver(model)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    pos = {0: 0, 1: 0}
    for step in range(max(len(s) for s in splits.values())):
        rows = []
        for sid in (0, 1):
            if step < len(splits[sid]):
                n = splits[sid][step]
                rows.append((sid, prompts[sid][pos[sid] : pos[sid] + n]))
                pos[sid] += n
        logits, _ = driver.step(rows)
        start = 0
        for sid, toks in rows:
            got[sid].append(logits[start : start + len(toks)])
            start += len(toks)
    for sid in (0, 1):
        assert _rel_err(torch.cat(got[sid]), expected[sid]) < 1e-4
        # The state after the whole prompt is the same either way.
        _assert_states_close(
            _states(driver, driver.seqs[sid].state_page),
            _states(whole, whole.seqs[sid].state_page),
            f"sequence {sid} after its last chunk",
        )


@pytest.mark.parametrize("prefix_len", [0, 10])
def test_states_at_offsets_equal_separate_runs(any_model, prefix_len):
    model = any_model
    prefix, body = _tokens(prefix_len), _tokens(25)
    # 0..2 are shorter than the conv window; 7/8 and 15/16 straddle chunk boundaries
    # (chunk_size 8); 24 is the last token.
    offsets = [0, 1, 2, 5, 7, 8, 15, 16, 21, 24]
    driver = PagedDriver(model)
    if prefix:
        driver.step([(0, prefix)])
    _, pages = driver.step([(0, body)], extra_state_offsets={0: offsets})
    for off in offsets:
        ref = PagedDriver(model)
        ref.step([(0, prefix + body[: off + 1])])
        _assert_states_close(
            _states(driver, pages[0][off]), _states(ref, ref.seqs[0].state_page), f"offset {off}"
        )


def test_verify_row_equals_single_token_steps(any_model):
    model = any_model
    prompt, draft = _tokens(11), _tokens(4)
    spec = PagedDriver(model)
    spec.step([(0, prompt)])
    verify_logits, pages = spec.step([(0, draft)], extra_state_offsets={0: [0, 1, 2, 3]})

    step = PagedDriver(model)
    step.step([(0, prompt)])
    for j, tok in enumerate(draft):
        logits, _ = step.step([(0, [tok])])
        assert _rel_err(verify_logits[j], logits[0]) < 1e-4, f"draft position {j}"
        _assert_states_close(
            _states(spec, pages[0][j]),
            _states(step, step.seqs[0].state_page),
            f"state after draft position {j}",
        )


def test_mixed_batch_rows_are_independent(model):
    """Decode rows, a verify row and a prefill row in one forward give each row's solo result."""
    prompts = [_tokens(n) for n in (9, 17, 4)]
    new = [_tokens(1), _tokens(4), _tokens(20)]
    together = PagedDriver(model)
    together.step([(i, p) for i, p in enumerate(prompts)])
    logits, _ = together.step([(i, t) for i, t in enumerate(new)])
    start = 0
    for i in range(3):
        solo = PagedDriver(model)
        solo.step([(0, prompts[i])])
        expected, _ = solo.step([(0, new[i])])
        assert _rel_err(logits[start : start + len(new[i])], expected) < 1e-5
        start += len(new[i])


def test_forward_writes_only_requested_pages_and_slots(model):
    """The caches start poisoned (NaN); after a step exactly the requested state pages and
    the step's KV slots hold finite values, and nothing else was touched."""
    driver = PagedDriver(model)
    _, pages = driver.step([(0, _tokens(6)), (1, _tokens(11))], extra_state_offsets={1: [2, 7]})
    written = {p for row in pages.values() for p in row.values()}
    assert len(written) == 4
    for layer in driver.caches.conv:
        for cache in (driver.caches.conv[layer], driver.caches.ssm[layer]):
            finite = cache.flatten(1).isfinite()
            assert finite[sorted(written)].all()
            others = [p for p in range(cache.shape[0]) if p not in written]
            assert not finite[others].any()
    slots = {
        seq.blocks[p // driver.block_size] * driver.block_size + p % driver.block_size
        for seq in driver.seqs.values()
        for p in range(len(seq.tokens))
    }
    for k_cache, v_cache in driver.caches.kv.values():
        for cache in (k_cache, v_cache):
            finite = cache.reshape(-1, cache.shape[2] * cache.shape[3]).isfinite()
            assert finite[sorted(slots)].all()
            assert finite.all(dim=1).sum().item() == len(slots) and finite.any(dim=1).sum() == len(
                slots
            )
