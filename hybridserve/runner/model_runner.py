"""The model runner: turns a scheduled step into a forward, then samples, verifies and
decides the state pages of verify rows; it owns every device launch of a step.

It owns the cache tensors. It never decides what to run (the scheduler does) and never
changes host bookkeeping: it returns a :class:`~hybridserve.step.StepResult` (every row's
new tokens, and for each verify row the state postprocess's decision) that the engine
commits.

Per step: the forward's inputs (:meth:`ModelRunner.build_batch`), the step plan
(``model.plan_step``, once), the forward, the logits of the positions that sample, the
draw, the verify rows' accepted counts on the device, then the state postprocess
(:mod:`hybridserve.kernels.state_postprocess`: the fused Triton kernel on CUDA, its twin
elsewhere) from per-row inputs, and one read-back of the choices and the decisions.

With decode graphs enabled (:meth:`ModelRunner.enable_decode_graphs`, the engine's
default on CUDA), a decode or verify step (greedy, sampled or constrained, its drafts point
masses or sampled from a drafter's distribution, whose ``log q`` the graphs take from a
static buffer) replays a captured CUDA graph
(:mod:`hybridserve.runner.cuda_graph`), and so does a short-row step (a prompt's tail
after a cached prefix: few prefill rows of at most the policy's ``max_short_tokens``
tokens, without penalties or logprobs; :meth:`~hybridserve.runner.cuda_graph.DecodeGraphs.replay_short`); every
other step runs eagerly as below. A
replayed step can also be split in two (:meth:`ModelRunner.launch`, then
:meth:`ModelRunner.collect`): the engine's async scheduling launches the next step in
between, its input tokens taken from this one's choices on the device; a constrained
step launched so replays its forward only, and its draw (:meth:`ModelRunner.draw`)
follows once the step before is committed (its masks need those tokens).

Sampling (:mod:`hybridserve.runner.sampler`) stays on the logits' device: a step whose
sampling rows are all plain greedy reads back one argmax id per position; any other
step samples all its rows at once through the batched sampler, after one upload of the
step's per-position parameters, and reads back one int64 tensor (the chosen tokens and
the logprobs payload). The host then walks each row's drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.cache.host_tier import HostStatePool
from hybridserve.kernels.state_postprocess import (
    max_checkpoints_per_row,
    state_postprocess,
    state_postprocess_reference,
)
from hybridserve.kernels.transfer import upload, upload_lists
from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.runner import sampler
from hybridserve.runner.cuda_graph import DecodeGraphs, DeferredDraw
from hybridserve.step import (
    Logprob,
    PostprocessDecision,
    RowResult,
    SchedulerOutput,
    StepResult,
    Transfers,
    kv_slot,
)

# Rows of at least this many tokens build their positions and slots in numpy: below it a
# decode or verify row's few tokens are faster as Python ints.
_VECTOR_ROW = 64


def _merge_long_rows(positions: list[int], slots: list[int],
                     long_rows: list[tuple[int, np.ndarray, np.ndarray]]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The step's positions and slots in row order: the short rows' Python ints with each
    long row's arrays inserted at its place (``at``: how many short-row tokens come
    before it)."""
    pos_parts, slot_parts, done = [], [], 0
    for at, pos, slot in long_rows:
        pos_parts += [np.asarray(positions[done:at], dtype=np.int64), pos]
        slot_parts += [np.asarray(slots[done:at], dtype=np.int64), slot]
        done = at
    pos_parts.append(np.asarray(positions[done:], dtype=np.int64))
    slot_parts.append(np.asarray(slots[done:], dtype=np.int64))
    return np.concatenate(pos_parts), np.concatenate(slot_parts)


@dataclass
class PendingStep:
    """A graph-replayed step launched and not yet read back (:meth:`ModelRunner.launch`).

    ``choices``: the step's chosen ids on the device (a copy of its own, so a later
    replay of the same graph cannot overwrite them), row ``i``'s at ``i * q``;
    ``values``: what the step reads back (the choices, then the postprocess decisions),
    copying into ``host`` (pinned) behind ``done`` on CUDA.

    ``deferred``: a masked step scheduled ahead whose forward is queued and whose draw
    waits for the step before to be committed (:meth:`ModelRunner.draw`); until then
    ``choices`` and ``values`` are None.
    """

    sched: SchedulerOutput
    q: int
    choices: torch.Tensor | None
    values: torch.Tensor | None
    num_choices: int
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    deferred: DeferredDraw | None = None


class ModelRunner:
    """``boundary_interval``: the boundary interval the state postprocess reports crossings
    of (the scheduler's ``boundary_interval()``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        caches: ModelCaches,
        kv_block_size: int,
        max_num_seqs: int,
        device: torch.device | str = "cpu",
        boundary_interval: int = 1 << 30,
    ) -> None:
        self.model = model
        self.caches = caches
        self.block_size = kv_block_size
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.boundary_interval = boundary_interval
        self.graphs: DecodeGraphs | None = None
        # Keep the last step's final hidden states ``[T, hidden]`` (packed as the step's
        # tokens) in ``last_hidden``; set before enable_decode_graphs.
        self.keep_hidden = False
        # Per request id: the drafter's log-probabilities ``[drafts, vocab]`` of the
        # drafts it sampled (none for point-mass drafts), set by the engine each step.
        self.draft_logq: dict[str, torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None
        # The host tier's tensors (set by the engine when the tier is on).
        self.host_pool: HostStatePool | None = None

    def run_transfers(self, sched: SchedulerOutput) -> None:
        """Perform the host-tier copies a step carries (once), before its forward, and
        order the forward after any restore whose page it reads."""
        if self.host_pool is None:
            return
        # Cleared only once the copies are queued: a step whose copies raised keeps
        # them, so the engine can forget what they were to carry.
        self.host_pool.run(sched.transfers)
        sched.transfers = Transfers()
        self.host_pool.before_forward([row.state_in_page for row in sched.rows])

    def enable_decode_graphs(
        self, max_blocks: int, scratch_block: int, scratch_page: int, capture: bool | None = None,
        draft_distributions: int = 0,
    ) -> DecodeGraphs:
        """Replay greedy decode and verify steps from CUDA graphs.

        ``max_blocks``: the widest block table a graph takes (a sequence of
        ``max_model_len`` tokens). ``scratch_block`` / ``scratch_page``: a KV block and
        a state page that no request ever owns (padding rows write there).
        ``capture``: None captures on CUDA only; False runs the same static-buffer step
        eagerly (the CPU tests' mode). ``draft_distributions``: with a drafter that
        samples drafts from a distribution of its own (``draft_logq``), the most drafts
        a row carries: the graphs then hold a static ``log q`` buffer and replay the
        sampled verify steps of such drafts too
        (:meth:`~hybridserve.runner.cuda_graph.DecodeGraphs.enable_draft_distributions`);
        0 (n-gram drafts, no speculation) allocates nothing.
        """
        self.graphs = DecodeGraphs(
            self.model, self.caches, self.block_size, self.max_num_seqs, max_blocks,
            scratch_block, scratch_page, self.device, capture,
        )
        self.graphs.keep_hidden = self.keep_hidden
        if draft_distributions:
            self.graphs.enable_draft_distributions(draft_distributions)
        return self.graphs

    def build_batch(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        """Packed input ids and the :class:`ForwardBatch` of a scheduled step."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        num_computed, context_lens, state_in = [], [], []
        out_row, out_off, out_page = [], [], []
        long_rows: list[tuple[int, np.ndarray, np.ndarray]] = []  # (at, positions, slots)
        max_blocks = max((len(r.request.block_ids) for r in sched.rows), default=1)
        tables = torch.full((len(sched.rows), max(max_blocks, 1)), -1, dtype=torch.int32)
        for i, row in enumerate(sched.rows):
            req = row.request
            n, q = row.num_computed, row.num_tokens
            toks = req.all_token_ids[n : n + q - row.num_drafts] + req.draft_token_ids[: row.num_drafts]
            ids += toks
            if q >= _VECTOR_ROW:
                # A prefill chunk: its positions and slots in numpy (kv_slot's arithmetic
                # for every position at once), not a Python call per token.
                pos = np.arange(n, n + q, dtype=np.int64)
                long_rows.append((len(positions), pos,
                                  np.asarray(req.block_ids, dtype=np.int64)[pos // bs] * bs
                                  + pos % bs))
            else:
                for pos in range(n, n + q):
                    positions.append(pos)
                    slots.append(kv_slot(req.block_ids, pos, bs))
            query_start.append(query_start[-1] + q)
            num_computed.append(n)
            context_lens.append(n + q)
            state_in.append(row.state_in_page)
            tables[i, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
            for p, page in row.state_outputs.items():
                out_row.append(i)
                out_off.append(p - 1 - n)
                out_page.append(page)
        if long_rows:
            positions, slots = _merge_long_rows(positions, slots, long_rows)
        # Ids, positions and slots travel in one transfer, the block table in another.
        input_ids, positions_d, slots_d = upload_lists(
            [ids, positions, slots], torch.long, self.device
        )
        batch = ForwardBatch(
            query_start=query_start,
            num_computed=num_computed,
            positions=positions_d,
            context_lens=context_lens,
            block_tables=upload(tables, self.device),
            slot_mapping=slots_d,
            state_in_page=state_in,
            state_out_row=out_row,
            state_out_offset=out_off,
            state_out_page=out_page,
            # Every attention layer of the step walks the same rows: one tile map (and
            # one upload) for all of them, not one per layer.
            attention_tiles={},
        )
        return input_ids, batch

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        after: PendingStep | None = None,
        sources: Sequence[int] = (),
    ) -> PendingStep | None:
        """Replay ``sched`` from a decode graph and start its read-back without waiting
        for it; None (nothing ran) when the step does not qualify for a graph.

        ``after``: the step in flight that ``sched`` was scheduled ahead of (its rows are
        all ``ahead`` rows, row ``i`` continuing ``after``'s row ``sources[i]``): their
        input tokens are that step's choices, copied on the device.

        The step's host-tier copies run first (:meth:`run_transfers`), whether or not a
        graph replays it: they stay ahead of the forward.
        """
        self.run_transfers(sched)
        if self.graphs is None:
            return None
        tokens = None
        if after is not None:
            if after.deferred is not None:
                raise RuntimeError("a step was launched after one whose draw is not queued yet")
            if after.q == 1 and list(sources) == list(range(after.choices.numel())):
                # Every row of the step before continues, in order (a saturated engine's
                # usual step): its choices are the input tokens as they are, with no
                # index to upload and no gather.
                tokens = after.choices
            else:
                src = torch.tensor([j * after.q for j in sources], dtype=torch.int64)
                tokens = after.choices.index_select(0, upload(src, after.choices.device))
        replayed = self.graphs.replay(sched, tokens, self._row_distributions(sched))
        if replayed is None:
            return None
        out, q = replayed
        if self.keep_hidden:
            # The packed layout of the eager step (row i's tokens one after another).
            index = [i * q + t for i, row in enumerate(sched.rows) for t in range(row.num_tokens)]
            self.last_hidden = self.graphs.last_hidden.index_select(
                0, upload(torch.tensor(index, dtype=torch.long), self.graphs.last_hidden.device)
            )
        pending = PendingStep(sched, q, None, None, 0)
        if isinstance(out, DeferredDraw):
            pending.deferred = out
            return pending
        self._read_back_launched(pending, out)
        return pending

    @torch.inference_mode()
    def draw(self, pending: PendingStep) -> None:
        """Run the draw of a launched step whose draw was deferred (a masked step
        scheduled ahead, ``pending.deferred``), once the step before it is committed:
        its masks are filled from the rows' committed grammar states, then the draw,
        the state postprocess and the read-back are queued (:meth:`collect` waits)."""
        if pending.deferred is None:
            return
        out = self.graphs.draw(pending.deferred, pending.sched)
        pending.deferred = None
        self._read_back_launched(pending, out)

    def _read_back_launched(self, pending: PendingStep, out: torch.Tensor) -> None:
        """Queue a replayed step's choices (copied out of the graph's output), its state
        postprocess and the read-back of both into ``pending``."""
        sched, q = pending.sched, pending.q
        choices = out[: len(sched.rows) * q].clone()
        # Row i's choices sit at [i * q, i * q + num_tokens).
        starts = [i * q for i in range(len(sched.rows))]
        tail = self._postprocess(sched, choices, starts)
        values = choices if tail is None else torch.cat([choices, tail])
        pending.choices, pending.values, pending.num_choices = choices, values, choices.numel()
        if values.is_cuda:
            pending.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            pending.host.copy_(values, non_blocking=True)
            pending.done = torch.cuda.Event()
            pending.done.record()

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's read-back: its rows' results and decisions."""
        if pending.deferred is not None:
            raise RuntimeError("a step whose draw was deferred was collected before draw()")
        if pending.done is not None:
            pending.done.synchronize()
            host = pending.host.tolist()
        else:
            host = pending.values.tolist()
        n = pending.num_choices
        rows = pending.sched.rows
        if pending.q == 1:
            # One token a row and no drafts (a plain decode step): each row's result is
            # its choice (what verify_choices returns for a row without drafts).
            results = [RowResult([c], []) for c in host[: len(rows)]]
        else:
            results = []
            for i, row in enumerate(rows):
                drafts = row.request.draft_token_ids[: row.num_drafts]
                choices = host[i * pending.q : i * pending.q + row.num_tokens]
                results.append(RowResult(sampler.verify_choices(choices, drafts), []))
        return StepResult(results, self._decisions(pending.sched, host[n:]))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, overlap: Callable[[], None] | None = None) -> StepResult:
        """Run the forward of a step, then sample (and verify drafts) for every row, and
        decide the verify rows' state pages.

        ``overlap``: host work that needs none of the step's results, called once every
        launch of the step is queued and before its read-back waits for the device (the
        engine commits the step's prefill rows there), so it runs while the device
        computes. Called exactly once when the step's launches succeed, never when one
        of them raises."""
        pending = self.launch(sched)
        if pending is not None:
            if overlap is not None:
                overlap()
            return self.collect(pending)
        if self.graphs is not None:
            short = self.graphs.replay_short(sched, self.model)
            if short is not None:
                if overlap is not None:
                    overlap()
                # One read-back: every row's choice (rows that do not sample drop theirs).
                host = short.tolist()
                return StepResult([
                    RowResult([host[i]] if row.samples else [], [])
                    for i, row in enumerate(sched.rows)
                ])
            self.graphs.counters["eager_steps"] += 1
        spans, logits, prompt_lps = self.forward_logits(sched)
        if logits is None:
            # Nothing to read back: the device still computes when the overlap runs.
            if overlap is not None:
                overlap()
            return StepResult([RowResult([], [], prompt_lps.get(i)) for i in range(len(sched.rows))])
        sampling = [i for i, (_, k) in enumerate(spans) if k > 0]
        starts = [start for start, _ in spans]
        if all(sampler.samples_by_argmax(sched.rows[i].request.params) for i in sampling):
            # Only plain greedy rows: the choice is the argmax of the raw logits, one id
            # per position read back, no parameters to send.
            choices, decisions = self._read_back(sched, sampler.argmax_ids(logits), starts,
                                                 overlap)
            lps: dict[int, dict[int, Logprob]] = {}
        else:
            choices, lps, decisions = self._sample(sched, sampling, logits, starts, overlap)
        results = []
        for i, (row, (start, k)) in enumerate(zip(sched.rows, spans)):
            if k == 0:
                results.append(RowResult([], [], prompt_lps.get(i)))
                continue
            drafts = row.request.draft_token_ids[: row.num_drafts]
            tokens = sampler.verify_choices(choices[start : start + k], drafts)
            logprobs = [lps[start + j] for j in range(len(tokens))] if start in lps else []
            results.append(RowResult(tokens, logprobs, prompt_lps.get(i)))
        return StepResult(results, decisions)

    def forward_logits(
        self, sched: SchedulerOutput
    ) -> tuple[list[tuple[int, int]], torch.Tensor | None, dict[int, list[dict[int, Logprob]]]]:
        """The forward of a step and the logits of the positions that sample: every token
        of a verify row, the last token of a prefill row that completes its sequence.
        Returns ``(spans, logits, prompt_logprobs)``: row ``i``'s ``k`` logits rows start
        at ``spans[i] = (start, k)``; ``logits`` is None when no row samples; the prompt
        logprobs of the rows that ask for them (:meth:`_prompt_logprobs`). (A
        tensor-parallel worker runs exactly this part of :meth:`execute`.)"""
        input_ids, batch = self.build_batch(sched)
        # The step plan, once for the whole forward (every layer reads it).
        batch = self.model.plan_step(batch, self.device)
        hidden = self.model.forward(input_ids, batch, self.caches)
        if self.keep_hidden:
            # A drafter that reads the target's hidden states (MTP) takes them from here.
            self.last_hidden = hidden
        prompt_lps = self._prompt_logprobs(sched, batch.query_start, hidden)
        gather: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, row in enumerate(sched.rows):
            end = batch.query_start[i + 1]
            if not row.samples:
                spans.append((len(gather), 0))
                continue
            k = row.num_drafts + 1
            spans.append((len(gather), k))
            gather += range(end - k, end)
        if not gather:
            return spans, None, prompt_lps
        # Asynchronous: the host keeps queueing work instead of waiting for the forward.
        index = upload(torch.tensor(gather, dtype=torch.long), hidden.device)
        return spans, self.model.compute_logits(hidden[index]), prompt_lps

    PROMPT_LOGPROBS_CHUNK = 256
    """Prompt positions whose logits are computed at once (bounds the float32
    ``[positions, vocab]`` temporaries of a long prompt)."""

    def _prompt_logprobs(
        self, sched: SchedulerOutput, query_start: Sequence[int], hidden: torch.Tensor
    ) -> dict[int, list[dict[int, Logprob]]]:
        """Per prefill row whose request asks for ``prompt_logprobs``: the logprobs of
        the prompt tokens this row's positions predict (position p predicts token p + 1,
        for p + 1 inside the prompt), from the model's raw logits. Keyed by row index.
        One read-back per chunk of positions; rows that ask nothing cost nothing."""
        wanted = []
        for i, row in enumerate(sched.rows):
            k = row.request.params.prompt_logprobs
            if k is None or row.is_decode:
                continue
            prompt = row.request.prompt_token_ids
            count = min(row.num_tokens, len(prompt) - 1 - row.num_computed)
            if count > 0:
                wanted.append((i, k, row.num_computed, count))
        if not wanted:
            return {}
        index, targets, ks = [], [], []
        for i, k, n, count in wanted:
            start = query_start[i]
            index += range(start, start + count)
            targets += sched.rows[i].request.prompt_token_ids[n + 1 : n + 1 + count]
            ks += [k] * count
        top = max(ks)
        device = hidden.device
        flat: list[dict[int, Logprob]] = []
        for lo in range(0, len(index), self.PROMPT_LOGPROBS_CHUNK):
            hi = lo + self.PROMPT_LOGPROBS_CHUNK
            idx = torch.tensor(index[lo:hi], dtype=torch.long, device=device)
            tgt = torch.tensor(targets[lo:hi], dtype=torch.long, device=device)[:, None]
            logp = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            token_lp = logp.gather(1, tgt)
            rank = (logp > token_lp).sum(dim=-1)[:, None] + 1
            parts = [token_lp.double(), rank.double()]
            if top:
                best = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
                parts += [best.values.double(), best.indices.double()]
            # One read-back per chunk: float32 values and ids are exact in float64.
            host = torch.cat(parts, dim=1).tolist()
            m = (len(host[0]) - 2) // 2
            for j, h in enumerate(host):
                k = ks[lo + j]
                entry = {
                    int(t): Logprob(logprob=v, rank=r)
                    for r, (v, t) in enumerate(zip(h[2 : 2 + min(k, m)], h[2 + m : 2 + m + min(k, m)]), 1)
                }
                target = targets[lo + j]
                if target not in entry:
                    entry[target] = Logprob(logprob=h[0], rank=int(h[1]))
                flat.append(entry)
        out, at = {}, 0
        for i, _, _, count in wanted:
            out[i] = flat[at : at + count]
            at += count
        return out

    def _read_back(
        self,
        sched: SchedulerOutput,
        values: torch.Tensor,
        starts: Sequence[int],
        overlap: Callable[[], None] | None = None,
    ) -> tuple[list[int], dict[int, PostprocessDecision]]:
        """The step's one device-to-host read: ``values`` (int64; the choices first,
        row ``i``'s from ``starts[i]``, then anything else the step reads), followed by
        the state postprocess's decisions for the step's verify rows. ``overlap`` runs
        once the last launch is queued, before the read waits (:meth:`execute`)."""
        n = values.numel()
        tail = self._postprocess(sched, values, starts)
        if overlap is not None:
            overlap()
        if tail is None:
            return values.tolist(), {}
        host = torch.cat([values, tail]).tolist()
        return host[:n], self._decisions(sched, host[n:])

    def _postprocess(
        self, sched: SchedulerOutput, choices: torch.Tensor, starts: Sequence[int]
    ) -> torch.Tensor | None:
        """Launch the state postprocess of the step's verify rows as soon as their choices
        exist on the device; None when the step has none.

        The accepted counts are computed on the device (a draft is accepted while it
        equals the choice at its position: the greedy rule, and the sampled one, since a
        draw is coupled to its position; see :mod:`~hybridserve.runner.sampler`). The
        postprocess reads per-row inputs (row ``r`` is its own slot: ``idx_mapping`` is
        the identity), uploaded with the draft comparison in one transfer. Returns, as one
        int64 device tensor for the step's single read-back, per row: the accepted count,
        the new state page, the checkpoint pages, their prefix lengths, the released
        pages (:meth:`_decisions` reads it back).
        """
        verify = [i for i, row in enumerate(sched.rows) if row.is_decode]
        if not verify:
            return None
        device = choices.device
        rows = [sched.rows[i] for i in verify]
        b = len(rows)
        max_q = max(r.num_tokens for r in rows)
        width = max(r.num_drafts for r in rows)
        computed = [row.num_computed for row in rows]
        state_in = [row.state_in_page for row in rows]
        if max_q == 1:
            # Plain decode rows (one token, no drafts, so width is 0): the one output
            # page each, and nothing to compare.
            pages = [row.state_outputs[row.num_computed + 1] for row in rows]
            pos, drafts = [], []
        else:
            pages, pos, drafts = [], [], []
            for i, row in zip(verify, rows):
                n, d = row.num_computed, row.num_drafts
                pages += [row.state_outputs[n + 1 + j] for j in range(row.num_tokens)]
                pages += [-1] * (max_q - row.num_tokens)
                # [rows, width] positions of the choices to compare and the drafts (-1
                # pads, which no choice equals).
                pos += [starts[i] + j for j in range(d)] + [0] * (width - d)
                drafts += row.request.draft_token_ids[:d] + [-1] * (width - d)
        # Every host-side input of the launch travels in one transfer; the tensors below
        # are views of it. Without drafts it holds only the postprocess's int32 inputs,
        # uploaded as int32 (no conversions queued on the device); with drafts it also
        # holds the comparison's positions, which index as int64.
        if width == 0:
            packed = upload(torch.tensor(computed + state_in + pages, dtype=torch.int32), device)
            computed_d, state_in_d = packed[: 2 * b].view(2, b)
            out_pages = packed[2 * b :].view(b, max_q)
        else:
            packed = upload(
                torch.tensor(computed + state_in + pages + pos + drafts, dtype=torch.int64), device
            )
            computed_d, state_in_d = packed[: 2 * b].to(torch.int32).view(2, b)
            out_pages = packed[2 * b : 2 * b + b * max_q].to(torch.int32).view(b, max_q)
        if width == 0:
            accepted = torch.ones(b, dtype=torch.int64, device=device)
        else:
            both = packed[2 * b + b * max_q :].view(2, b, width)
            match = (choices[both[0]] == both[1]).long()
            accepted = 1 + match.cumprod(dim=1).sum(dim=1)
        decide = state_postprocess if device.type == "cuda" else state_postprocess_reference
        result = decide(
            idx_mapping=torch.arange(b, dtype=torch.int32, device=device),
            num_computed=computed_d.contiguous(),
            num_accepted=accepted.to(torch.int32),
            out_pages=out_pages,
            state_page=state_in_d.contiguous(),
            # The request holds a reference on whatever page it read, a checkpoint too.
            release_prev=state_in_d >= 0,
            boundary_interval=self.boundary_interval,
        )
        # One int64 tensor: cat promotes the int32 results itself (no conversion each).
        return torch.cat(
            [accepted[:, None], result.new_state_page[:, None], result.ckpt_page,
             result.ckpt_len, result.release_pages], dim=1,
        ).reshape(-1)

    def _decisions(self, sched: SchedulerOutput, host: list[int]) -> dict[int, PostprocessDecision]:
        """The verify rows' :class:`~hybridserve.step.PostprocessDecision` from the host values
        of :meth:`_postprocess`'s tensor, keyed by row index."""
        verify = [i for i, row in enumerate(sched.rows) if row.is_decode]
        if not verify:
            return {}
        if not host:
            raise RuntimeError("a step with verify rows read back no postprocess decisions")
        max_q = max(sched.rows[i].num_tokens for i in verify)
        k = max_checkpoints_per_row(max_q, self.boundary_interval)
        width = 2 + 2 * k + max_q
        if len(host) != width * len(verify):
            raise RuntimeError(
                f"postprocess read-back of {len(host)} values for {len(verify)} rows of {width}"
            )
        out = {}
        if k == 1 and max_q == 1:
            # Plain decode rows: [accepted, state page, checkpoint page, its length,
            # released page] each, unpacked without the general slicing below.
            for j, i in enumerate(verify):
                a, page, ckpt_page, ckpt_len, rel = host[j * 5 : j * 5 + 5]
                out[i] = PostprocessDecision(
                    a, page, ((ckpt_len, ckpt_page),) if ckpt_page >= 0 else (),
                    (rel,) if rel >= 0 else (),
                )
            return out
        for j, i in enumerate(verify):
            h = host[j * width : (j + 1) * width]
            ckpts = tuple(
                (p, page) for p, page in zip(h[2 + k : 2 + 2 * k], h[2 : 2 + k]) if page >= 0
            )
            released = tuple(p for p in h[2 + 2 * k :] if p >= 0)
            out[i] = PostprocessDecision(h[0], h[1], ckpts, released)
        return out

    def _sample(
        self,
        sched: SchedulerOutput,
        sampling: list[int],
        logits: torch.Tensor,
        starts: Sequence[int],
        overlap: Callable[[], None] | None = None,
    ) -> tuple[list[int], dict[int, dict[int, Logprob]], dict[int, PostprocessDecision]]:
        """Every sampling row of the step through the batched sampler: parameters up in
        one transfer, the chosen tokens (and the logprobs payload, and the decisions)
        back in one (``overlap`` as :meth:`_read_back` runs it)."""
        rows = [sampler.SampleRow.of(sched.rows[i]) for i in sampling]
        plan = sampler.plan_draw(rows, logits.shape[-1])
        packed = upload(plan.packed, logits.device)
        # The choices come first in the output, then the logprobs payload: one read.
        drafted = self._drafted_positions(sched, sampling, logits.device)
        values, decisions = self._read_back(
            sched, sampler.sample_step(logits, plan, packed, drafted, self._sampler_kernels()), starts,
            overlap,
        )
        return (*sampler.read_step(values, plan), decisions)

    def _sampler_kernels(self) -> str:
        """The model's ``KernelPolicy.sampler`` ("auto" for a model without a policy)."""
        policy = getattr(self.model, "kernel_policy", None)
        return policy.sampler if policy is not None else "auto"

    def _row_distributions(self, sched: SchedulerOutput) -> list[torch.Tensor | None] | None:
        """Per row of ``sched``: the drafter's ``log q [drafts, vocab]`` when the row is
        sampled and verifies drafts its drafter sampled from a distribution of its own
        (``draft_logq``), else None; None for the step when no row does. The one rule
        that picks the :func:`~hybridserve.runner.sampler.speculative_choices` positions,
        for the eager sampler (:meth:`_drafted_positions`) and the decode graphs alike;
        every other draft (point masses, greedy rows) keeps the coupled rule."""
        if not self.draft_logq:
            return None
        out = [
            self.draft_logq.get(row.request.request_id)
            if row.num_drafts and not row.request.params.greedy else None
            for row in sched.rows
        ]
        return out if any(q is not None for q in out) else None

    def _drafted_positions(self, sched: SchedulerOutput, sampling: list[int], device):
        """``(positions, logq, drafts, None)`` of the step's draft positions whose
        drafter sampled them from its own distribution (:meth:`_row_distributions`), for
        the sampler: every such position carries ``q``."""
        logqs = self._row_distributions(sched)
        if logqs is None:
            return None
        pos, rows, drafts = [], [], []
        start = 0
        for i in sampling:
            row = sched.rows[i]
            logq = logqs[i]
            if logq is not None:
                pos += range(start, start + row.num_drafts)
                rows.append(logq[: row.num_drafts])
                drafts += row.request.draft_token_ids[: row.num_drafts]
            start += row.num_drafts + 1
        if not pos:
            return None
        return (
            torch.tensor(pos, dtype=torch.long, device=device),
            torch.cat(rows).to(device),
            torch.tensor(drafts, dtype=torch.long, device=device),
            None,
        )
