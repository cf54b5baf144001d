"""One rank's cut of a model, without spawning ranks: the slices each rank reads from the
checkpoint, and what tensor parallelism refuses (tests/distributed/test_tensor_parallel.py
runs the ranks)."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM
from hybridserve.distributed.shard import ShardLayout, load_model_shard
from hybridserve.models.config import ConfigError, ModelConfig
from hybridserve.models.loader import load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint, tiny_config


class OneRank:
    """A group of which only rank ``rank`` is here: enough to build and load a shard."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _split_in_proj(w: torch.Tensor, i: int, gn: int, h: int):
    z, x, b, c, dt = w.split([i, i, gn, gn, h])
    return z, x, b, c, dt


@pytest.mark.parametrize("groups", [2, 1])
def test_each_rank_reads_exactly_its_slices(tmp_path, groups):
    """Granite 4.0-H (``MAMMA``, one KV head so KV heads are replicated when there are
    fewer than ranks, tied embeddings, a vocabulary that does not divide by 2): every
    weight of each rank is the documented slice of the full one, the ranks' slices of a
    split weight tile it, replicated ones are equal, and a rank reads well under the
    whole checkpoint."""
    path = make_tiny_checkpoint(
        "granitemoehybrid", tmp_path / "g", seed=1, mamba_n_groups=groups,
        num_key_value_heads=1, vocab_size=251, tie_word_embeddings=True,
        num_local_experts=4, num_experts_per_tok=2,
    )
    full = load_model(path)
    fp = dict(full.named_parameters())
    m = full.config.mamba
    i, gn, h, n = m.intermediate_size, m.n_groups * m.d_state, m.n_heads, m.d_state
    ranks = [load_model_shard(path, OneRank(r, 2)) for r in range(2)]
    total = sum(p.numel() * 4 for p in full.parameters())
    pre = "model.layers.0.mamba."
    for r, shard in enumerate(ranks):
        sp = dict(shard.named_parameters())
        # Mamba: this rank's heads of z, x and dt; its groups of B and C (all of the one
        # group when n_groups == 1).
        z, x, b, c, dt = _split_in_proj(fp[pre + "in_proj.weight"], i, gn, h)
        lz, lx, lb, lc, ldt = _split_in_proj(sp[pre + "in_proj.weight"], i // 2,
                                             gn // 2 if groups == 2 else gn, h // 2)
        half = slice(r * i // 2, (r + 1) * i // 2)
        assert torch.equal(lz, z[half]) and torch.equal(lx, x[half])
        assert torch.equal(ldt, dt[r * h // 2 : (r + 1) * h // 2])
        g = slice(r * n, (r + 1) * n) if groups == 2 else slice(0, n)
        assert torch.equal(lb, b[g]) and torch.equal(lc, c[g])
        conv = fp[pre + "conv1d.weight"]
        assert torch.equal(sp[pre + "conv1d.weight"],
                           torch.cat([conv[:i][half], conv[i : i + gn][g], conv[i + gn :][g]]))
        for name in ("dt_bias", "A_log", "D"):
            assert torch.equal(sp[pre + name], fp[pre + name][r * h // 2 : (r + 1) * h // 2])
        assert torch.equal(sp[pre + "norm.weight"], fp[pre + "norm.weight"][half])
        assert torch.equal(sp[pre + "out_proj.weight"], fp[pre + "out_proj.weight"][:, half])
        # Attention: two of the four query heads, the one KV head on both ranks.
        att = "model.layers.1.self_attn."
        q = slice(r * 32, (r + 1) * 32)
        assert torch.equal(sp[att + "q_proj.weight"], fp[att + "q_proj.weight"][q])
        assert torch.equal(sp[att + "k_proj.weight"], fp[att + "k_proj.weight"])
        assert torch.equal(sp[att + "o_proj.weight"], fp[att + "o_proj.weight"][:, q])
        # The fused MLP: this rank's columns of both the gate and the up half.
        mlp = "model.layers.0.shared_mlp."
        w = fp[mlp + "input_linear.weight"]
        cols = slice(r * 64, (r + 1) * 64)
        assert torch.equal(sp[mlp + "input_linear.weight"],
                           torch.cat([w[:128][cols], w[128:][cols]]))
        assert torch.equal(sp[mlp + "output_linear.weight"], fp[mlp + "output_linear.weight"][:, cols])
        # Experts (Granite's fused tensors): this rank's columns of every expert, gate
        # and up halves; the router whole.
        moe = "model.layers.0.block_sparse_moe."
        w = fp[moe + "experts.gate_up_proj"]
        assert torch.equal(sp[moe + "experts.gate_up_proj"],
                           torch.cat([w[:, :128][:, cols], w[:, 128:][:, cols]], dim=1))
        assert torch.equal(sp[moe + "experts.down_proj"], fp[moe + "experts.down_proj"][..., cols])
        assert torch.equal(sp[moe + "router.weight"], fp[moe + "router.weight"])
        # Replicated: the embedding and the norms. The tied head: 126 rows of the
        # embedding per rank, the last rank's padded with zeros.
        emb = "model.embed_tokens.weight"
        assert torch.equal(sp[emb], fp[emb])
        head = sp["lm_head.weight"]
        assert head.shape == (126, 64)
        rows = fp[emb][r * 126 : (r + 1) * 126]
        assert torch.equal(head[: len(rows)], rows) and not head[len(rows) :].any()
        assert shard.load_stats.bytes_read < 0.75 * total
    # Row-parallel weights tile the full one; the dt heads too.
    assert torch.equal(
        torch.cat([dict(s.named_parameters())[pre + "out_proj.weight"] for s in ranks], dim=1),
        fp[pre + "out_proj.weight"],
    )
    # Each rank's pages hold its heads' SSM states and its conv channels.
    spec = ranks[0].cache_spec
    assert spec.num_kv_heads == 1
    conv, ssm = spec.state_tensors[0]
    assert ssm.shape == (h // 2, m.head_dim, m.d_state)
    assert conv.shape == (i // 2 + 2 * (gn // 2 if groups == 2 else gn), m.d_conv - 1)


_CLASSES = {"nemotron_h": "NemotronHForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
            "bamba": "BambaForCausalLM"}


def test_gated_deltanet_and_gated_attention_slices(tmp_path):
    """Qwen3.5 (unfused projections; 2 key heads of 2 value heads each; gated attention):
    rank r holds key head r, value heads 2r and 2r+1, their conv channels (q, k, v) and
    z / b / a rows, its query heads with their gates, and out_proj's columns of its
    value heads."""
    path = make_tiny_checkpoint("qwen3_5", tmp_path / "q", seed=2)
    fp = dict(load_model(path).named_parameters())
    pre, att = "model.layers.0.linear_attn.", "model.layers.2.self_attn."
    for r in range(2):
        sp = dict(load_model_shard(path, OneRank(r, 2)).named_parameters())
        k, v = slice(16 * r, 16 * (r + 1)), slice(32 * r, 32 * (r + 1))
        qkv = fp[pre + "in_proj_qkv.weight"]
        want = torch.cat([qkv[:32][k], qkv[32:64][k], qkv[64:][v]])
        assert torch.equal(sp[pre + "in_proj_qkv.weight"], want)
        conv = fp[pre + "conv1d.weight"]
        assert torch.equal(sp[pre + "conv1d.weight"],
                           torch.cat([conv[:32][k], conv[32:64][k], conv[64:][v]]))
        assert torch.equal(sp[pre + "in_proj_z.weight"], fp[pre + "in_proj_z.weight"][v])
        for name in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
            assert torch.equal(sp[pre + name], fp[pre + name][2 * r : 2 * r + 2])
        assert torch.equal(sp[pre + "out_proj.weight"], fp[pre + "out_proj.weight"][:, v])
        assert torch.equal(sp[pre + "norm.weight"], fp[pre + "norm.weight"])
        # Query heads 2r, 2r+1, each 16 query rows then 16 gate rows.
        assert torch.equal(sp[att + "q_proj.weight"], fp[att + "q_proj.weight"][64 * r : 64 * (r + 1)])
        assert torch.equal(sp[att + "k_proj.weight"], fp[att + "k_proj.weight"][k])
        assert torch.equal(sp[att + "q_norm.weight"], fp[att + "q_norm.weight"])


def _config(tmp_path, arch, **overrides) -> ModelConfig:
    d = tmp_path / arch
    cfg = tiny_config(arch, **overrides)
    cfg.architectures = [_CLASSES[arch]]
    cfg.save_pretrained(d)
    return ModelConfig.from_pretrained(d)


def test_what_is_refused_names_the_knob(tmp_path):
    """Layouts that cannot be cut, families not sharded yet, and engine options that do
    not run under tensor parallelism fail before any rank starts, naming what to change."""
    moe = _config(tmp_path, "nemotron_h", layers="M*E", moe_intermediate_size=33)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: expert width .*=33"):
        ShardLayout.of(moe, 0, 2)
    gdn = _config(tmp_path, "qwen3_5")
    with pytest.raises(ConfigError, match="Gated DeltaNet num_k_heads=2 does not divide"):
        ShardLayout.of(gdn, 0, 4)
    # 6 heads in 3 groups: 3 neither divides by 2 nor divides 2.
    odd = _config(tmp_path, "bamba", hidden_size=96, mamba_n_heads=6, mamba_d_head=32,
                  mamba_n_groups=3)
    with pytest.raises(ConfigError, match="n_groups=3 neither divides"):
        ShardLayout.of(odd, 1, 2)
    with pytest.raises(ConfigError, match="n_heads=6 does not divide"):
        ShardLayout.of(odd, 0, 4)
    # 4 query heads and 2 KV heads over 4 ranks: KV heads replicated, one per pair.
    ok = _config(tmp_path, "nemotron_h", mamba_num_heads=8, n_groups=2)
    layout = ShardLayout.of(ok, 3, 4)
    assert layout.kv_heads == (1, 2) and layout.mamba_groups == (1, 2)
    assert layout.norm_spans_ranks
    assert ShardLayout.of(ok, 1, 2).mamba_groups == (1, 2)
    assert not ShardLayout.of(ok, 1, 2).norm_spans_ranks
    for kwargs, knob in (
        ({"enforce_eager": False}, "enforce_eager"),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, "ngram"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ):
        with pytest.raises(ValueError, match=knob):
            LLM(tmp_path / "nemotron_h", **{"tensor_parallel_size": 2, **kwargs})


def test_tensor_parallel_size_flag():
    """``--tensor-parallel-size`` (``-tp``) of ``serve`` and ``generate`` reaches ``LLM``."""
    from hybridserve.cli import build_parser, llm_kwargs_from_args

    parser = build_parser()
    assert llm_kwargs_from_args(parser.parse_args(["serve", "--tensor-parallel-size", "2"]))[
        "tensor_parallel_size"] == 2
    assert llm_kwargs_from_args(parser.parse_args(["generate", "-tp", "4", "x"]))[
        "tensor_parallel_size"] == 4
    assert llm_kwargs_from_args(parser.parse_args(["serve"]))["tensor_parallel_size"] == 1
