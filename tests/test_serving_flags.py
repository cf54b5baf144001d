"""The engine flags of ``hybridserve serve`` for the host tier and memory sizing."""

from __future__ import annotations

import argparse

import pytest

from hybridserve.cli import add_engine_arguments, llm_from_args
from hybridserve.engine import sizing
from hybridserve.server.cli import startup_line


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


def test_checkpoint_offload_gib_sizes_the_host_tier(tiny_granite):
    llm = llm_from_args(_args("--model", str(tiny_granite), "--checkpoint-offload-gib", "0.01",
                              "--max-num-seqs", "2", "--max-model-len", "256"))
    cfg = llm.config
    page = llm.model.cache_spec.state_page_bytes(cfg.dtype, cfg.cache.ssm_state_dtype)
    host = llm.engine.scheduler.host
    assert host.num_pages == int(0.01 * 2**30 // page) > 0
    assert llm.engine.runner.host_pool.num_pages == host.num_pages
    assert f"host_checkpoint_pages={host.num_pages}" in startup_line(llm, "m", "127.0.0.1", 1)
    off = llm_from_args(_args("--model", str(tiny_granite), "--max-num-seqs", "2", "--max-model-len", "256"))
    assert off.engine.scheduler.host.num_pages == 0 and off.engine.runner.host_pool is None


def test_gpu_memory_utilization_flag(tiny_granite, monkeypatch):
    monkeypatch.setattr(sizing, "device_capacity_bytes", lambda device: 64 * 2**20)
    llm = llm_from_args(_args("--model", str(tiny_granite), "--gpu-memory-utilization", "0.5",
                              "--checkpoint-memory-fraction", "0.5", "--max-num-seqs", "2"))
    plan = llm.memory_plan
    assert llm.config.cache.num_kv_blocks == plan.num_kv_blocks
    assert llm.config.cache.max_checkpoint_pages == plan.max_checkpoint_pages
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        llm_from_args(_args("--model", str(tiny_granite), "--gpu-memory-utilization", "1.5"))
