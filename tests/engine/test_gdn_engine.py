"""Gated DeltaNet hybrids (Qwen3.5, its vision-language wrapper's text part, dense Qwen3-Next)
through the whole engine: parity with transformers' ``generate``, batch invariance, chunked
prefill, prefix caching x speculative decoding, checkpoint exactness, second turns,
preemption, and bfloat16 state pages."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.testing.reference import assert_checkpoints_exact
from hybridserve.testing.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
HF_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """Qwen3.5, attention first and in the middle, conv kernel 4."""
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), seed=21,
                                layers="AMMAM")


@pytest.fixture(scope="module")
def tiny_qwen_next(tmp_path_factory):
    """Dense Qwen3-Next, attention last, conv kernel 3, 4 value heads per key head."""
    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=22,
                                layers="MMAMA", linear_conv_kernel_dim=3,
                                linear_num_value_heads=8)


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_5_vl", tmp_path_factory.mktemp("qwen3_5_vl"), seed=23,
                                layers="MAMM")


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _prompts(seed: int, count: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [_rand(rng, rng.randint(lo, hi)) for _ in range(count)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _workload(seed: int) -> list[list[int]]:
    """Repetitive prompts (n-gram drafts get accepted) beside random ones."""
    rng = random.Random(seed)
    motif = _rand(rng, 7)
    return [motif * 6, _rand(rng, 30), motif * 3 + _rand(rng, 5) + motif, _rand(rng, 9),
            _rand(rng, 4) * 8]


@pytest.mark.parametrize("arch", ["tiny_qwen", "tiny_qwen_next", "tiny_qwen_vl"])
def test_greedy_matches_transformers_generate(arch, request):
    import transformers

    path = request.getfixturevalue(arch)
    prompts = _prompts(10, 3, 5, 40)
    ours = _tokens(LLM(path, max_num_seqs=4).generate(prompts, GREEDY))
    name = {"tiny_qwen": "qwen3_5", "tiny_qwen_next": "qwen3_next", "tiny_qwen_vl": "qwen3_5_vl"}
    hf = getattr(transformers, HF_CLASSES[name[arch]]).from_pretrained(
        path, dtype=torch.float32
    ).eval()
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert got == ref


@pytest.mark.parametrize("arch", ["tiny_qwen", "tiny_qwen_next"])
def test_batch_invariance_and_chunked_prefill(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(11, 10, 3, 70)
    single = LLM(path, max_num_seqs=1, enable_prefix_caching=False)
    alone = [_tokens(single.generate([p], GREEDY))[0] for p in prompts]
    batched = _tokens(LLM(path, max_num_seqs=16).generate(prompts, GREEDY))
    chunked = _tokens(
        LLM(path, max_num_seqs=16, max_num_batched_tokens=7).generate(prompts, GREEDY)
    )
    assert batched == alone
    assert chunked == batched


@pytest.fixture(scope="module")
def uncached(tiny_qwen):
    llm = LLM(tiny_qwen, enable_prefix_caching=False)
    return {s: _tokens(llm.generate(_workload(s), GREEDY)) for s in (0, 1)}


@pytest.mark.parametrize("d", [0, 1, 3, 5])
@pytest.mark.parametrize("caching", [False, True])
def test_greedy_identical_across_caching_and_speculation(tiny_qwen, uncached, d, caching):
    spec = None
    if d:
        spec = {"method": "ngram", "num_speculative_tokens": d,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(tiny_qwen, enable_prefix_caching=caching, state_interval=16,
              speculative_config=spec)
    llm.engine.check_integrity_every_step = True
    outs = []
    for seed in (0, 1):
        prompts = _workload(seed)
        got = _tokens(llm.generate(prompts, GREEDY))
        assert got == uncached[seed]
        # Again: now with prefix hits (when caching), under speculation when on.
        assert _tokens(llm.generate(prompts, GREEDY)) == uncached[seed]
        outs += [p + o for p, o in zip(prompts, got)] + prompts
    stats = llm.stats()
    if d:
        assert stats["spec_accepted_tokens"] > 0
    if caching:
        assert stats["prefix_hit_tokens"] > 0
        assert assert_checkpoints_exact(llm, outs) > 0


def test_second_turns_hit_checkpoints_written_while_speculating(tiny_qwen_next):
    rng = random.Random(5)
    motif = _rand(rng, 6)
    first = [motif * 5 + _rand(rng, 3), _rand(rng, 21), motif * 3]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(tiny_qwen_next, state_interval=16, speculative_config=spec)
    llm.engine.check_integrity_every_step = True
    replies = _tokens(llm.generate(first, GREEDY))
    assert llm.stats()["spec_accepted_tokens"] > 0
    seqs = [p + r for p, r in zip(first, replies)]
    # The finished sequences' checkpoints come from verify steps (the decode phase).
    assert assert_checkpoints_exact(llm, seqs + first) > 0
    second = [s + _rand(rng, 5) for s in seqs]
    outs = llm.generate(second, GREEDY)
    got = _tokens(outs)
    # Every second turn resumes past its first turn's prompt: from a checkpoint its decode
    # phase (verify steps) wrote.
    for o, p in zip(outs, first):
        assert o.num_cached_tokens > len(p)
    cold = _tokens(LLM(tiny_qwen_next, enable_prefix_caching=False).generate(second, GREEDY))
    assert got == cold
    assert assert_checkpoints_exact(llm, seqs + first + [s + g for s, g in zip(second, got)]) > 0


@pytest.mark.parametrize("tight", ["kv_blocks", "state_pages"])
def test_preemption_under_tight_pages_keeps_outputs(tiny_qwen, tight):
    prompts = _prompts(12, 8, 20, 40)
    ref = _tokens(LLM(tiny_qwen, max_num_seqs=8).generate(prompts, GREEDY))
    if tight == "kv_blocks":
        # 8 requests of up to 72 tokens need ~40 blocks; 14 make them take turns.
        llm = LLM(tiny_qwen, max_num_seqs=8, max_model_len=128, num_kv_blocks=14)
    else:
        llm = LLM(tiny_qwen, max_num_seqs=8, max_model_len=128, num_state_pages=14,
                  max_checkpoint_pages=4, speculative_config={
                      "method": "ngram", "num_speculative_tokens": 3})
    llm.engine.check_integrity_every_step = True
    got = _tokens(llm.generate(prompts, GREEDY))
    assert llm.stats()["preemptions"] > 0
    assert got == ref


@pytest.fixture(scope="module")
def bf16_uncached(tiny_qwen):
    llm = LLM(tiny_qwen, enable_prefix_caching=False, ssm_state_dtype="bfloat16")
    return _tokens(llm.generate(_workload(0), GREEDY))


@pytest.mark.parametrize("d", [0, 3])
@pytest.mark.parametrize("caching", [False, True])
def test_bfloat16_state_pages_are_exact_across_caching_and_speculation(
    tiny_qwen, bf16_uncached, d, caching
):
    """bfloat16 pages round the carried state after every token, so a step's split
    (prefix hits, verify rows) cannot change a bit: same-config runs agree exactly."""
    spec = {"method": "ngram", "num_speculative_tokens": d} if d else None
    llm = LLM(tiny_qwen, enable_prefix_caching=caching, state_interval=16,
              speculative_config=spec, ssm_state_dtype="bfloat16")
    llm.engine.check_integrity_every_step = True
    prompts = _workload(0)
    got = _tokens(llm.generate(prompts, GREEDY))
    assert got == bf16_uncached
    assert _tokens(llm.generate(prompts, GREEDY)) == bf16_uncached
    assert all(t.dtype == torch.bfloat16 for t in llm.engine.runner.caches.ssm.values())
    if caching:
        assert llm.stats()["prefix_hit_tokens"] > 0
        seqs = [p + o for p, o in zip(prompts, got)] + prompts
        # Within one bfloat16 rounding of states of magnitude ~4 (the conv windows, in
        # float32, to float32 noise): the layers' inputs differ by float32 rounding.
        assert assert_checkpoints_exact(llm, seqs, atol=2**-8 * 4) > 0


def test_state_page_bytes_are_logged_and_halved_by_bfloat16(tiny_qwen, caplog):
    with caplog.at_level(logging.INFO, logger="hybridserve"):
        llm = LLM(tiny_qwen, num_state_pages=10)
    spec = llm.model.cache_spec
    f32 = spec.state_page_bytes(torch.float32, torch.float32)
    # 3 GDN layers: conv window 2*2*16 + 4*16 = 128 channels x 3, state 4 x 16 x 16.
    assert f32 == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    assert any(f"state page: {f32} bytes" in r.getMessage() for r in caplog.records)
    bf16 = spec.state_page_bytes(torch.float32, torch.bfloat16)
    assert bf16 == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 2)


def test_packed_chunked_prefill_with_caching_and_speculation(tiny_qwen, uncached, monkeypatch):
    """Prefill steps through the chunked form (chunks of 8: states on the grid of 16 come
    from chunk states, others from tails) give the per-row path's tokens and exact
    checkpoints, with prefix caching and n-gram speculation on."""
    from hybridserve.config import KernelPolicy
    from hybridserve.kernels import gdn_chunked

    calls = []
    real = gdn_chunked.chunk_scan_reference

    def spy(*args, **kwargs):
        calls.append(max(b - a for a, b in zip(args[5], args[5][1:])))  # longest row
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn_chunked, "chunk_scan_reference", spy)
    llm = LLM(tiny_qwen, state_interval=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              kernel_policy=KernelPolicy(gdn_rows="chunked", gdn_chunk=8))
    llm.engine.check_integrity_every_step = True
    prompts = _workload(0)
    got = _tokens(llm.generate(prompts, GREEDY))
    assert got == uncached[0]
    assert _tokens(llm.generate(prompts, GREEDY)) == uncached[0]
    # Some prefill rows spanned several chunks (their grid states came from chunk states).
    assert calls and max(calls) > 16 and llm.stats()["prefix_hit_tokens"] > 0
    seqs = [p + o for p, o in zip(prompts, got)] + prompts
    assert assert_checkpoints_exact(llm, seqs) > 0


def _prefill_paths_agree(path, device, modes, scan_owner, scan_name, lp_bound, state_bound):
    """Two long prompts (rows over ``FLA_MIN_TOKENS``) through the engine with
    ``gdn_rows`` = each of ``modes``: every prompt position's log probability and every
    checkpoint (on the 64-token grid, prefix caching on) agree (absolute ``lp_bound``,
    relative ``state_bound``); the scan
    ``scan_owner.scan_name`` ran for the second mode only, on rows that long."""
    from hybridserve.config import KernelPolicy
    from hybridserve.models.layers.gated_deltanet import FLA_MIN_TOKENS

    rng = random.Random(31)
    prompts = [_rand(rng, 700), _rand(rng, 600)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    calls = []
    real = getattr(scan_owner, scan_name)

    def spy(*args, **kwargs):
        calls.append(max(b - a for a, b in zip(args[5], args[5][1:])))  # longest row
        return real(*args, **kwargs)

    runs = []
    for i, mode in enumerate(modes):
        llm = LLM(path, device=device, enable_prefix_caching=True, state_interval=64,
                  max_num_seqs=4, kernel_policy=KernelPolicy(gdn_rows=mode))
        with pytest.MonkeyPatch.context() as mp:
            if i == 1:
                mp.setattr(scan_owner, scan_name, spy)
            outs = llm.generate(prompts, params)
        logprobs = [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])]
                    for o, p in zip(outs, prompts)]
        ckpts = {key: c.page for key, c in llm.engine.scheduler.states.checkpoints.items()}
        runs.append((logprobs, ckpts, llm.engine.runner.caches))
    assert calls and min(calls) > FLA_MIN_TOKENS
    (want_lp, want_ck, want_caches), (got_lp, got_ck, got_caches) = runs
    for w, g in zip(want_lp, got_lp):
        assert len(w) == len(g) and max(abs(a - b) for a, b in zip(w, g)) < lp_bound
    assert got_ck.keys() == want_ck.keys() and len(want_ck) >= 2 * 9
    for layer, want_ssm in want_caches.ssm.items():
        got_ssm = got_caches.ssm[layer]
        for key, page in want_ck.items():
            want, got = want_ssm[page].float(), got_ssm[got_ck[key]].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < state_bound, (layer, key, err)


@pytest.mark.gpu
def test_fla_prefill_on_cuda_matches_the_token_kernel(tiny_qwen):
    """On CUDA, ``gdn_rows="fla"`` (fla-core's chunked scan for rows over 512 tokens, float32
    q, k, v: TF32 dots) against the default token kernel: prompt log probabilities within
    2e-2 (of about ln 256 = 5.5) and checkpoints within 5e-3 relative, the TF32 level (the
    scan's first version, off by 0.20 on its outputs, fails the checkpoint bound)."""
    from hybridserve.kernels import gdn_chunked

    if not torch.cuda.is_available() or not gdn_chunked.fla_chunk_scan_available():
        pytest.skip("needs CUDA and fla-core")
    _prefill_paths_agree(tiny_qwen, "cuda", ("auto", "fla"), gdn_chunked, "chunk_scan_fla",
                         2e-2, 5e-3)
