"""The host tier of state checkpoints (hybridserve.cache.host_tier): evicted checkpoints
move to a host pool and come back bit-exact; hit rates survive a working set larger than
the device budget; outputs do not change with the tier on."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.host_tier import HostCheckpointIndex, HostStatePool, Transfers
from hybridserve.config import CacheConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


# ---- the index ---------------------------------------------------------------------


def test_index_lru_eviction_quarantine_and_kv_drop():
    idx = HostCheckpointIndex(2)
    assert idx.offload(10, 16, device_page=5, prefix_hashes=[1, 10])
    assert idx.offload(20, 32, device_page=6, prefix_hashes=[1, 2, 20])
    assert not idx.offload(10, 16, 7, [1, 10])  # tiers are exclusive: already held
    t = idx.drain()
    assert t.offloads == [(5, 0), (6, 1)] and not t.restores
    idx.touch(10)
    assert idx.offload(30, 16, 8, [3, 30])  # full: evicts the LRU one (20)
    assert not idx.has(20) and idx.has(10) and idx.num_evicted == 1
    idx.drain()
    ckpt, page = idx.restore(10, lambda: 42)
    assert page == 42 and ckpt.length == 16 and not idx.has(10)
    # The restored host page waits in quarantine until the step carrying the copy is
    # built: an offload now must not overwrite it.
    assert idx.quarantine == [ckpt.host_page] and not idx.free
    assert idx.restoring_into() == {42}
    idx.check_integrity()
    assert idx.offload(40, 16, 9, [4, 40])  # evicts 30 (the only checkpoint) instead
    assert not idx.has(30)
    t = idx.drain()
    assert t.restores == [(ckpt.host_page, 42)] and t.offloads == [(9, ckpt.host_page ^ 1)]
    assert idx.free == [ckpt.host_page]
    # A KV block of a prefix leaves the cache: the host checkpoint over it is dropped.
    idx.on_block_evicted(4)
    assert not idx.has(40) and idx.num_dropped == 1
    idx.check_integrity()


def test_index_flop_aware_keeps_long_prefixes():
    idx = HostCheckpointIndex(2, "flop_aware", flops_saved=lambda n: float(n * n))
    idx.offload(1, 256, 0, [1])
    idx.offload(2, 16, 1, [2])
    idx.offload(3, 16, 2, [3])  # the long one is older but saves far more: 2 goes
    assert idx.has(1) and idx.has(3) and not idx.has(2)


def test_index_integrity_check_can_fail():
    idx = HostCheckpointIndex(3)
    idx.offload(1, 16, 0, [1])
    idx.check_integrity()
    idx.free.append(idx.checkpoints[1].host_page)  # planted: a held page also free
    with pytest.raises(AssertionError, match="lost or shared"):
        idx.check_integrity()
    idx = HostCheckpointIndex(3)
    idx.offload(1, 16, 0, [1, 7])
    del idx._dependents._segment[7]  # planted: a KV eviction of block 7 would miss it
    with pytest.raises(AssertionError, match="dependency map"):
        idx.check_integrity()


def test_config_knobs_are_validated():
    with pytest.raises(ValueError, match="checkpoint_offload_gib"):
        CacheConfig(checkpoint_offload_gib=-1.0)
    with pytest.raises(ValueError, match="checkpoint_offload_pages"):
        CacheConfig(checkpoint_offload_pages=-2)
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(checkpoint_offload_gib=1.0, checkpoint_offload_pages=4)


# ---- the pool ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_round_trip_is_bit_exact(dtype):
    """Every declared state tensor of every layer makes the round trip, whatever its
    name and dtype (here a family with a third tensor, and tensors in two dtypes)."""
    gen = torch.Generator().manual_seed(0)
    states = {
        0: {
            "conv": torch.randn(6, 5, 3, generator=gen).to(dtype),
            "ssm": torch.randn(6, 2, 3, 4, generator=gen),
        },
        2: {
            "conv": torch.randn(6, 4, 2, generator=gen).to(dtype),
            "ssm": torch.randn(6, 3, 2, 2, generator=gen).to(dtype),
            "extra": torch.randn(6, 7, generator=gen).to(torch.float16),
        },
    }
    before = {(layer, name): t.clone() for layer, s in states.items() for name, t in s.items()}
    pool = HostStatePool(states, num_pages=3)
    assert pool.states[0]["conv"].dtype == dtype and pool.states[0]["ssm"].dtype == torch.float32
    assert pool.states[2]["ssm"].shape == (3, 3, 2, 2) and pool.states[2]["extra"].dtype == torch.float16
    pool.run(Transfers(offloads=[(4, 1), (2, 0)]))
    # The device pages are overwritten (reused), then restored into other fresh pages.
    for t in before:
        states[t[0]][t[1]][4].fill_(float("nan"))
        states[t[0]][t[1]][2].fill_(7.0)
    pool.run(Transfers(restores=[(1, 5), (0, 1)]))
    for (layer, name), orig in before.items():
        dev = states[layer][name]
        assert torch.equal(dev[5].view(torch.uint8), orig[4].view(torch.uint8)), (layer, name)
        assert torch.equal(dev[1].view(torch.uint8), orig[2].view(torch.uint8)), (layer, name)
    assert HostStatePool.page_bytes(states) == sum(t[0].numel() * t.element_size() for t in before.values())


def _snapshot(llm, page: int) -> dict:
    caches = llm.engine.runner.caches
    return {
        (layer, name): t[page].clone() for layer, s in caches.states.items() for name, t in s.items()
    }


@pytest.mark.parametrize(
    "model,ssm_dtype",
    [("tiny_granite", "float32"), ("tiny_granite", "bfloat16"), ("tiny_qwen3_5", "float32"), ("tiny_qwen3_5", "bfloat16")],
)
def test_engine_round_trip_restores_the_evicted_state(request, model, ssm_dtype):
    """A checkpoint evicted from the device and hit later is, on the device again,
    byte for byte the state that was evicted (every layer, conv and recurrent)."""
    path = request.getfixturevalue(model)
    rng = random.Random(3)
    a, b = _rand(rng, 70), _rand(rng, 70)
    llm = LLM(
        path, state_interval=16, max_checkpoint_pages=2, checkpoint_offload_pages=32,
        ssm_state_dtype=ssm_dtype, max_num_seqs=2,
    )
    llm.engine.check_integrity_every_step = True
    sched = llm.engine.scheduler
    first = llm.generate([a], GREEDY)[0].outputs[0].token_ids
    # The device checkpoints of prompt a, before anything evicts them.
    saved = {key: _snapshot(llm, c.page) for key, c in sched.states.checkpoints.items()}
    assert saved
    llm.generate([b], GREEDY)
    offloaded = [k for k in saved if sched.host.has(k)]
    assert offloaded, "prompt b should push a's checkpoints to the host tier"
    pool = llm.engine.runner.host_pool
    for key in offloaded:
        hp = sched.host.checkpoints[key].host_page
        for (layer, name), t in saved[key].items():
            assert torch.equal(pool.states[layer][name][hp], t)
    # Record what each restore wrote, keyed by the checkpoint it came from.
    by_host_page = {sched.host.checkpoints[k].host_page: k for k in offloaded}
    restored: dict[int, dict] = {}
    orig_run = pool.run

    def run(transfers):
        orig_run(transfers)
        for hp, page in transfers.restores:
            if hp in by_host_page:
                restored[by_host_page[hp]] = _snapshot(llm, page)

    pool.run = run
    again = llm.generate([a], GREEDY)[0].outputs[0].token_ids
    assert again == first
    assert sched.counters["host_hits"] >= 1 and restored
    for key, snap in restored.items():
        for name, t in snap.items():
            assert t.dtype == saved[key][name].dtype
            assert torch.equal(t.view(torch.uint8), saved[key][name].view(torch.uint8)), (key, name)


# ---- through the engine ------------------------------------------------------------


def _cycle_hit_rate(path, offload_pages: int, device: str = "cpu") -> tuple[float, list[list[int]], dict]:
    """Six prompts (a working set far above a two-page device budget), asked in turn
    three times, one at a time."""
    rng = random.Random(11)
    prompts = [_rand(rng, 80) for _ in range(6)]
    llm = LLM(
        path, state_interval=16, max_checkpoint_pages=2, checkpoint_offload_pages=offload_pages,
        max_num_seqs=2, num_kv_blocks=256, device=device,
    )
    llm.engine.check_integrity_every_step = True
    outs = []
    for _round in range(3):
        for p in prompts:
            outs.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
    stats = llm.stats()
    return stats["prefix_hit_tokens"] / stats["prefix_query_tokens"], outs, stats


def test_host_tier_keeps_the_hit_rate_of_a_working_set_beyond_the_device(tiny_granite):
    without, outs_off, stats_off = _cycle_hit_rate(tiny_granite, 0)
    with_tier, outs_on, stats_on = _cycle_hit_rate(tiny_granite, 64)
    # Rounds 2 and 3 hit 64 of 80 tokens on every prompt with the tier: 2/3 * 0.8.
    assert with_tier == pytest.approx(2 / 3 * 64 / 80)
    # Without it, LRU over two device pages has evicted each prompt's checkpoints
    # before the prompt comes back.
    assert without == 0.0
    assert stats_off["checkpoints_evicted"] > 0 and stats_off["host_checkpoints_offloaded"] == 0
    assert stats_on["host_checkpoints_restored"] >= 12 and stats_on["host_hits"] >= 12
    assert outs_on == outs_off


def _soak(path, seed: int, offload_pages: int, enforce_eager: bool = True, policy: str = "lru",
          spec: bool = False):
    rng = random.Random(seed)
    roots = [_rand(rng, n) for n in (70, 33, 100, 50)]
    prompts = []
    for _ in range(24):
        root = rng.choice(roots)
        prompts.append(root[: rng.randint(1, len(root))] + _rand(rng, rng.randint(1, 20)))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(
        path, max_num_seqs=8, max_model_len=160, num_kv_blocks=20, num_state_pages=40,
        max_checkpoint_pages=3, state_interval=16, max_num_batched_tokens=48,
        checkpoint_offload_pages=offload_pages, enforce_eager=enforce_eager,
        eviction_policy=policy,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3} if spec else None,
    )
    engine = llm.engine
    engine.check_integrity_every_step = True
    pending = list(enumerate(prompts))
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"g{i}", p, greedy)
        # Aborts hit running requests and waiting ones (a restore may be in flight).
        if rng.random() < 0.06:
            queue = list(engine.scheduler.running) + list(engine.scheduler.waiting)
            if queue:
                victim = rng.choice(queue)
                engine.abort_request(engine.group_id(victim))
                aborted.add(victim.request_id)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 5000
    return prompts, done, aborted, llm


@pytest.mark.parametrize(
    "model,seed,policy,spec",
    [
        ("tiny_granite", 0, "lru", False),
        # Another seed of the same configuration.
        pytest.param("tiny_granite", 1, "lru", False, marks=pytest.mark.slow),
        ("tiny_granite", 2, "flop_aware", False),
        ("tiny_granite", 3, "lru", True),
        ("tiny_qwen3_5", 4, "lru", True),
    ],
)
def test_outputs_identical_with_tier_on_and_off_under_preemption_and_aborts(request, model, seed, policy, spec):
    path = request.getfixturevalue(model)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts, done_on, aborted_on, llm = _soak(path, seed, offload_pages=48, policy=policy, spec=spec)
    _, done_off, aborted_off, _ = _soak(path, seed, offload_pages=0, policy=policy, spec=spec)
    plain = LLM(path, enable_prefix_caching=False)
    expected = {f"g{i}": o.outputs[0].token_ids for i, o in enumerate(plain.generate(prompts, greedy))}
    for done, aborted in ((done_on, aborted_on), (done_off, aborted_off)):
        finished = [rid for rid in expected if rid not in aborted]
        assert len(finished) >= len(prompts) // 2
        for rid in finished:
            assert done[rid] == expected[rid], rid
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["host_checkpoints_offloaded"] > 0 and stats["host_checkpoints_restored"] > 0
    # KV blocks are scarce here: host checkpoints whose prefix lost a block were dropped.
    assert stats["host_checkpoints_dropped"] > 0
    llm.reset_prefix_cache()
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert sched.states.num_free == sched.states.num_pages
    assert len(sched.host.free) == sched.host.num_pages and not sched.host.checkpoints


def test_tier_with_decode_graph_step_path(tiny_granite):
    """The static-buffer decode step (the CUDA graph path, eagerly on a CPU) runs the
    step's copies too."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts, done, aborted, llm = _soak(tiny_granite, 2, offload_pages=48, enforce_eager=False)
    plain = LLM(tiny_granite, enable_prefix_caching=False)
    expected = {f"g{i}": o.outputs[0].token_ids for i, o in enumerate(plain.generate(prompts, greedy))}
    for rid, toks in expected.items():
        if rid not in aborted:
            assert done[rid] == toks, rid
    assert llm.stats()["host_checkpoints_restored"] > 0


def test_abort_while_restoring_releases_the_hold(tiny_granite):
    rng = random.Random(4)
    a, b = _rand(rng, 70), _rand(rng, 70)
    llm = LLM(tiny_granite, state_interval=16, max_checkpoint_pages=1, checkpoint_offload_pages=16)
    engine = llm.engine
    engine.check_integrity_every_step = True
    llm.generate([a], GREEDY)
    llm.generate([b], GREEDY)
    engine.add_request("again", a, GREEDY)
    engine.step()  # only the restore runs: the request waits for it
    sched = engine.scheduler
    assert "again" in sched._restoring and sched.waiting
    engine.abort_request("again")
    assert not sched._restoring
    sched.check_integrity()
    llm.reset_prefix_cache()
    assert sched.states.num_free == sched.states.num_pages


def test_scheduler_integrity_catches_a_leaked_restore_hold(tiny_granite):
    rng = random.Random(4)
    a, b = _rand(rng, 70), _rand(rng, 70)
    llm = LLM(tiny_granite, state_interval=16, max_checkpoint_pages=1, checkpoint_offload_pages=16)
    llm.generate([a], GREEDY)
    llm.generate([b], GREEDY)
    llm.engine.add_request("again", a, GREEDY)
    llm.engine.step()
    sched = llm.engine.scheduler
    sched.check_integrity()
    sched._restoring["ghost"] = sched._restoring.pop("again")  # planted: no such request
    with pytest.raises(AssertionError, match="restore hold"):
        sched.check_integrity()


@pytest.mark.gpu
def test_cuda_tier_pins_host_pages_and_keeps_hit_rate_and_outputs(tiny_granite):
    """On CUDA: pinned host pages, restores on the side stream behind an event; the same
    hit rates and the same greedy outputs as without the tier."""
    without, outs_off, _ = _cycle_hit_rate(tiny_granite, 0, device="cuda")
    with_tier, outs_on, stats = _cycle_hit_rate(tiny_granite, 64, device="cuda")
    assert without == 0.0 and with_tier == pytest.approx(2 / 3 * 64 / 80)
    assert stats["host_checkpoints_restored"] >= 12
    assert outs_on == outs_off


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pool_round_trip_is_bit_exact(dtype):
    gen = torch.Generator().manual_seed(1)
    conv = {0: torch.randn(6, 5, 3, generator=gen).to(dtype).cuda()}
    ssm = {0: torch.randn(6, 2, 3, 4, generator=gen).to(dtype).cuda()}
    before = {"c": conv[0].clone(), "s": ssm[0].clone()}
    pool = HostStatePool({0: {"conv": conv[0], "ssm": ssm[0]}}, num_pages=2)
    assert pool.states[0]["conv"].is_pinned() and pool.stream is not None
    pool.run(Transfers(offloads=[(3, 0)]))
    # A forward reusing page 3 right after (same stream: ordered after the offload).
    conv[0][3].fill_(float("nan"))
    ssm[0][3].fill_(float("nan"))
    pool.run(Transfers(restores=[(0, 5)]))
    pool.before_forward([5])  # a forward that reads the page waits for the copy
    torch.cuda.synchronize()
    assert torch.equal(conv[0][5].cpu().view(torch.uint8), before["c"][3].cpu().view(torch.uint8))
    assert torch.equal(ssm[0][5].cpu().view(torch.uint8), before["s"][3].cpu().view(torch.uint8))


def test_failed_copies_are_forgotten_and_the_engine_goes_on(tiny_granite):
    """A step whose host-tier copies raise leaves no checkpoint that claims data the
    copies never delivered; the request runs again and its output is exact."""
    rng = random.Random(4)
    a, b = _rand(rng, 70), _rand(rng, 70)
    ref = LLM(tiny_granite, enable_prefix_caching=False).generate([a], GREEDY)[0].outputs[0].token_ids
    llm = LLM(tiny_granite, state_interval=16, max_checkpoint_pages=1, checkpoint_offload_pages=16)
    engine = llm.engine
    engine.check_integrity_every_step = True
    llm.generate([a], GREEDY)
    llm.generate([b], GREEDY)
    sched = engine.scheduler
    pool = engine.runner.host_pool
    orig_run = pool.run
    failed: list = []

    def run(transfers):
        if transfers.restores and not failed:
            failed.append(list(transfers.restores))
            raise RuntimeError("copy failed")
        orig_run(transfers)

    pool.run = run
    engine.add_request("again", a, GREEDY)
    with pytest.raises(RuntimeError, match="copy failed"):
        engine.step()
    restored_pages = {page for _, page in failed[0]}
    assert not any(c.page in restored_pages for c in sched.states.checkpoints.values())
    sched.check_integrity()
    out = None
    for _ in range(200):
        for o in engine.step():
            if o.finished:
                out = o
        if out is not None:
            break
    assert out is not None and out.outputs[0].token_ids == ref
