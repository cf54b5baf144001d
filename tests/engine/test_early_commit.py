"""A step's prefill rows are committed while the device computes: once every launch of
the step is queued and before its read-back waits (``ModelRunner.execute``'s ``overlap``,
``EngineCore._commit_prefill_rows``). These tests log the commit against the read-back on
the eager greedy, eager sampled and short-row graph paths (the graph step runs without
capture on the CPU), check that tokens, hits and checkpoints are those of a commit after
the read-back, and that a read-back failing after the commit fails those requests,
drops every cached prefix and leaves the engine serving."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import KernelPolicy
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import RequestStatus
from hybridserve.runner import model_runner, sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=3, ignore_eos=True)
# The short-row path with its torch twins: the path a cached prompt's tail takes on CUDA.
SHORT = KernelPolicy(short_rows="reference")


class _Watched(torch.Tensor):
    """A step's read-back values: reading them to the host logs ``"read"``."""

    log: list[str] = []

    def tolist(self):
        _Watched.log.append("read")
        return torch.Tensor.tolist(self.as_subclass(torch.Tensor))


def _watch(fn):
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs).as_subclass(_Watched)
    return wrapped


def _llm(path, graphs: bool) -> LLM:
    llm = LLM(path, max_num_seqs=4, enable_prefix_caching=True, state_interval=16,
              kernel_policy=SHORT)
    if graphs:
        eng = llm.engine
        llm.engine = None
        llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                                eng.eos_token_ids, enforce_eager=False, async_scheduling=False)
    return llm


def _prompts(seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (48,), generator=g).tolist()
    return (prefix + torch.randint(3, 256, (5,), generator=g).tolist(),
            prefix + torch.randint(3, 256, (21,), generator=g).tolist())


@pytest.mark.parametrize("graphs,params", [(False, GREEDY), (False, SAMPLED), (True, GREEDY)],
                         ids=["eager-greedy", "eager-sampled", "short-graph"])
def test_prefill_rows_commit_before_the_read_back(tiny_nemotron, monkeypatch, test_seed,
                                                  graphs, params):
    """Every step with a prefill row commits it (its blocks registered, its checkpoints
    admitted) before the step's values are read back, on every path the cached first
    token takes; the second prompt still hits the first one's checkpoint."""
    llm = _llm(tiny_nemotron, graphs)
    eng = llm.engine
    log = _Watched.log
    log.clear()
    monkeypatch.setattr(sampler, "argmax_ids", _watch(sampler.argmax_ids))
    monkeypatch.setattr(sampler, "sample_step", _watch(sampler.sample_step))
    if graphs:
        monkeypatch.setattr(eng.runner.graphs, "replay_short",
                            _watch(eng.runner.graphs.replay_short))
    commit = eng.scheduler.commit_prefill_row

    def logged_commit(row):
        log.append("commit")
        return commit(row)

    monkeypatch.setattr(eng.scheduler, "commit_prefill_row", logged_commit)
    first, second = _prompts(test_seed)
    llm.generate([first], params, use_tqdm=False)
    assert log[:2] == ["commit", "read"], log
    log.clear()
    before = eng.runner.graphs.counters["short_graph_steps"] if graphs else 0
    out = llm.generate([second], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    assert log[:2] == ["commit", "read"], log
    if graphs:
        assert eng.runner.graphs.counters["short_graph_steps"] == before + 1
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "short-graph"])
def test_early_commit_changes_nothing_but_when(tiny_nemotron, monkeypatch, test_seed, graphs):
    """The same tokens, prefix hits and checkpoints (keys, lengths) as an engine whose
    runner drops the overlap, so that every prefill row commits after the read-back."""

    def run(overlap: bool):
        llm = _llm(tiny_nemotron, graphs)
        eng = llm.engine
        if not overlap:
            real = eng.runner.execute
            monkeypatch.setattr(eng.runner, "execute", lambda sched, overlap=None: real(sched))
        first, second = _prompts(test_seed)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in (first, second, first)
                for params in (GREEDY, SAMPLED)]
        states = eng.scheduler.states
        ckpts = sorted((k, c.length) for k, c in states.checkpoints.items())
        eng.scheduler.check_integrity()
        return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs], ckpts

    assert run(True) == run(False)


def test_read_back_failing_after_the_commit(tiny_nemotron, monkeypatch, test_seed):
    """A read-back that raises after the step's prefill rows were committed (a device
    fault): the step raises, those requests finish with an error, no checkpoint or
    cached block of theirs survives (the device may never have written them), every
    reference is accounted for, and the next requests run as on a fresh engine."""
    first, second = _prompts(test_seed)
    fresh = _llm(tiny_nemotron, False)
    want = [fresh.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in (first, second)]

    llm = _llm(tiny_nemotron, False)
    eng = llm.engine
    llm.generate([first], GREEDY, use_tqdm=False)  # its prefix is cached now
    assert eng.scheduler.states.checkpoints
    real = model_runner.ModelRunner._read_back
    calls = {"n": 0}

    def failing_read_back(self, sched, values, starts, overlap=None):
        calls["n"] += 1
        if overlap is not None:
            overlap()
        raise RuntimeError("injected read-back fault")

    monkeypatch.setattr(model_runner.ModelRunner, "_read_back", failing_read_back)
    eng.add_request("bad", second, GREEDY)
    with pytest.raises(RuntimeError, match="injected read-back fault"):
        eng.step()
    assert calls["n"] == 1
    req = eng.groups["bad"].children[0]
    assert req.status is RequestStatus.FINISHED_ERROR
    assert not eng.scheduler.states.checkpoints
    assert not eng.scheduler.blocks.hash_to_block
    eng.scheduler.check_integrity()
    monkeypatch.setattr(model_runner.ModelRunner, "_read_back", real)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in (first, second)]
    assert [o.num_cached_tokens for o in outs] == [0, 48]
    assert [o.outputs[0].token_ids for o in outs] == want
