"""Cache sizing from a memory budget (hybridserve.engine.sizing), with a fake capacity."""

from __future__ import annotations

import logging

import pytest

from hybridserve import LLM
from hybridserve.engine import sizing

MiB = 2**20
GiB = 2**30


def _plan(**over):
    args = dict(
        capacity_bytes=100 * GiB, gpu_memory_utilization=0.9, weights_bytes=16 * GiB,
        activation_peak_bytes=4 * GiB, kv_block_bytes=2 * MiB, kv_block_size=16,
        state_page_bytes=100 * MiB, max_model_len=131072, max_num_seqs=16, pages_per_seq=4,
        checkpoint_memory_fraction=0.25,
    )
    args.update(over)
    return sizing.plan_memory(**args)


def test_split_follows_the_stated_rule():
    p = _plan()
    cache = int(100 * GiB * 0.9) - 16 * GiB - 4 * GiB
    live = 16 * 4 + 8
    rest = cache - live * 100 * MiB
    ckpt = int(rest * 0.25) // (100 * MiB)
    assert p.max_checkpoint_pages == ckpt
    assert p.num_state_pages == live + ckpt
    assert p.num_kv_blocks == (rest - ckpt * 100 * MiB) // (2 * MiB)
    # Everything fits in the usable memory, and almost nothing is left over.
    used = p.weights_bytes + p.activation_bytes + p.kv_bytes + p.state_bytes
    assert used <= p.usable_bytes < used + 2 * MiB
    assert p.max_len_requests == p.num_kv_blocks // (131072 // 16)
    line = p.log_line()
    for word in ("weights", "KV", "state", "checkpoints", "requests of max_model_len=131072"):
        assert word in line


def test_more_checkpoint_share_moves_memory_from_kv_to_checkpoints():
    lo, hi = _plan(checkpoint_memory_fraction=0.1), _plan(checkpoint_memory_fraction=0.5)
    assert hi.max_checkpoint_pages > lo.max_checkpoint_pages
    assert hi.num_kv_blocks < lo.num_kv_blocks
    assert hi.num_state_pages - hi.max_checkpoint_pages == lo.num_state_pages - lo.max_checkpoint_pages


def test_an_explicit_checkpoint_count_replaces_the_share_and_the_rest_goes_to_kv():
    share = _plan()
    fixed = _plan(checkpoint_pages=8)
    assert fixed.max_checkpoint_pages == 8
    assert fixed.num_state_pages == share.num_state_pages - share.max_checkpoint_pages + 8
    freed = (share.max_checkpoint_pages - 8) * 100 * MiB
    assert fixed.num_kv_blocks - share.num_kv_blocks == pytest.approx(freed / (2 * MiB), abs=1)
    with pytest.raises(ValueError, match="lower max_checkpoint_pages"):
        _plan(checkpoint_pages=10**6)


def test_free_memory_below_the_share_is_refused_naming_the_knob(monkeypatch):
    import torch

    # Another process holds 18 of 140 GiB: 0.9 of the device is not free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (122 * GiB, 140 * GiB))
    with pytest.raises(ValueError, match="lower gpu_memory_utilization") as err:
        sizing.check_free_memory("cuda:0", 0.9)
    assert "other processes hold 18.00 GiB" in str(err.value)
    sizing.check_free_memory("cuda:0", 0.85)
    sizing.check_free_memory("cpu", 1.0)  # RAM is not measured this way


@pytest.mark.parametrize(
    "over,knob",
    [
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(checkpoint_memory_fraction=1.0), "checkpoint_memory_fraction"),
        (dict(weights_bytes=95 * GiB), "raise gpu_memory_utilization"),
        (dict(max_num_seqs=4096), "lower max_num_seqs"),
        (dict(max_model_len=50_000_000), "lower max_model_len"),
    ],
)
def test_impossible_configurations_are_refused_naming_the_knob(over, knob):
    with pytest.raises(ValueError, match=knob):
        _plan(**over)


def test_llm_sizes_its_caches_from_a_fake_device(tiny_granite, monkeypatch, caplog):
    monkeypatch.setattr(sizing, "device_capacity_bytes", lambda device: 64 * MiB)
    with caplog.at_level(logging.INFO, logger="hybridserve"):
        llm = LLM(tiny_granite, gpu_memory_utilization=0.5, max_num_seqs=4)
    plan = llm.memory_plan
    cache = llm.config.cache
    assert cache.num_kv_blocks == plan.num_kv_blocks and cache.num_state_pages == plan.num_state_pages
    assert cache.max_checkpoint_pages == plan.max_checkpoint_pages > 0
    # max_model_len defaults to the model's own.
    assert llm.config.scheduler.max_model_len == llm.model_config.max_position_embeddings
    assert any("requests of max_model_len" in r.getMessage() for r in caplog.records)
    spec = llm.model.cache_spec
    total = cache.num_kv_blocks * spec.kv_block_bytes(16, llm.config.dtype) + cache.num_state_pages * spec.state_page_bytes(
        llm.config.dtype, cache.ssm_state_dtype
    )
    assert total + sizing.weights_bytes(llm.model) <= 32 * MiB
    out = llm.generate([[5, 6, 7, 8]], None)[0]
    assert len(out.outputs[0].token_ids) == 16
    # Explicit sizes keep working beside the utilization.
    llm = LLM(tiny_granite, gpu_memory_utilization=0.5, max_num_seqs=4, num_kv_blocks=64, max_model_len=512)
    assert llm.config.cache.num_kv_blocks == 64


def test_llm_refuses_a_model_length_that_cannot_fit(tiny_granite, monkeypatch):
    probe = LLM(tiny_granite, max_num_seqs=1, max_model_len=64)
    spec, dtype = probe.model.cache_spec, probe.config.dtype
    page = spec.state_page_bytes(dtype, probe.config.cache.ssm_state_dtype)
    # Room for the weights, the live state of one seat and 100 KV blocks: a sequence of
    # the model's 4,096 tokens needs 256.
    capacity = sizing.weights_bytes(probe.model) + (4 + 8) * page + 100 * spec.kv_block_bytes(16, dtype)
    monkeypatch.setattr(sizing, "device_capacity_bytes", lambda device: capacity)
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM(tiny_granite, gpu_memory_utilization=1.0, max_num_seqs=1)
    llm = LLM(tiny_granite, gpu_memory_utilization=1.0, max_num_seqs=1, max_model_len=1024)
    assert llm.memory_plan.max_len_requests == 1


def test_profile_forward_runs_the_largest_step(tiny_granite, tiny_qwen3_5):
    import torch

    for path in (tiny_granite, tiny_qwen3_5):
        llm = LLM(path, max_num_seqs=1, max_model_len=128)
        logits = sizing.profile_forward(llm.model, 100, 16, torch.float32, torch.float32, "cpu")
        assert logits.shape == (1, llm.model_config.vocab_size) and torch.isfinite(logits).all()
    assert sizing.profile_activation_peak(llm.model, 100, 16, torch.float32, torch.float32, "cpu") == 0
