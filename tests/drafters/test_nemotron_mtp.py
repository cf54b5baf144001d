"""The Nemotron-H MTP head (``num_nextn_predict_layers``, ``mtp_layers_block_type``) as a
drafter: greedy output is the target's with the prefix cache off and on, the hits are
those of a run without speculation, a head built to equal the target is accepted, the
loader takes the published weight names and refuses what it cannot run, and the head
computes the published structure (checked against a hand-written torch reference:
transformers has no Nemotron-H MTP modules)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_helpers import (
    assert_every_mtp_draft_accepted,
    assert_greedy_workloads_match,
    assert_mtp_drafts_match_dense,
    copy_checkpoint,
    motif_workload,
    output_tokens,
    rand_tokens,
    run_aborting_duplicates,
)

from hybridserve import LLM, SamplingParams
from hybridserve.models.batch import ForwardBatch
from hybridserve.testing.tiny_models import make_tiny_checkpoint
from hybridserve.testing.tiny_mtp import add_mtp_head, dense_hidden

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _mtp(d: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": d}


@pytest.fixture(scope="module")
def nemotron_mtp(tmp_path_factory):
    """A Nemotron-H target with every layer kind (Mamba2, attention, MoE, MLP) and a
    random ``["attention", "moe"]`` MTP head, as Nemotron 3 Super publishes it."""
    path = make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nhmtp"), seed=5, layers="M*EM-")
    return add_mtp_head(path, seed=1)


def _equal_head(path: Path, context_free: bool = False) -> Path:
    """Make the MTP head of an attention + MoE target (layers ``*E``, MTP stack
    ``["attention", "moe"]``) compute the target itself: embedding rows of RMS 1 and
    ``enorm`` undoing its epsilon (so ``enorm`` of an embedding is the embedding),
    ``eh_proj = [I, 0]`` (the hidden state is ignored), the MTP layers the target's
    layers and ``final_layernorm`` its ``norm_f``. Slot ``t`` then is the target at
    position ``t + 1`` over tokens ``1 .. t + 1``: the head never sees token 0.
    ``context_free``: the target's attention output projection is zero (in the head
    too), so nothing depends on context and every draft is the target's token."""
    file = path / "model.safetensors"
    eps = json.loads((path / "config.json").read_text())["layer_norm_epsilon"]
    w = load_file(str(file))
    e = w["backbone.embeddings.weight"]
    w["backbone.embeddings.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    if context_free:
        w["backbone.layers.0.mixer.o_proj.weight"].zero_()
    hidden = e.shape[1]
    for name in [n for n in w if n.startswith("mtp.")]:
        del w[name]
    for name in [n for n in w if n.startswith("backbone.layers.")]:
        w["mtp." + name.removeprefix("backbone.")] = w[name].clone()
    w["mtp.layers.0.enorm.weight"] = torch.full((hidden,), (1 + eps) ** 0.5)
    w["mtp.layers.0.hnorm.weight"] = torch.ones(hidden)
    w["mtp.layers.0.eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    w["mtp.layers.1.final_layernorm.weight"] = w["backbone.norm_f.weight"].clone()
    save_file(w, str(file), metadata={"format": "pt"})
    return path


def _equal_checkpoint(root: Path, context_free: bool) -> Path:
    path = make_tiny_checkpoint("nemotron_h", root, seed=6, layers="*E")
    return _equal_head(add_mtp_head(path), context_free)


@pytest.fixture(scope="module")
def nemotron_equal(tmp_path_factory):
    return _equal_checkpoint(tmp_path_factory.mktemp("nheq"), context_free=False)


@pytest.fixture(scope="module")
def nemotron_bigram(tmp_path_factory):
    return _equal_checkpoint(tmp_path_factory.mktemp("nhbig"), context_free=True)


@pytest.fixture(scope="module")
def references(nemotron_mtp):
    llm = LLM(nemotron_mtp, enable_prefix_caching=False)
    return {s: output_tokens(llm.generate(motif_workload(s), GREEDY)) for s in (0, 1)}


# ---- greedy output and hits ----------------------------------------------------------


# By default one case per draft length, the cache off for d = 1 and on for d = 3; the
# other two are ``slow``.
@pytest.mark.parametrize("caching,d", [
    pytest.param(c, d, marks=() if (c, d) in {(False, 1), (True, 3)} else pytest.mark.slow)
    for c in (False, True) for d in (1, 3)])
def test_greedy_identical_with_nemotron_mtp(caching, d, nemotron_mtp, references):
    llm = LLM(nemotron_mtp, enable_prefix_caching=caching, state_interval=16,
              speculative_config=_mtp(d))
    assert type(llm.engine.drafter.head).__name__ == "NemotronHMtpHead"
    assert_greedy_workloads_match(llm, references, GREEDY, caching)


def _trace(path, spec):
    rng = random.Random(6)
    convo = [rand_tokens(rng, 18), rand_tokens(rng, 25)]
    llm = LLM(path, state_interval=16, speculative_config=spec)
    hits = []
    for _ in range(3):
        outs = llm.generate(convo, GREEDY)
        hits.append([o.num_cached_tokens for o in outs])
        convo = [c + o.outputs[0].token_ids + [7, 8, 9] for c, o in zip(convo, outs)]
    checkpoints = sorted((c.length, key) for key, c in llm.engine.scheduler.states.checkpoints.items())
    return hits, checkpoints, output_tokens(outs), llm.stats()


@pytest.mark.parametrize("which", ["random", "bigram"])
def test_hits_unchanged_with_nemotron_mtp(which, nemotron_mtp, nemotron_bigram):
    """The same multi-turn trace with and without MTP speculation: the same cached-token
    counts per request, the same checkpoints (grid, junction, prompt end, finished), the
    same tokens. With the context-free head equal to its target every draft is accepted,
    so rows cross grid points mid-row."""
    path = nemotron_mtp if which == "random" else nemotron_bigram
    hits, ckpts, toks, _ = _trace(path, None)
    assert sum(map(sum, hits)) > 0 and len(ckpts) > 4
    s_hits, s_ckpts, s_toks, stats = _trace(path, _mtp(3))
    assert (s_hits, s_ckpts, s_toks) == (hits, ckpts, toks)
    assert stats["spec_draft_tokens"] > 0
    if which == "bigram":
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]


@pytest.mark.parametrize("caching", [False, True])
def test_context_free_head_equal_to_the_target_accepts_every_draft(caching, nemotron_bigram):
    assert_every_mtp_draft_accepted(nemotron_bigram, (caching,), GREEDY)


def test_head_equal_to_the_target_accepts_most_drafts(nemotron_equal, tmp_path):
    """With attention, the head equal to the target is the target over tokens 1 .. t + 1
    (checked on one sequence); missing token 0 still changes some drafts of the tiny
    random model, most are accepted, and none of the random head's."""
    llm = LLM(nemotron_equal, enable_prefix_caching=False, speculative_config=_mtp(1))
    toks = motif_workload(1)[1]
    with torch.inference_mode():
        hidden = dense_hidden(llm.model, toks)
        shifted = dense_hidden(llm.model, toks[1:])
        head = llm.engine.drafter.head
        q = len(toks) - 1
        caches = head.cache_spec.allocate(2, 16, 1, torch.float32, torch.float32, "cpu")
        batch = ForwardBatch(
            query_start=[0, q], num_computed=[0], positions=torch.arange(q), context_lens=[q],
            block_tables=torch.arange(2, dtype=torch.int32)[None], slot_mapping=torch.arange(q),
            state_in_page=[-1], state_out_row=[], state_out_offset=[], state_out_page=[],
        )
        y = head(llm.model.model.embed(torch.tensor(toks[1:])), hidden[:q], batch, caches)
        assert torch.allclose(y, shifted, atol=1e-4)
    prompts = motif_workload(0) + motif_workload(1)
    rand = add_mtp_head(make_tiny_checkpoint("nemotron_h", tmp_path / "rand", seed=6, layers="*E"))
    refs = {p: output_tokens(LLM(p, enable_prefix_caching=False).generate(prompts, GREEDY)) for p in (nemotron_equal, rand)}
    for path, d, low, high in ((nemotron_equal, 1, 0.75, 1.0), (nemotron_equal, 3, 0.6, 1.0), (rand, 3, 0.0, 0.1)):
        llm = LLM(path, enable_prefix_caching=False, speculative_config=_mtp(d))
        assert output_tokens(llm.generate(prompts, GREEDY)) == refs[path]
        s = llm.stats()
        assert s["spec_draft_tokens"] > 50
        assert low <= s["spec_accepted_tokens"] / s["spec_draft_tokens"] <= high, (path, d, s)


def test_nemotron_mtp_drafts_equal_a_from_scratch_computation(nemotron_mtp):
    """Every proposal the engine's drafter makes (incremental catch-up from the hidden
    states handed over after prefill and verify steps) equals the head run from scratch
    on the dense hidden states of the same prefix."""
    llm = LLM(nemotron_mtp, enable_prefix_caching=False, speculative_config=_mtp(3))
    assert_mtp_drafts_match_dense(llm, motif_workload(3), GREEDY)


# ---- the published structure -----------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal_attention(mixer, x: torch.Tensor, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
    """Nemotron-H attention by hand: no RoPE, grouped K/V, causal, scale dim ** -0.5."""
    t = x.shape[0]
    q = (x @ mixer.q_proj.weight.T).view(t, heads, dim).transpose(0, 1)
    k = (x @ mixer.k_proj.weight.T).view(t, kv_heads, dim).transpose(0, 1)
    v = (x @ mixer.v_proj.weight.T).view(t, kv_heads, dim).transpose(0, 1)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(1, 2)) * dim**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * dim)
    return out @ mixer.o_proj.weight.T


def test_nemotron_mtp_head_is_the_published_structure(nemotron_mtp):
    """One row of 7 slots against a hand-written reference of the published layout::

        x  = eh_proj(cat([enorm(e), hnorm(h)]))          # embedding first
        x += attention(layers.0.norm(x))
        x += moe(layers.1.norm(x))
        y  = layers.1.final_layernorm(x)

    and a planted swap of the concatenation's halves changes the result."""
    llm = LLM(nemotron_mtp, speculative_config=_mtp(1))
    head = llm.engine.drafter.head
    cfg = llm.model.config
    a, eps, hsz = cfg.attention, cfg.norm_eps, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    t = 7
    e, h = torch.randn(t, hsz, generator=g), torch.randn(t, hsz, generator=g)
    caches = head.cache_spec.allocate(1, 16, 1, torch.float32, torch.float32, "cpu")
    batch = ForwardBatch(
        query_start=[0, t], num_computed=[0], positions=torch.arange(t), context_lens=[t],
        block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(t),
        state_in_page=[-1], state_out_row=[], state_out_offset=[], state_out_page=[],
    )
    l0, l1 = head.layers
    with torch.inference_mode():
        y = head(e, h, batch, caches)

        def reference(first, second):
            x = torch.cat([_rms(first, l0.enorm.weight, eps), _rms(second, l0.hnorm.weight, eps)], -1)
            x = x @ l0.eh_proj.weight.T
            x = x + _causal_attention(l0.mixer, _rms(x, l0.norm.weight, eps), a.num_heads, a.num_kv_heads, a.head_dim)
            x = x + l1.mixer(_rms(x, l1.norm.weight, eps))
            return _rms(x, l1.final_layernorm.weight, eps)

        assert torch.allclose(y, reference(e, h), atol=1e-5)
        swapped = reference(h, e)
        assert not torch.allclose(y, swapped, atol=1e-3)


# ---- the loader ------------------------------------------------------------------------


def test_loader_takes_the_published_names(nemotron_mtp, tmp_path):
    names = load_file(str(nemotron_mtp / "model.safetensors")).keys()
    mtp = sorted(n for n in names if n.startswith("mtp."))
    # The names of the published checkpoints (vLLM / SGLang load these): fusion on the
    # first layer, the output norm on the last, one tensor per expert.
    for name in (
        "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.0.mixer.o_proj.weight",
        "mtp.layers.1.norm.weight", "mtp.layers.1.mixer.gate.weight",
        "mtp.layers.1.mixer.gate.e_score_correction_bias", "mtp.layers.1.mixer.experts.0.up_proj.weight",
        "mtp.layers.1.mixer.experts.7.down_proj.weight", "mtp.layers.1.mixer.shared_experts.up_proj.weight",
        "mtp.layers.1.final_layernorm.weight",
    ):
        assert name in mtp
    head = LLM(nemotron_mtp, speculative_config=_mtp(1)).engine.drafter.head
    w = load_file(str(nemotron_mtp / "model.safetensors"))
    assert torch.equal(head.layers[1].mixer.experts.up_proj[7], w["mtp.layers.1.mixer.experts.7.up_proj.weight"])
    assert torch.equal(head.layers[0].eh_proj.weight, w["mtp.layers.0.eh_proj.weight"])

    # The legacy pattern string instead of the list says the same.
    def legacy(raw):
        del raw["mtp_layers_block_type"]
        raw["mtp_hybrid_override_pattern"] = "*E"

    old = copy_checkpoint(nemotron_mtp, tmp_path / "legacy", config=legacy)
    assert output_tokens(LLM(old, speculative_config=_mtp(2)).generate(motif_workload(0)[:2], GREEDY)) == output_tokens(
        LLM(nemotron_mtp, speculative_config=_mtp(2)).generate(motif_workload(0)[:2], GREEDY)
    )


def test_loader_refuses_what_it_cannot_run(nemotron_mtp, tmp_path):
    def drop(w):
        del w["mtp.layers.1.final_layernorm.weight"]

    with pytest.raises(ValueError, match=r"missing weight\(s\) \['mtp.layers.1.final_layernorm.weight'\]"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "a", weights=drop), speculative_config=_mtp(1))

    def extra(w):
        w["mtp.layers.1.mixer.experts.8.up_proj.weight"] = w["mtp.layers.1.mixer.experts.0.up_proj.weight"].clone()

    with pytest.raises(ValueError, match=r"unexpected MTP weight\(s\) \['mtp.layers.1.mixer.experts.8"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "b", weights=extra), speculative_config=_mtp(1))

    def two(raw):
        raw["num_nextn_predict_layers"] = 2

    with pytest.raises(ValueError, match="2 MTP layers declared; only one"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "c", config=two), speculative_config=_mtp(1))

    def mamba(raw):
        raw["mtp_layers_block_type"] = ["mamba", "moe"]

    with pytest.raises(ValueError, match=r"include \['mamba'\]; only attention, moe and mlp"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "d", config=mamba), speculative_config=_mtp(1))

    def bad(raw):
        raw["mtp_layers_block_type"] = ["attention", "conv"]

    with pytest.raises(ValueError, match="'mtp_layers_block_type': expected a non-empty list"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "e", config=bad), speculative_config=_mtp(1))

    def none(raw):
        raw["num_nextn_predict_layers"] = 0

    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(copy_checkpoint(nemotron_mtp, tmp_path / "f", config=none), speculative_config=_mtp(1))
    # The target alone still loads (its loader skips mtp.*) and runs without speculation.
    assert LLM(nemotron_mtp).generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


# ---- the request lifecycle ------------------------------------------------------------


def test_preemption_aborts_and_sampling_with_nemotron_mtp(nemotron_mtp, nemotron_bigram):
    """Few KV blocks (requests preempted and recomputed mid-speculation) and two aborts:
    the finished outputs are the target's, and the head's K/V blocks all come back.
    Sampled requests with the head (drafts sampled from its q) reproduce per seed."""
    rng = random.Random(7)
    prompts = [rand_tokens(rng, 10 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for path in (nemotron_mtp, nemotron_bigram):
        ref = output_tokens(LLM(path, enable_prefix_caching=False, max_model_len=64).generate(prompts, params))
        llm = LLM(path, state_interval=16, num_kv_blocks=12, max_model_len=64, speculative_config=_mtp(3))
        llm.engine.check_integrity_every_step = True
        engine = llm.engine
        done = run_aborting_duplicates(engine, prompts, params)
        assert [done[f"r{i}"] for i in range(6)] == ref
        stats = engine.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["preemptions"] > 0
        drafter = engine.drafter
        drafter.check_integrity()
        assert not drafter._seqs and not drafter._hidden
        assert drafter.blocks.num_free == drafter.blocks.num_blocks
    sampled = SamplingParams(n=4, max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)
    llm = LLM(nemotron_bigram, speculative_config=_mtp(3))
    first = [c.token_ids for c in llm.generate([prompts[0]], sampled)[0].outputs]
    s = llm.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    assert [c.token_ids for c in llm.generate([prompts[0]], sampled)[0].outputs] == first
