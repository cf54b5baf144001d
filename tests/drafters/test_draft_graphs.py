"""A drafter's own steps replayed from graphs (hybridserve.runner.draft_graphs).

On the CPU (no capture) the drafter's graph steps run the same static-buffer step
eagerly (``enforce_eager=False``); these tests check it against the drafter's eager
path and against no speculation: the same tokens (greedy, and sampled with per-request
seeds), the drafter's pages exact by page id, the drafter's steps counted as replayed,
the buffer's layout and every fallback. The capture itself is checked on CUDA
(``gpu``)."""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import assert_page_exact, output_tokens, rand_tokens, step_waves

from hybridserve import LLM, SamplingParams
from hybridserve.config import KernelPolicy
from hybridserve.engine.engine_core import EngineCore
from hybridserve.runner.cuda_graph import GREEDY
from hybridserve.runner.draft_graphs import (
    SAMPLED,
    DraftDraw,
    DraftGraphs,
    DraftRow,
    _DraftStatic,
)
from hybridserve.testing.tiny_models import make_tiny_checkpoint
from hybridserve.testing.tiny_mtp import add_mtp_head

GREEDY_PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _workload(seed: int) -> list[list[int]]:
    """Four prompts, two sharing a prefix of two KV blocks (prefix hits when caching)."""
    rng = random.Random(seed)
    motif = rand_tokens(rng, 6)
    shared = rand_tokens(rng, 33)
    return [motif * 4, shared + rand_tokens(rng, 3), shared + rand_tokens(rng, 6), rand_tokens(rng, 5)]


def _llm(path, enforce_eager: bool, **kw) -> LLM:
    """An LLM whose engine runs graph steps (without capture off CUDA) unless
    ``enforce_eager``; every step read back before the next."""
    llm = LLM(path, **kw)
    eng = llm.engine
    llm.engine = None
    llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                            eng.eos_token_ids, enforce_eager=enforce_eager,
                            async_scheduling=False)
    llm.engine.check_integrity_every_step = True
    return llm


def _record_proposals(llm: LLM) -> list:
    """Every proposal the engine's drafter makes from here on, in order."""
    drafter = llm.engine.drafter
    propose, seen = drafter.propose_batch, []

    def spy(requests):
        out = propose(requests)
        seen.append([(r.key, list(r.token_ids), d) for r, d in zip(requests, out)])
        return out

    drafter.propose_batch = spy
    return seen


def _spec(draft, d: int) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": d}


@pytest.fixture(scope="module")
def qwen_draft(tmp_path_factory):
    """A smaller Qwen3.5 draft model (GDN then attention) with the target's vocabulary."""
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("q35draft"), seed=9,
                                layers="MA")


@pytest.fixture(scope="module")
def references(tiny_granite, tiny_qwen3_5):
    out = {}
    for name, path in (("granite", tiny_granite), ("qwen3_5", tiny_qwen3_5)):
        llm = LLM(path, enable_prefix_caching=False)
        out[name] = [output_tokens(llm.generate(_workload(s), GREEDY_PARAMS, use_tqdm=False))
                     for s in (0, 1)]
    return out


def _cases(archs: tuple[str, str], default: set) -> list:
    """``(arch, caching, d)`` for both archs, caching off and on, d in {1, 3}: the cases
    in ``default`` run by default, the others are ``slow`` (the same graph-step path on
    another draft length or cache setting)."""
    return [pytest.param(a, c, d, marks=() if (a, c, d) in default else pytest.mark.slow)
            for a in archs for c in (False, True) for d in (1, 3)]


@pytest.mark.parametrize("arch,caching,d", _cases(
    ("granite", "qwen3_5"), {("granite", True, 3), ("qwen3_5", True, 3), ("qwen3_5", False, 1)}))
def test_greedy_identical_graphs_on_and_off(arch, caching, d, references, tiny_granite,
                                            tiny_qwen3_5, qwen_draft):
    """Greedy output with the drafter's graph steps equals the eager drafter's and no
    speculation's, and the drafter's steps are replayed: Granite (Mamba2) drafting with
    itself (every draft accepted: two-token catch-ups, grid points crossed), Qwen3.5
    (Gated DeltaNet) with a smaller random draft model (rejections: one-token catch-ups),
    the prefix cache off and on (the drafter's own hits)."""
    target = tiny_granite if arch == "granite" else tiny_qwen3_5
    draft = target if arch == "granite" else qwen_draft
    kw = dict(enable_prefix_caching=caching, state_interval=16, max_num_seqs=8,
              speculative_config=_spec(draft, d))
    runs = {}
    for eager in (True, False):
        llm = _llm(target, eager, **kw)
        proposals = _record_proposals(llm)
        # Workload 0, then 1, then 0 again: the drafter's prefix hits when caching.
        got = [output_tokens(llm.generate(_workload(s), GREEDY_PARAMS, use_tqdm=False))
               for s in (0, 1, 0)]
        assert got == references[arch] + references[arch][:1], (eager, arch)
        runs[eager] = (llm.stats(), llm.engine.drafter, proposals)
    (spec_eager, eager, want_drafts), (spec_graph, graph, drafts) = runs[True], runs[False]
    assert drafts == want_drafts  # proposal by proposal
    assert eager.graphs is None
    assert spec_graph["spec_draft_tokens"] > 0
    # The same drafts (the same logits, read from the same pages): the same acceptance.
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert spec_graph[key] == spec_eager[key], key
    if arch == "granite":
        assert spec_graph["spec_accepted_tokens"] == spec_graph["spec_draft_tokens"]
    counters = graph.graphs.counters
    assert counters["graph_steps"] > 0 and not graph.graphs.capture_errors
    # Every drafting step and every steady-state catch-up replays: what runs eagerly is
    # the first catch-up of a prompt (longer than a graph row, or from the zero state).
    drafted = eager.counters["draft_forwards"]
    assert graph.counters["draft_forwards"] <= 3 * 4 + 2, (graph.counters, drafted)
    assert counters["graph_steps"] >= drafted - graph.counters["draft_forwards"]
    if caching:
        assert graph.counters["prefix_hit_tokens"] == eager.counters["prefix_hit_tokens"] > 0


def test_graph_steps_write_exact_states_by_page(tiny_qwen3_5):
    """With the drafter's graph steps: after every step each request's committed drafter
    page holds the draft model's exact state of the prefix it consumed, every proposal
    page the state after its fed draft, every drafter checkpoint its prefix's state; every
    page reference is accounted for."""
    llm = _llm(tiny_qwen3_5, False, state_interval=16, enable_prefix_caching=True,
               speculative_config=_spec(tiny_qwen3_5, 3))
    engine, drafter = llm.engine, llm.engine.drafter
    checked = fed = 0
    for seen in step_waves(engine, _workload(3), GREEDY_PARAMS):
        for key, seq in drafter._seqs.items():
            if seq.computed:
                prefix = seen[key][: seq.computed]
                assert_page_exact(drafter, seq.page, prefix)
                checked += 1
                for draft, page in seq.fed:
                    prefix = prefix + [draft]
                    assert_page_exact(drafter, page, prefix)
                    fed += 1
    assert checked > 10 and fed > 10
    assert drafter.graphs.counters["graph_steps"] > 0
    assert drafter.counters["prefix_hit_tokens"] >= 32
    assert drafter.states.checkpoints


def test_sampled_drafts_reproduce_graphs_on_and_off(tiny_qwen3_5, qwen_draft):
    """Seeded sampled requests (beside a greedy one) with a non-point-mass drafter: the
    same tokens and the same acceptance with the drafter's graph steps as without (the
    draft draws and their log q come from the same function on the same logits); the
    sampled draws replay their own graphs."""
    rng = random.Random(11)
    prompts = [rand_tokens(rng, 7), rand_tokens(rng, 12), rand_tokens(rng, 9), rand_tokens(rng, 20)]
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=16, ignore_eos=True)
              for i in range(3)] + [GREEDY_PARAMS]
    runs = {}
    for eager in (True, False):
        llm = _llm(tiny_qwen3_5, eager, state_interval=16, max_num_seqs=8,
                   speculative_config=_spec(qwen_draft, 3))
        runs[eager] = (output_tokens(llm.generate(prompts, params, use_tqdm=False)), llm.stats(),
                       llm.engine.drafter)
    assert runs[True][0] == runs[False][0]
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert runs[True][1][key] == runs[False][1][key], key
    assert runs[False][1]["spec_draft_tokens"] > 0
    graphs = runs[False][2].graphs
    assert any(k[-1] == SAMPLED for k in graphs._graphs), list(graphs._graphs)
    assert graphs.counters["graph_steps"] > 0


# ---- MTP heads ----------------------------------------------------------------------

MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def mtp_targets(tmp_path_factory):
    """A Qwen3.5 (GDN) target with a random MTP head, and a Nemotron-H target (Mamba2,
    attention, MoE, MLP) with a random ``["attention", "moe"]`` head."""
    qwen = make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("q35mtp"), seed=4)
    nemotron = make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nhmtp"), seed=5,
                                    layers="M*EM-")
    return {"qwen3_5": add_mtp_head(qwen), "nemotron": add_mtp_head(nemotron, seed=1)}


@pytest.mark.parametrize("arch,caching,d", _cases(
    ("qwen3_5", "nemotron"), {("qwen3_5", True, 3), ("nemotron", True, 3), ("nemotron", False, 1)}))
def test_mtp_greedy_identical_graphs_on_and_off(arch, caching, d, mtp_targets):
    """Greedy output with the MTP head's graph steps (its hidden states through the
    static buffer) equals the eager head's and no speculation's, with the same drafts
    (the same acceptance), the head's steps replayed; the prefix cache off and on (the
    head's window then starts after the hit)."""
    target = mtp_targets[arch]
    want = [output_tokens(LLM(target, enable_prefix_caching=False).generate(
        _workload(s), GREEDY_PARAMS, use_tqdm=False)) for s in (0, 1)]
    runs = {}
    for eager in (True, False):
        llm = _llm(target, eager, enable_prefix_caching=caching, state_interval=16,
                   max_num_seqs=8, speculative_config=dict(MTP, num_speculative_tokens=d))
        proposals = _record_proposals(llm)
        got = [output_tokens(llm.generate(_workload(s), GREEDY_PARAMS, use_tqdm=False))
               for s in (0, 1)]
        assert got == want, eager
        runs[eager] = (llm.stats(), llm.engine.drafter, proposals, llm.engine.runner.graphs)
    (spec_eager, eager, want_drafts, _), (spec_graph, graph, drafts, target_graphs) = (
        runs[True], runs[False])
    assert eager.graphs is None and spec_graph["spec_draft_tokens"] > 0
    # The same drafts, proposal by proposal: the head read the same hidden states (the
    # target's decode graphs hand theirs over too) and computed the same logits.
    assert drafts == want_drafts
    assert target_graphs.counters["graph_steps"] > 0, target_graphs.counters
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert spec_graph[key] == spec_eager[key], key
    if caching:
        assert spec_graph["prefix_hit_tokens"] == spec_eager["prefix_hit_tokens"] > 0
    counters = graph.graphs.counters
    assert not graph.graphs.capture_errors
    # Only the first catch-up of a prompt (longer than a graph row) runs eagerly.
    assert graph.counters["draft_forwards"] <= 2 * 4 + 2, graph.counters
    assert counters["graph_steps"] >= eager.counters["draft_forwards"] - graph.counters[
        "draft_forwards"]


def test_mtp_sampled_drafts_reproduce_graphs_on_and_off(mtp_targets):
    rng = random.Random(12)
    prompts = [rand_tokens(rng, 7), rand_tokens(rng, 12), rand_tokens(rng, 9)]
    params = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=16, ignore_eos=True)
              for i in range(2)] + [GREEDY_PARAMS]
    runs = {}
    for eager in (True, False):
        llm = _llm(mtp_targets["qwen3_5"], eager, max_num_seqs=8, speculative_config=MTP)
        runs[eager] = (output_tokens(llm.generate(prompts, params, use_tqdm=False)), llm.stats(),
                       llm.engine.drafter)
    assert runs[True][0] == runs[False][0]
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert runs[True][1][key] == runs[False][1][key], key
    graphs = runs[False][2].graphs
    assert any(k[-1] == SAMPLED for k in graphs._graphs), list(graphs._graphs)


def test_steps_that_do_not_replay_run_eagerly(tiny_granite, references, mtp_targets):
    """Graphs turned off after a failed capture (every step then runs eagerly, the
    drafting steps' tokens read back from the device): the same output, nothing
    replayed; for a draft model and an MTP head."""
    want_mtp = output_tokens(LLM(mtp_targets["qwen3_5"], enable_prefix_caching=False).generate(
        _workload(0), GREEDY_PARAMS, use_tqdm=False))
    for target, spec, want in (
        (tiny_granite, _spec(tiny_granite, 3), references["granite"][0]),
        (mtp_targets["qwen3_5"], MTP, want_mtp),
    ):
        llm = _llm(target, False, max_num_seqs=8, speculative_config=spec)
        graphs = llm.engine.drafter.graphs
        graphs.enabled = False
        assert output_tokens(llm.generate(_workload(0), GREEDY_PARAMS, use_tqdm=False)) == want
        assert graphs.counters["graph_steps"] == 0
        assert llm.stats()["spec_draft_tokens"] > 0


def _graphs(path) -> DraftGraphs:
    """Draft graphs of at most 8 rows, 8-block tables, over a drafter's caches
    (scratch block and page past its pools)."""
    llm = LLM(path, speculative_config=_spec(path, 3))
    drafter = llm.engine.drafter
    return drafter.enable_graphs(8, 8, capture=False)


def test_shape_of_rows_and_fallbacks(tiny_granite):
    graphs = _graphs(tiny_granite)

    def row(**kw):
        args = dict(start=20, num_tokens=1, block_ids=(1, 2), in_page=3, out_pages={0: 5})
        args.update(kw)
        return DraftRow(**args)

    shape = graphs.shape_of_rows([row(), row(in_page=4, out_pages={0: 6})], False)
    assert (shape.rows, shape.batch, shape.q, shape.width, shape.sampling) == (2, 2, 1, 2, GREEDY)
    assert graphs.shape_of_rows([row()], True).sampling == SAMPLED
    two = row(num_tokens=2, out_pages={0: 7, 1: 5})  # a catch-up with a checkpoint
    assert graphs.shape_of_rows([two], False).q == 2
    assert graphs.shape_of_rows([row(), two], False) is None  # lengths differ
    assert graphs.shape_of_rows([row(in_page=-1)], False) is None  # the zero state
    assert graphs.shape_of_rows([row(out_pages={0: 3})], False) is None  # writes its input
    assert graphs.shape_of_rows([row(), row(in_page=5, out_pages={0: 6})], False) is None
    assert graphs.shape_of_rows([row(), row(in_page=4)], False) is None  # page twice
    assert graphs.shape_of_rows([row(start=40)], False) is None  # past its blocks
    assert graphs.shape_of_rows([row(start=200, block_ids=tuple(range(13)))], False) is None
    assert graphs.shape_of_rows([row(num_tokens=17, out_pages={16: 5})], False) is None
    many = [row(in_page=10 + i, out_pages={0: 30 + i}) for i in range(9)]
    assert graphs.shape_of_rows(many, False) is None  # past the largest bucket
    graphs.sampled_enabled = False
    assert graphs.shape_of_rows([row()], True) is None
    assert graphs.shape_of_rows([row()], False) is not None


def test_fill_writes_rows_draws_then_padding(tiny_granite):
    graphs = _graphs(tiny_granite)
    bs = graphs.block_size
    rows = [DraftRow(30, 2, (4, 9, 2), 3, {0: 7, 1: 5}, (11, 12)),
            DraftRow(16, 2, (6, 8), 4, {1: 6}, (13, 14))]
    draws = [DraftDraw(0.7, 5, 6, 9), DraftDraw()]
    shape = graphs.shape_of_rows(rows, True)
    assert (shape.batch, shape.q, shape.width) == (2, 2, 2)
    st = _DraftStatic(2, graphs.max_batch, graphs.max_blocks, graphs.scratch_block,
                      graphs.scratch_page, bs, torch.device("cpu"))
    graphs.fill_rows(st, rows, draws, shape)
    m = st.meta
    assert m[0, :11].tolist() == [11, 12, 30, 31, 9 * bs + 14, 9 * bs + 15, 3, 7, 5, 4, 9]
    assert m[1, :11].tolist() == [13, 14, 16, 17, 8 * bs, 8 * bs + 1, 4, -1, 6, 6, 8]
    d = m[:2, st.draw : st.draw + 4]
    temps = d[:, 0].to(torch.int32).view(torch.float32)
    assert temps.tolist() == [torch.tensor(0.7, dtype=torch.float32).item(), 0.0]
    assert d[:, 1:].tolist() == [[5, 6, 9], [0, 0, 0]]
    # Three rows: the bucket of 4 gets a padding row on the scratch block and page.
    shape = graphs.shape_of_rows(rows + [DraftRow(0, 2, (1,), 2, {1: 8}, (1, 2))], False)
    graphs.fill_rows(st, rows + [DraftRow(0, 2, (1,), 2, {1: 8}, (1, 2))], draws + [DraftDraw()],
                     shape)
    pad = m[3]
    sb = graphs.scratch_block
    assert pad[:11].tolist() == [0, 0, 0, 1, sb * bs, sb * bs + 1, graphs.scratch_page, -1, -1,
                                 sb, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_granite", "tiny_qwen3_5", "qwen3_5_mtp",
                                     "nemotron_mtp"])
def test_captured_draft_steps_match_eager_on_cuda(request, fixture, qwen_draft, mtp_targets):
    """On CUDA: the drafter's steps (a draft model's, an MTP head's) replay captured
    graphs, greedy output equals the eager engine's and no speculation's, and seeded sampled requests reproduce their
    tokens with the drafter's graphs as without."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fixture.endswith("_mtp"):
        target = mtp_targets[fixture.removesuffix("_mtp")]
        spec = MTP
    else:
        target = request.getfixturevalue(fixture)
        spec = _spec(target if fixture == "tiny_granite" else qwen_draft, 3)
    rng = random.Random(13)
    prompts = [rand_tokens(rng, 7), rand_tokens(rng, 40), rand_tokens(rng, 9), rand_tokens(rng, 20)]
    sampled = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=16, ignore_eos=True)
               for i in range(4)]
    # "auto" keeps drafter graphs off under real capture until this test has passed.
    kw = dict(device="cuda", state_interval=16, max_num_seqs=8, enable_prefix_caching=True,
              kernel_policy=KernelPolicy(drafter_graphs="on"))
    plain = output_tokens(LLM(target, **kw).generate(prompts, GREEDY_PARAMS, use_tqdm=False))
    runs = {}
    for eager in (True, False):
        llm = _llm(target, eager, speculative_config=spec, **kw)
        runs[eager] = (output_tokens(llm.generate(prompts, GREEDY_PARAMS, use_tqdm=False)),
                       output_tokens(llm.generate(prompts, sampled, use_tqdm=False)),
                       llm.engine.drafter)
    assert runs[True][0] == runs[False][0] == plain
    assert runs[True][1] == runs[False][1]
    graphs = runs[False][2].graphs
    assert not graphs.capture_errors, graphs.capture_errors
    assert graphs.counters["captures"] >= 2, graphs.counters
    assert graphs.counters["graph_steps"] > 0, graphs.counters


@pytest.mark.parametrize("fixture", ["tiny_granite", "qwen3_5_mtp"])
def test_drafter_graphs_off_runs_the_drafter_eagerly(request, fixture, mtp_targets):
    """``KernelPolicy.drafter_graphs="off"``:
    the drafter builds no graphs, an MTP target's steps run eagerly beside it, and the
    output is the output without speculation."""
    if fixture.endswith("_mtp"):
        target, spec = mtp_targets[fixture.removesuffix("_mtp")], MTP
    else:
        target = request.getfixturevalue(fixture)
        spec = _spec(target, 3)
    rng = random.Random(3)
    prompts = [rand_tokens(rng, 9), rand_tokens(rng, 21)]
    plain = output_tokens(LLM(target).generate(prompts, GREEDY_PARAMS, use_tqdm=False))
    llm = _llm(target, False, speculative_config=spec,
               kernel_policy=KernelPolicy(drafter_graphs="off"))
    assert llm.engine.drafter.graphs is None
    assert (llm.engine.runner.graphs is None) == fixture.endswith("_mtp")
    assert output_tokens(llm.generate(prompts, GREEDY_PARAMS, use_tqdm=False)) == plain
    with pytest.raises(ValueError, match="drafter_graphs"):
        KernelPolicy(drafter_graphs="yes")
