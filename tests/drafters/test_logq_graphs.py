"""The target's verify graphs with a drafter's ``log q`` (hybridserve.runner.cuda_graph,
``Sampling.drafted``).

A sampled request whose drafts a draft model or an MTP head sampled from its own
distribution is verified with ``min(1, p / q)``; the target's decode graphs take that
``q`` from a static buffer (``DecodeGraphs.enable_draft_distributions``) with a flag per
draft slot. On the CPU the static-buffer step runs without capture; these tests check
that such steps replay (the graphs count them, and no eager step verifies a
distribution draft) and give the eager engine's tokens and acceptance with fixed seeds,
in batches that mix greedy rows, sampled rows with distribution drafts and sampled rows
verified as point masses; the buffer's layout, flags and allocation. The capture itself
is checked on CUDA (``gpu``)."""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import output_tokens, rand_tokens

from hybridserve import LLM, SamplingParams
from hybridserve.config import KernelPolicy
from hybridserve.engine.engine_core import EngineCore
from hybridserve.runner import sampler
from hybridserve.runner.cuda_graph import _Static
from hybridserve.testing.tiny_models import make_tiny_checkpoint
from hybridserve.testing.tiny_mtp import add_mtp_head

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def _draft_spec(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A Qwen3.5 (GDN) target with a random MTP head, a smaller random Qwen3.5 draft
    model for it (rejections), and the same target as its own draft model (every draft
    accepted whatever the seed: ``q == p``)."""
    qwen = add_mtp_head(make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("lq35"), seed=4))
    draft = make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("lq35d"), seed=9, layers="MA")
    return {"target": qwen, "draft": draft}


def _engine(path, mode: str, device: str = "cpu", **kw) -> LLM:
    """An LLM whose engine runs ``mode``: "eager" (no graphs at all), "fallback" (graphs,
    but the target's without a log q buffer: its distribution-draft steps run eagerly,
    the rule before the buffer existed) or "graphs"; every step read back before the
    next. "graphs" sets ``KernelPolicy.logq_graphs="on"`` (the same as its default,
    "auto")."""
    if mode == "graphs":
        kw.setdefault("kernel_policy", KernelPolicy(logq_graphs="on"))
    llm = LLM(path, device=device, **kw)
    eng = llm.engine
    llm.engine = None
    llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                            eng.eos_token_ids, enforce_eager=mode == "eager",
                            async_scheduling=False)
    if mode == "fallback":
        llm.engine.runner.graphs.static_logq = None
    return llm


def _spy_eager_distribution_steps(llm) -> list[int]:
    """Count the eager steps whose sampler verifies distribution drafts."""
    runner, seen = llm.engine.runner, []
    inner = runner._drafted_positions

    def spy(sched, sampling, device):
        out = inner(sched, sampling, device)
        if out is not None:
            seen.append(len(out[0]))
        return out

    runner._drafted_positions = spy
    return seen


def _as_point_masses(llm, request_ids: set[str]) -> None:
    """Drop the drafter's ``log q`` of ``request_ids`` after every proposal: their
    drafts are then verified as point masses (the coupled rule), beside rows verified
    with their ``q`` in the same step."""
    engine = llm.engine
    inner = engine._propose_drafts

    def propose():
        inner()
        kept = engine.runner.draft_logq
        engine.runner.draft_logq = {k: v for k, v in kept.items() if k not in request_ids}

    engine._propose_drafts = propose


def _workload(seed: int, sampled: int, greedy: int) -> tuple[list, list]:
    rng = random.Random(seed)
    prompts = [rand_tokens(rng, rng.randrange(5, 21)) for _ in range(sampled + greedy)]
    params = [SamplingParams(temperature=0.8 + 0.1 * (i % 2), seed=17 + i, max_tokens=14,
                             top_p=0.95 if i == 1 else 1.0, ignore_eos=True)
              for i in range(sampled)] + [GREEDY] * greedy
    return prompts, params


def _run(path, mode, spec, prompts, params, point_masses=(), device="cpu"):
    llm = _engine(path, mode, device=device, max_num_seqs=8, speculative_config=spec)
    if point_masses:
        _as_point_masses(llm, set(point_masses))
    eager_spec = _spy_eager_distribution_steps(llm)
    out = output_tokens(llm.generate(prompts, params, use_tqdm=False))
    return out, llm.stats(), llm.engine.runner.graphs, eager_spec


@pytest.mark.parametrize("method", ["mtp", "draft_model", "self_draft"])
def test_sampled_distribution_drafts_replay_and_equal_eager(method, targets):
    """Seeded sampled requests (one with top-p) beside a greedy one, drafts from an MTP
    head, a random draft model and the target as its own draft model: with the log q
    buffer every verify step with distribution drafts replays from the target's graphs
    (none runs eagerly), and the tokens and the acceptance equal the eager engine's and
    the graphs' old eager fallback's, token for token."""
    target = targets["target"]
    spec = {"mtp": MTP, "draft_model": _draft_spec(targets["draft"]),
            "self_draft": _draft_spec(target)}[method]
    prompts, params = _workload(3, sampled=3, greedy=1)
    runs = {mode: _run(target, mode, spec, prompts, params)
            for mode in ("eager", "fallback", "graphs")}
    (want, want_stats, _, eager_spec) = runs["eager"]
    assert eager_spec, "the eager engine verified no distribution drafts"
    for mode in ("fallback", "graphs"):
        got, stats, _, _ = runs[mode]
        assert got == want, mode
        for key in ("spec_draft_tokens", "spec_accepted_tokens"):
            assert stats[key] == want_stats[key], (mode, key)
    drafted, accepted = want_stats["spec_draft_tokens"], want_stats["spec_accepted_tokens"]
    if method == "self_draft":
        assert accepted == drafted > 0  # q == p: min(1, p / q) = 1
    else:
        assert 0 < accepted < drafted, (accepted, drafted)  # both branches of the test
    _, _, graphs, graph_spec = runs["graphs"]
    assert graph_spec == [], "a distribution-draft step ran eagerly with the buffer"
    assert graphs.counters["drafted_graph_steps"] >= len(eager_spec), graphs.counters
    assert any(k[-1].drafted for k in graphs._graphs if len(k) == 4), list(graphs._graphs)
    assert not graphs.capture_errors
    # The fallback engine ran those steps eagerly (the rule the buffer replaces).
    _, _, fallback, fallback_spec = runs["fallback"]
    assert len(fallback_spec) == len(eager_spec)
    assert fallback.counters["drafted_graph_steps"] == 0


def test_mixed_rows_in_one_step_equal_eager(targets):
    """One step's rows mix greedy rows (argmax drafts), sampled rows verified with
    their ``q`` and sampled rows whose drafts are verified as point masses (their log q
    withheld): the replayed steps give the eager engine's tokens and acceptance, and the
    steps that replay mix all three (the flags pick ``speculative_choices`` row by
    row)."""
    target = targets["target"]
    prompts, params = _workload(5, sampled=4, greedy=2)
    point = {"gen-1", "gen-3"}  # two sampled requests (the LLM's ids, from gen-0)
    runs = {}
    for mode in ("eager", "graphs"):
        llm = _engine(target, mode, max_num_seqs=8, speculative_config=MTP)
        _as_point_masses(llm, point)
        seen = _spy_eager_distribution_steps(llm)
        mixed = []
        if mode == "graphs":
            graphs = llm.engine.runner.graphs
            fill = graphs.fill

            def spy(st, sched, shape, logqs=None, fill=fill, mixed=mixed):
                if shape.sampling.drafted:
                    kinds = {
                        "greedy" if row.request.params.greedy
                        else "q" if logq is not None else "point"
                        for row, logq in zip(sched.rows, logqs) if row.num_drafts
                    }
                    mixed.append(kinds)
                return fill(st, sched, shape, logqs)

            graphs.fill = spy
        ids = [f"gen-{i}" for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.request_id for o in outs] == ids
        runs[mode] = (output_tokens(outs), llm.stats(), seen, mixed)
    assert runs["graphs"][0] == runs["eager"][0]
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert runs["graphs"][1][key] == runs["eager"][1][key], key
    assert runs["eager"][2] and not runs["graphs"][2]
    assert {"greedy", "q", "point"} in runs["graphs"][3], runs["graphs"][3]


def test_masked_steps_with_distribution_drafts_equal_eager(targets):
    """Token masks (``allowed_token_ids``, ``min_tokens``) in steps with distribution
    drafts: the two-graph masked step applies the masks, then the flagged speculative
    draw; the tokens and acceptance are the eager engine's."""
    target = targets["target"]
    prompts, params = _workload(9, sampled=3, greedy=1)
    params[0] = SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True,
                               allowed_token_ids=list(range(3, 160)))
    params[3] = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=10)
    runs = {mode: _run(target, mode, MTP, prompts, params) for mode in ("eager", "graphs")}
    assert runs["graphs"][0] == runs["eager"][0]
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert runs["graphs"][1][key] == runs["eager"][1][key], key
    graphs = runs["graphs"][2]
    assert runs["eager"][3] and not runs["graphs"][3]
    assert graphs.counters["masked_graph_steps"] > 0 and graphs.counters["drafted_graph_steps"] > 0
    assert any(len(k) == 5 and k[3].masked and k[3].drafted for k in graphs._graphs), list(graphs._graphs)


def test_the_old_rule_differs(targets):
    """The planted bug the buffer fixes: verifying distribution drafts as point masses
    inside the graph (the flags cleared) changes seeded tokens, so the equality above
    means the graphs really apply ``min(1, p / q)``."""
    target = targets["target"]
    prompts, params = _workload(3, sampled=3, greedy=1)
    want, want_stats, _, _ = _run(target, "eager", MTP, prompts, params)
    llm = _engine(target, "graphs", max_num_seqs=8, speculative_config=MTP)
    graphs = llm.engine.runner.graphs
    fill = graphs.fill

    def no_flags(st, sched, shape, logqs=None):
        fill(st, sched, shape, logqs)
        if shape.sampling.drafted:
            st.meta[:, st.flags:] = 0

    graphs.fill = no_flags
    got = output_tokens(llm.generate(prompts, params, use_tqdm=False))
    assert graphs.counters["drafted_graph_steps"] > 0
    assert got != want or llm.stats()["spec_accepted_tokens"] != want_stats["spec_accepted_tokens"]


def test_log_q_buffer_only_for_distribution_drafters(targets, tiny_granite):
    """The static log q buffer exists only when the drafter samples from a distribution
    (MTP, draft model): ``[max_batch * k, vocab]`` float32, zero-filled; none for n-gram
    drafts or without speculation (their steps cost nothing more)."""
    target = targets["target"]
    for spec in (MTP, _draft_spec(targets["draft"])):
        graphs = _engine(target, "graphs", max_num_seqs=5, speculative_config=spec).engine.runner.graphs
        vocab = graphs.model.config.vocab_size
        assert graphs.max_batch == 8 and graphs.max_drafted == K
        assert graphs.static_logq.shape == (8 * K, vocab)
        assert graphs.static_logq.dtype == sampler.LOGQ_DTYPE == torch.float32
        assert not graphs.static_logq.any()
    ngram = {"method": "ngram", "num_speculative_tokens": K}
    for kw in ({"speculative_config": ngram}, {}):
        graphs = _engine(tiny_granite, "graphs", **kw).engine.runner.graphs
        assert graphs.static_logq is None and graphs.max_drafted == 0
    with pytest.raises(ValueError, match="max_drafts"):
        graphs.enable_draft_distributions(0)


def test_drafters_return_float32_log_q_drawn_from_the_rounded_values():
    """``draft_choices`` returns ``log q`` in LOGQ_DTYPE and draws the draft from those
    rounded values (what the target's test divides by), on any rows beside it."""
    from hybridserve.drafters.base import draft_choices

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    temps = torch.full((64,), 0.7)
    temps[::5] = 0.0
    lo = torch.arange(64, dtype=torch.int64) * 31 + 7
    hi = torch.zeros(64, dtype=torch.int64)
    index = torch.arange(64, dtype=torch.int64) % 9
    tokens, logq = draft_choices(logits, temps, lo, hi, index)
    assert logq.dtype == sampler.LOGQ_DTYPE
    want = torch.log_softmax(logits.double() / torch.where(temps > 0, temps, 1.0)[:, None], -1)
    assert torch.equal(logq, want.float())
    hot = temps > 0
    assert torch.equal(tokens[hot], sampler.draft_draw(logq, lo, hi, index)[hot])
    assert torch.equal(tokens[~hot], logits.argmax(-1)[~hot])
    # Row by row: a subset of the rows gives the same drafts and log q.
    sub = torch.arange(3, 40, 4)
    t2, q2 = draft_choices(logits[sub], temps[sub], lo[sub], hi[sub], index[sub])
    assert torch.equal(t2, tokens[sub]) and torch.equal(q2, logq[sub])


def test_uniforms_at_equals_the_gathered_table():
    g = torch.Generator().manual_seed(1)
    n, vocab = 40, 300
    lo = torch.randint(0, 1 << 31, (n,), generator=g)
    hi = torch.randint(0, 1 << 31, (n,), generator=g)
    index = torch.randint(0, 1000, (n,), generator=g)
    tokens = torch.randint(0, vocab, (n, 3), generator=g)
    table = sampler.uniforms(lo, hi, index, vocab)
    assert torch.equal(sampler.uniforms_at(lo, hi, index, tokens), table.gather(1, tokens))


def test_flagged_draw_equals_the_eager_subset():
    """``sample_step`` over every draft slot with flags equals the eager call on the
    flagged positions only (the others keep the point-mass draw), bit for bit."""
    g = torch.Generator().manual_seed(2)
    vocab, b, q = 70, 4, 4
    n = b * q
    logits = torch.randn(n, vocab, generator=g) * 2
    rows = []
    for i in range(b):
        p = SamplingParams(temperature=0.0 if i == 3 else 0.9, seed=40 + i, top_p=0.9 if i == 1 else 1.0)
        rows.append(sampler.SampleRow(p, 40 + i, 2 + i, [5], [], [7, 8, 9]))
    plan = sampler.plan_draw(rows, vocab)
    logq = torch.log_softmax(torch.randn(b * (q - 1), vocab, generator=g, dtype=torch.float64), -1).float()
    drafts = torch.randint(0, vocab, (b, q - 1), generator=g)
    flags = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)
    pos = (torch.arange(b)[:, None] * q + torch.arange(q - 1)[None, :]).reshape(-1)
    graph = sampler.sample_step(logits, plan, plan.packed,
                                (pos, logq, drafts.reshape(-1), flags.reshape(-1)))
    keep = flags.reshape(-1)
    eager = sampler.sample_step(logits, plan, plan.packed,
                                (pos[keep], logq[keep], drafts.reshape(-1)[keep], None))
    assert torch.equal(graph, eager)
    plain = sampler.sample_step(logits, plan, plan.packed)
    assert torch.equal(graph[~torch.isin(torch.arange(n), pos[keep])],
                       plain[~torch.isin(torch.arange(n), pos[keep])])


def test_fill_writes_flags_and_log_q_slots(targets):
    """The fill of a drafted step: flags 1 at each row's distribution drafts only, the
    row's ``log q`` at ``i * (q - 1) + j``, zero flags for point-mass rows, a row's
    padding slots and padding rows; unflagged slots are not written."""
    llm = _engine(targets["target"], "graphs", max_num_seqs=8, speculative_config=MTP)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    captured = []
    replay = graphs.replay

    def spy(sched, tokens=None, logqs=None):
        if logqs is not None and not captured:
            shape = graphs.shape_of(sched, logqs)
            if shape is not None and shape.rows >= 2:
                before = graphs.static_logq.clone()
                st = _Static(shape.q, graphs.max_batch, graphs.max_blocks, graphs.scratch_block,
                             graphs.scratch_page, graphs.block_size, torch.device("cpu"), flags=True)
                graphs.fill(st, sched, shape, logqs)
                drafts = [row.request.draft_token_ids[: row.num_drafts] for row in sched.rows]
                captured.append((sched, shape, logqs, st, before, graphs.static_logq.clone(),
                                 drafts))
        return replay(sched, tokens, logqs)

    graphs.replay = spy
    prompts, params = _workload(7, sampled=3, greedy=1)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished_requests() and not captured:
        engine.step()
    assert captured, "no drafted step of two rows or more"
    sched, shape, logqs, st, before, after, drafts = captured[0]
    d = shape.q - 1
    assert shape.sampling.drafted and st.meta.shape[1] == st.flags + d
    flagged = set()
    for i, (row, logq) in enumerate(zip(sched.rows, logqs)):
        flags = st.meta[i, st.flags : st.flags + d].tolist()
        nd = row.num_drafts if logq is not None else 0
        assert flags == [1] * nd + [0] * (d - nd), (i, flags)
        assert st.meta[i, 1 : 1 + row.num_drafts].tolist() == drafts[i]
        if nd:
            assert torch.equal(after[i * d : i * d + nd], logq[:nd])
            flagged.update(range(i * d, i * d + nd))
    assert flagged, "the step flagged no draft"
    assert (st.meta[shape.rows : shape.batch, st.flags:] == 0).all()
    untouched = [s for s in range(after.shape[0]) if s not in flagged]
    assert torch.equal(after[untouched], before[untouched])


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mtp", "draft_model", "mtp_mixed"])
def test_captured_distribution_draft_steps_equal_eager_on_cuda(method, targets):
    """On CUDA, under real capture: seeded sampled requests with MTP / draft-model
    drafts (beside greedy ones; ``mtp_mixed``: two sampled requests' drafts verified as
    point masses in the same steps) replay captured verify graphs that read the log q
    buffer, none runs eagerly, and the tokens and acceptance equal the eager engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = targets["target"]
    spec = _draft_spec(targets["draft"]) if method == "draft_model" else MTP
    prompts, params = _workload(3, sampled=4, greedy=2)
    point = ("gen-1", "gen-3") if method == "mtp_mixed" else ()
    want, want_stats, _, eager_spec = _run(target, "eager", spec, prompts, params, point,
                                           device="cuda")
    got, stats, graphs, graph_spec = _run(target, "graphs", spec, prompts, params, point,
                                          device="cuda")
    assert eager_spec and not graph_spec
    assert got == want
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        assert stats[key] == want_stats[key], key
    assert graphs.capture and not graphs.capture_errors, graphs.capture_errors
    assert graphs.counters["drafted_graph_steps"] >= len(eager_spec), graphs.counters
    assert graphs.counters["captures"] > 0


def test_logq_graphs_off_leaves_distribution_steps_eager(targets):
    """``KernelPolicy.logq_graphs="off"``: the graphs hold no log q buffer, the verify
    steps of distribution drafts run eagerly, and their tokens are the eager engine's."""
    prompts, params = _workload(3, sampled=2, greedy=1)
    want, want_stats, _, _ = _run(targets["target"], "eager", MTP, prompts, params)
    llm = _engine(targets["target"], "off", max_num_seqs=8, speculative_config=MTP,
                  kernel_policy=KernelPolicy(logq_graphs="off"))
    assert llm.engine.runner.graphs.static_logq is None
    eager_spec = _spy_eager_distribution_steps(llm)
    assert output_tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert eager_spec
    assert llm.stats()["spec_accepted_tokens"] == want_stats["spec_accepted_tokens"]
    with pytest.raises(ValueError, match="logq_graphs"):
        KernelPolicy(logq_graphs="yes")
