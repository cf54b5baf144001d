"""The model runner: turns a scheduled step into a forward, then samples and verifies.

It owns the cache tensors and the persistent per-slot metadata (``slot_num_computed``,
``slot_state_page``: indexed by request slot, as the state postprocess reads them
through ``idx_mapping``). It never decides what to run; the scheduler does.

With decode graphs enabled (:meth:`ModelRunner.enable_decode_graphs`, the engine's
default on CUDA), a greedy decode or verify step replays a captured CUDA graph
(:mod:`hybridserve.runner.cuda_graph`); every other step runs eagerly as below. A
replayed step can also be split in two (:meth:`ModelRunner.launch`, then
:meth:`ModelRunner.collect`): the engine's async scheduling launches the next step in
between, its input tokens taken from this one's choices on the device.

Sampling (:mod:`hybridserve.runner.sampler`) stays on the logits' device: a step whose
sampling rows are all plain greedy reads back one argmax id per position; any other
step samples all its rows at once through the batched sampler, after one upload of the
step's per-position parameters, and reads back one int64 tensor (the chosen tokens and
the logprobs payload). The host then walks each row's drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.runner import sampler
from hybridserve.runner.cuda_graph import DecodeGraphs
from hybridserve.step import Logprob, RowResult, SchedulerOutput, kv_slot


@dataclass
class PendingStep:
    """A graph-replayed step launched and not yet read back (:meth:`ModelRunner.launch`).

    ``choices``: the step's chosen ids on the device (a copy of its own, so a later
    replay of the same graph cannot overwrite them), row ``i``'s at ``i * q``;
    ``values``: what the step reads back (the choices, then the postprocess decisions),
    copying into ``host`` (pinned) behind ``done`` on CUDA.
    """

    sched: SchedulerOutput
    q: int
    choices: torch.Tensor
    values: torch.Tensor
    num_choices: int
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        caches: ModelCaches,
        kv_block_size: int,
        max_num_seqs: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.caches = caches
        self.block_size = kv_block_size
        self.device = torch.device(device)
        self.slot_num_computed = torch.zeros(max_num_seqs, dtype=torch.int32, device=self.device)
        self.slot_state_page = torch.full((max_num_seqs,), -1, dtype=torch.int32, device=self.device)
        self.max_num_seqs = max_num_seqs
        self.graphs: DecodeGraphs | None = None
        # Set by the engine: called once the step's choices exist on the device, with the
        # verify rows (indices into the step's rows) and their accepted counts as a
        # device tensor; returns a device tensor to read back in the same transfer as
        # the choices. Its host values land in ``verify_readback``.
        self.on_verify: Callable[[SchedulerOutput, list[int], torch.Tensor], torch.Tensor] | None = None
        self.verify_readback: list[int] | None = None

    def enable_decode_graphs(
        self, max_blocks: int, scratch_block: int, scratch_page: int, capture: bool | None = None
    ) -> DecodeGraphs:
        """Replay greedy decode and verify steps from CUDA graphs.

        ``max_blocks``: the widest block table a graph takes (a sequence of
        ``max_model_len`` tokens). ``scratch_block`` / ``scratch_page``: a KV block and
        a state page that no request ever owns (padding rows write there).
        ``capture``: None captures on CUDA only; False runs the same static-buffer step
        eagerly (the CPU tests' mode).
        """
        self.graphs = DecodeGraphs(
            self.model, self.caches, self.block_size, self.max_num_seqs, max_blocks,
            scratch_block, scratch_page, self.device, capture,
        )
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
        max_blocks = max((len(r.request.block_ids) for r in sched.rows), default=1)
        tables = torch.full((len(sched.rows), max(max_blocks, 1)), -1, dtype=torch.int32)
        for i, row in enumerate(sched.rows):
            req = row.request
            n, q = row.num_computed, row.num_tokens
            toks = req.all_token_ids[n : n + q - row.num_drafts] + req.draft_token_ids[: row.num_drafts]
            ids += toks
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
        # Ids, positions and slots travel in one transfer, the block table in another;
        # both from pinned memory on CUDA, so the host does not wait for the device (a
        # copy from pageable memory synchronises).
        tokens = len(ids)
        flat = torch.tensor(ids + positions + slots, dtype=torch.long)
        if self.device.type == "cuda":
            flat, tables = flat.pin_memory(), tables.pin_memory()
        flat = flat.to(self.device, non_blocking=True)
        input_ids, positions_d, slots_d = flat.split([tokens, tokens, tokens])
        batch = ForwardBatch(
            query_start=query_start,
            num_computed=num_computed,
            positions=positions_d,
            context_lens=context_lens,
            block_tables=tables.to(self.device, non_blocking=True),
            slot_mapping=slots_d,
            state_in_page=state_in,
            state_out_row=out_row,
            state_out_offset=out_off,
            state_out_page=out_page,
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
        """
        if self.graphs is None:
            return None
        tokens = None
        if after is not None:
            src = torch.tensor([j * after.q for j in sources], dtype=torch.int64)
            if after.choices.is_cuda:
                src = src.pin_memory()
            tokens = after.choices.index_select(
                0, src.to(after.choices.device, non_blocking=True)
            )
        replayed = self.graphs.replay(sched, tokens)
        if replayed is None:
            return None
        out, q = replayed
        choices = out[: len(sched.rows) * q].clone()
        # Row i's choices sit at [i * q, i * q + num_tokens).
        starts = [i * q for i in range(len(sched.rows))]
        tail = self._verify_tail(sched, choices, starts)
        values = choices if tail is None else torch.cat([choices, tail])
        pending = PendingStep(sched, q, choices, values, choices.numel())
        if values.is_cuda:
            pending.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            pending.host.copy_(values, non_blocking=True)
            pending.done = torch.cuda.Event()
            pending.done.record()
        return pending

    def collect(self, pending: PendingStep) -> list[RowResult]:
        """Wait for a launched step's read-back; its rows' results (and the postprocess
        decisions in :attr:`verify_readback`)."""
        if pending.done is not None:
            pending.done.synchronize()
            host = pending.host.tolist()
        else:
            host = pending.values.tolist()
        n = pending.num_choices
        self.verify_readback = host[n:] if len(host) > n else None
        results = []
        for i, row in enumerate(pending.sched.rows):
            drafts = row.request.draft_token_ids[: row.num_drafts]
            choices = host[i * pending.q : i * pending.q + row.num_tokens]
            results.append(RowResult(sampler.verify_choices(choices, drafts), []))
        return results

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[RowResult]:
        """Run the forward of a step, then sample (and verify drafts) for every row."""
        self.verify_readback = None
        pending = self.launch(sched)
        if pending is not None:
            return self.collect(pending)
        input_ids, batch = self.build_batch(sched)
        hidden = self.model.forward(input_ids, batch, self.caches)
        # Gather the positions whose logits are needed: every token of a verify row,
        # the last token of a prefill row that completes its sequence.
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
            return [RowResult([], []) for _ in sched.rows]
        index = torch.tensor(gather, dtype=torch.long)
        if hidden.is_cuda:
            # Asynchronous copy: the host keeps queueing work instead of waiting here for
            # the forward to finish.
            index = index.pin_memory()
        index = index.to(hidden.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[index])
        sampling = [i for i, (_, k) in enumerate(spans) if k > 0]
        starts = [start for start, _ in spans]
        if all(sampler.samples_by_argmax(sched.rows[i].request.params) for i in sampling):
            # Only plain greedy rows: the choice is the argmax of the raw logits, one id
            # per position read back, no parameters to send.
            choices = self._read_back(sched, sampler.argmax_ids(logits), starts)
            lps: dict[int, dict[int, Logprob]] = {}
        else:
            choices, lps = self._sample(sched, sampling, logits, starts)
        results = []
        for row, (start, k) in zip(sched.rows, spans):
            if k == 0:
                results.append(RowResult([], []))
                continue
            drafts = row.request.draft_token_ids[: row.num_drafts]
            tokens = sampler.verify_choices(choices[start : start + k], drafts)
            logprobs = [lps[start + j] for j in range(len(tokens))] if start in lps else []
            results.append(RowResult(tokens, logprobs))
        return results

    def _read_back(
        self, sched: SchedulerOutput, values: torch.Tensor, starts: Sequence[int]
    ) -> list[int]:
        """The step's one device-to-host read: ``values`` (int64; the choices first,
        row ``i``'s from ``starts[i]``, then anything else the step reads), followed by
        what :attr:`on_verify` returns for the step's verify rows, whose host values go
        to :attr:`verify_readback`."""
        n = values.numel()
        tail = self._verify_tail(sched, values, starts)
        if tail is None:
            return values.tolist()
        host = torch.cat([values, tail]).tolist()
        self.verify_readback = host[n:]
        return host[:n]

    def _verify_tail(
        self, sched: SchedulerOutput, choices: torch.Tensor, starts: Sequence[int]
    ) -> torch.Tensor | None:
        """Accepted counts of the verify rows computed on the device (a draft is
        accepted while it equals the choice at its position: the greedy rule, and the
        sampled one, since a draw is coupled to its position; see
        :mod:`~hybridserve.runner.sampler`), handed to :attr:`on_verify`."""
        if self.on_verify is None:
            return None
        verify = [i for i, row in enumerate(sched.rows) if row.is_verify]
        if not verify:
            return None
        width = max(sched.rows[i].num_drafts for i in verify)
        if width == 0:
            accepted = torch.ones(len(verify), dtype=torch.int64, device=choices.device)
        else:
            # [rows, width] positions of the choices to compare and the drafts (-1 pads,
            # which no choice equals), in one upload.
            pos, drafts = [], []
            for i in verify:
                row = sched.rows[i]
                d = row.num_drafts
                pos += [starts[i] + j for j in range(d)] + [0] * (width - d)
                drafts += row.request.draft_token_ids[:d] + [-1] * (width - d)
            host = torch.tensor(pos + drafts, dtype=torch.int64)
            if choices.is_cuda:
                host = host.pin_memory()
            both = host.to(choices.device, non_blocking=True).view(2, len(verify), width)
            match = (choices[both[0]] == both[1]).long()
            accepted = 1 + match.cumprod(dim=1).sum(dim=1)
        return self.on_verify(sched, verify, accepted)

    def _sample(
        self,
        sched: SchedulerOutput,
        sampling: list[int],
        logits: torch.Tensor,
        starts: Sequence[int],
    ) -> tuple[list[int], dict[int, dict[int, Logprob]]]:
        """Every sampling row of the step through the batched sampler: parameters up in
        one transfer, the chosen tokens (and the logprobs payload) back in one."""
        rows = []
        for i in sampling:
            row = sched.rows[i]
            req = row.request
            rows.append(
                sampler.SampleRow(
                    params=req.params,
                    sample_seed=req.sample_seed,
                    first_index=len(req.output_token_ids),
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
                    drafts=req.draft_token_ids[: row.num_drafts],
                )
            )
        plan = sampler.plan_step(rows, logits.shape[-1])
        packed = plan.packed
        if logits.is_cuda:
            packed = packed.pin_memory()
        packed = packed.to(logits.device, non_blocking=True)
        # The choices come first in the output, then the logprobs payload: one read.
        values = self._read_back(sched, sampler.sample_step(logits, plan, packed), starts)
        return sampler.read_step(values, plan)
