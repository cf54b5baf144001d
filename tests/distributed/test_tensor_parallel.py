"""``tensor_parallel_size=2`` on the CPU (gloo, two processes, float32): greedy outputs
token-identical to one rank, with prefix caching and n-gram speculation on, for Mamba2
checkpoints whose ``n_groups`` divides and does not divide by 2; every rank's shard of a
checkpoint page reassembles to the single-rank page.

Starting the second rank costs seconds, so each test checks several things on one pair
of engines.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.models.config import ConfigError
from hybridserve.step import SchedulerOutput, Transfers
from hybridserve.testing.tiny_models import make_tiny_checkpoint, tiny_config

ENGINE = dict(max_num_seqs=4, num_kv_blocks=96, num_state_pages=96, max_model_len=256,
              kv_block_size=8, state_interval=16)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _reassemble(shards, config, groups_split: bool):
    """The single-rank state of each recurrent layer from the ranks' shards: SSM states
    are the ranks' heads in order. Mamba2 conv windows are the ranks' x channels in
    order, then B and C (the ranks' groups in order, or the one group every rank holds,
    which must be equal on every rank); Gated DeltaNet ones the ranks' q channels, then
    their k, then their v."""
    tp = len(shards)
    full = {}
    for layer in shards[0]:
        ssm = torch.cat([s[layer]["ssm"] for s in shards], dim=1)
        if layer in config.gdn_layers:
            g = config.gdn
            widths = [g.key_dim // tp, g.key_dim // tp, g.value_dim // tp]
            parts = [s[layer]["conv"].split(widths, dim=1) for s in shards]
            conv = torch.cat([p[j] for j in range(3) for p in parts], dim=1)
            full[layer] = {"conv": conv, "ssm": ssm}
            continue
        mamba = config.mamba
        i, n = mamba.intermediate_size, mamba.d_state
        gl = mamba.n_groups // tp if groups_split else 1
        xs, bs, cs = [], [], []
        for s in shards:
            x, b, c = s[layer]["conv"].split([i // tp, gl * n, gl * n], dim=1)
            xs.append(x), bs.append(b), cs.append(c)
        if not groups_split:
            for b, c in zip(bs[1:], cs[1:]):
                assert torch.equal(b, bs[0]) and torch.equal(c, cs[0])
            bs, cs = bs[:1], cs[:1]
        full[layer] = {"conv": torch.cat(xs + bs + cs, dim=1), "ssm": ssm}
    return full


def _check_pages_reassemble(one: LLM, tp: LLM, groups_split: bool) -> int:
    """Every checkpoint both engines hold: the ranks' shards of TP's page, reassembled,
    equal the one-rank engine's page (to float32 rounding: the all-reduces sum in
    another order). Returns how many were compared."""
    ours = tp.engine.scheduler.states.checkpoints
    theirs = one.engine.scheduler.states.checkpoints
    keys = [k for k in ours if k in theirs]
    pages = [ours[k].page for k in keys]
    shards = tp.engine.runner.gather_state_pages(pages)
    full = _reassemble(shards, one.model_config, groups_split)
    for layer, tensors in full.items():
        for name, t in tensors.items():
            ref = one.engine.runner.caches.states[layer][name][[theirs[k].page for k in keys]]
            torch.testing.assert_close(t, ref, rtol=1e-4, atol=1e-5)
    return len(keys)


def test_tp2_nemotron_h_groups_split_with_caching_and_speculation(tmp_path):
    """Nemotron-H (Mamba2 with 2 groups, so each rank holds one; attention with 2 KV heads;
    a plain MLP; latent mixtures of experts stored one tensor per expert): two rounds of prompts sharing a prefix, the second round extending the
    first's outputs, with n-gram speculation. TP=2 gives the one-rank engine's tokens and
    cache hits (and those of a one-rank engine with neither caching nor speculation), its
    verify rows ran drafts, and its checkpoint pages reassemble."""
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "nh", seed=3, n_groups=2,
                                layers="M*EM-E", moe_latent_size=24)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    shared = [7, 3, 9, 11, 7, 3, 9, 11, 40, 41, 42, 7, 3, 9, 11, 5] * 2
    first = [shared + [60, 61, 62], shared + [70, 7, 3, 9]]
    plain = LLM(path, enable_prefix_caching=False, **ENGINE)
    one = LLM(path, speculative_config=spec, **ENGINE)
    tp = LLM(path, speculative_config=spec, tensor_parallel_size=2, **ENGINE)
    try:
        want, _ = _generate(plain, first)
        got_one, _ = _generate(one, first)
        got, _ = _generate(tp, first)
        assert got == got_one == want
        second = [p + o + [12, 7, 3] for p, o in zip(first, got)]
        want2, _ = _generate(plain, second)
        got_one2, hits_one = _generate(one, second)
        got2, hits = _generate(tp, second)
        assert got2 == got_one2 == want2
        assert hits == hits_one and min(hits) >= 32
        stats = tp.stats()
        assert stats["spec_draft_tokens"] > 0
        assert stats["spec_accepted_tokens"] == one.stats()["spec_accepted_tokens"]
        assert _check_pages_reassemble(one, tp, groups_split=True) >= 4
    finally:
        tp.shutdown()


def test_tp2_granite_one_group_replicated(tmp_path):
    """Granite 4.0-H with one Mamba2 group (replicated on both ranks, so the gated norm
    spans the ranks and all-reduces its sums of squares), one KV head (replicated), tied
    embeddings, fused experts beside the shared MLP, and a vocabulary of 251 (the last rank's head shard padded), with
    n-gram speculation: TP=2 is token-identical to one rank, prefix hits, accepted drafts
    and prompt logprobs included, the replicated
    groups' conv
    channels are equal on both ranks, the pages reassemble, host-tier copies run on
    every rank, and a stopped engine refuses further steps; a checkpoint no rank can cut
    fails the constructor and leaves no rank running."""
    path = make_tiny_checkpoint(
        "granitemoehybrid", tmp_path / "g", seed=5, mamba_n_groups=1, num_key_value_heads=1,
        tie_word_embeddings=True, vocab_size=251, num_local_experts=4, num_experts_per_tok=2,
    )
    prompts = [list(range(20, 56)), list(range(20, 52)) + [3, 1, 4, 1, 5]]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    one = LLM(path, checkpoint_offload_pages=4, speculative_config=spec, **ENGINE)
    tp = LLM(path, tensor_parallel_size=2, checkpoint_offload_pages=4, speculative_config=spec,
             **ENGINE)
    try:
        assert tp.model.shard_layout.norm_spans_ranks
        for _ in range(2):  # the second round hits the first's checkpoints
            want, hits_one = _generate(one, prompts)
            got, hits = _generate(tp, prompts)
            assert got == want and hits == hits_one
        assert max(hits) >= 16
        # Speculation ran on the replicated-group model too, drafts accepted alike.
        assert tp.stats()["spec_draft_tokens"] > 0
        assert tp.stats()["spec_accepted_tokens"] == one.stats()["spec_accepted_tokens"]
        # Prompt logprobs (a prefill computes logits at every prompt position, which
        # every rank joins): the same top tokens, values to float32 rounding.
        lp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, logprobs=1)
        a, b = (llm.generate([list(range(60, 90))], lp, use_tqdm=False)[0] for llm in (one, tp))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == 30
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                        b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank
        assert _check_pages_reassemble(one, tp, groups_split=False) >= 2
        # Host-tier copies run on every rank: a checkpoint page offloaded to host page 0
        # and restored into a free page, which rank 0 poisons first, holds on every
        # rank what the checkpoint page holds there.
        runner = tp.engine.runner
        ckpt = next(iter(tp.engine.scheduler.states.checkpoints.values())).page
        free = tp.engine.scheduler.states.free[0]
        for tensors in runner.caches.states.values():
            for t in tensors.values():
                t[free] = float("nan")
        runner.run_transfers(SchedulerOutput([], transfers=Transfers([(ckpt, 0)], [(0, free)])))
        for shard in runner.gather_state_pages([ckpt, free]):
            for tensors in shard.values():
                for t in tensors.values():
                    assert torch.equal(t[0], t[1])
    finally:
        tp.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        tp.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    # A checkpoint no rank can cut fails the constructor with the rank's error, and the
    # spawned rank is gone.
    bad = tmp_path / "bad"
    cfg = tiny_config("granitemoehybrid", mamba_n_heads=6, mamba_d_head=32, hidden_size=96,
                      mamba_n_groups=3)
    cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    cfg.save_pretrained(bad)
    with pytest.raises(ConfigError, match="n_groups=3 neither divides"):
        LLM(bad, tensor_parallel_size=2, **ENGINE)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hybridserve-tp")]


def test_tp2_qwen3_next_gated_deltanet_moe(tmp_path):
    """Qwen3-Next (Gated DeltaNet with its per-key-head fused projections: each rank holds
    one of the 2 key heads and its 2 value heads; gated attention with q/k norms; experts
    with a gated shared expert), prefix caching and n-gram speculation over two rounds:
    token-identical to one rank with the same hits, and the Gated DeltaNet pages
    reassemble (conv windows: the ranks' q, then k, then v channels)."""
    path = make_tiny_checkpoint("qwen3_next", tmp_path / "qn", seed=4, layers="MMAM",
                                num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1])
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    # Sized by gpu_memory_utilization (the cache sizes given still win): every rank runs
    # the sizing profile before the engine starts.
    sized = dict(ENGINE, gpu_memory_utilization=0.01, max_checkpoint_pages=24)
    one = LLM(path, speculative_config=spec, **sized)
    tp = LLM(path, speculative_config=spec, tensor_parallel_size=2, **sized)
    try:
        prompts = [[9, 8, 7, 6] * 5 + [1, 2, 3], [9, 8, 7, 6] * 5 + [50, 9, 8]]
        want, _ = _generate(one, prompts)
        got, _ = _generate(tp, prompts)
        assert got == want
        second = [p + o + [9, 8] for p, o in zip(prompts, got)]
        want2, hits_one = _generate(one, second)
        got2, hits = _generate(tp, second)
        assert got2 == want2 and hits == hits_one and min(hits) >= 16
        assert tp.stats()["spec_draft_tokens"] > 0
        assert _check_pages_reassemble(one, tp, groups_split=True) >= 2
    finally:
        tp.shutdown()


def test_unguarded_script_fails_fast(tmp_path):
    """A script that builds a tensor-parallel LLM at its top level (no main guard): the
    spawned rank dies re-importing it, and rank 0 says so within seconds instead of
    waiting out the start-up timeout."""
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "m", seed=1, layers="M*")
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from hybridserve import LLM\n"
        f"LLM({str(path)!r}, tensor_parallel_size=2, num_kv_blocks=16, num_state_pages=16,"
        " max_model_len=64)\n"
    )
    root = Path(__file__).resolve().parents[2]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode != 0
    assert "rank 1 exited" in proc.stderr and "__main__" in proc.stderr
    assert time.monotonic() - started < 120
