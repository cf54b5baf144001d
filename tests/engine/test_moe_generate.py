"""Mixture-of-experts models through the whole engine (LLM.generate): greedy output equal
to transformers' ``generate``, independent of the batch around a request and of chunked
prefill, and token-identical with prefix caching and speculative decoding on and off."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.testing.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

MODELS = {
    "granite-moe": (
        "granitemoehybrid", "MAMMA",
        dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48),
    ),
    "nemotron-moe": (
        "nemotron_h", "ME*-ME",
        dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
             routed_scaling_factor=1.5),
    ),
    "qwen3-next-moe": (
        "qwen3_next", "MMAM", dict(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]),
    ),
    "qwen3.5-moe": ("qwen3_5_moe", "MMAM", dict(num_experts_per_tok=3)),
}
# Seeds whose greedy outputs repeat enough for n-gram drafts to be accepted.
SEEDS = {"qwen3.5-moe": 22}


@pytest.fixture(scope="module", params=list(MODELS))
def moe_ckpt(request, tmp_path_factory):
    arch, layers, extra = MODELS[request.param]
    return make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param),
                                seed=SEEDS.get(request.param, 21), layers=layers, **extra)


def _models(default: set[str]):
    """``moe_ckpt``'s models for one test, those outside ``default`` marked ``slow`` (the
    same engine path on another routing flavour; the parity and caching tests keep all)."""
    return pytest.mark.parametrize(
        "moe_ckpt", [pytest.param(m, marks=() if m in default else pytest.mark.slow)
                     for m in MODELS], indirect=True)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_generate(moe_ckpt):
    import transformers

    rng = random.Random(5)
    prompts = [_rand(rng, n) for n in (5, 23, 40)]
    ours = _tokens(LLM(moe_ckpt, max_num_seqs=4).generate(prompts, GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert got == ref


@_models({"nemotron-moe", "qwen3.5-moe"})
def test_batch_invariance_and_chunked_prefill(moe_ckpt):
    rng = random.Random(6)
    prompts = [_rand(rng, rng.randint(3, 60)) for _ in range(10)]
    single = LLM(moe_ckpt, max_num_seqs=1, enable_prefix_caching=False)
    alone = [_tokens(single.generate([p], GREEDY))[0] for p in prompts]
    batched = _tokens(LLM(moe_ckpt, max_num_seqs=16).generate(prompts, GREEDY))
    chunked = _tokens(
        LLM(moe_ckpt, max_num_seqs=16, max_num_batched_tokens=7).generate(prompts, GREEDY)
    )
    assert batched == alone
    assert chunked == batched


def test_prefix_caching_and_speculation_are_token_identical(moe_ckpt):
    rng = random.Random(7)
    motif = _rand(rng, 7)
    prompts = [motif * 6, _rand(rng, 30), motif * 3 + _rand(rng, 5) + motif, _rand(rng, 4) * 8]
    reference = _tokens(LLM(moe_ckpt, enable_prefix_caching=False).generate(prompts, GREEDY))
    for caching, spec in ((True, None), (False, 3), (True, 3)):
        config = None
        if spec:
            config = {"method": "ngram", "num_speculative_tokens": spec,
                      "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        llm = LLM(moe_ckpt, enable_prefix_caching=caching, state_interval=16,
                  speculative_config=config)
        llm.engine.check_integrity_every_step = True
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        # Again: prefix hits now (when caching), with speculation on top.
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        stats = llm.stats()
        if caching:
            assert stats["prefix_hit_tokens"] > 0
        if spec:
            assert stats["spec_accepted_tokens"] > 0


@_models({"nemotron-moe", "qwen3-next-moe"})
def test_decode_graph_path_with_grouped_kernels(moe_ckpt, monkeypatch):
    """The decode-graph step (its static buffers and padding rows; no capture on the CPU)
    with the grouped Triton experts, as a GPU decode step runs them, gives the eager
    loop's tokens."""
    from hybridserve.config import KernelPolicy
    from hybridserve.engine.engine_core import EngineCore

    rng = random.Random(8)
    prompts = [_rand(rng, 9), _rand(rng, 4), _rand(rng, 6)]  # a bucket of 4: one padding row
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = _tokens(LLM(moe_ckpt, max_num_seqs=4).generate(prompts, params))
    llm = LLM(moe_ckpt, max_num_seqs=4, kernel_policy=KernelPolicy(moe="triton"))
    eng = llm.engine
    llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                            eng.eos_token_ids, enforce_eager=False)
    assert _tokens(llm.generate(prompts, params)) == reference
    assert llm.engine.runner.graphs.counters["graph_steps"] > 0
