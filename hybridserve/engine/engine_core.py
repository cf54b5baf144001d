"""The step loop: draft, schedule, run, verify, postprocess state, detokenize, stop.

:class:`EngineCore` is synchronous and single-threaded; the offline :class:`~hybridserve.LLM`
drives it to completion and the server drives it from one background task. Every
public method either succeeds or raises ``ValueError`` naming the field, changing
nothing: a bad request never disturbs the others.

Failures: if the forward of a step raises, nothing is committed, the step's pages are
given back and :meth:`EngineCore.step` raises (every request keeps its caches and runs
again next step). A step's prefill rows are committed once its launches are queued,
while the device computes; if the read-back after that raises (a device fault), those
rows' groups fail, every cached prefix is dropped, and the step raises. If committing a
step raises for one request (appending its tokens, its stop checks, its page
bookkeeping, detokenizing its output), that request's whole group fails alone: its
caches and the step's pages of its rows are freed, it is reported finished with reason
``"error"`` (:attr:`RequestOutput.error` says why), and the step commits every other
request as usual.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.cache.host_tier import HostStatePool, Transfers, host_pages_for
from hybridserve.config import EngineConfig
from hybridserve.detokenizer import IncrementalDetokenizer
from hybridserve.drafters.base import DraftRequest, build_drafter
from hybridserve.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from hybridserve.engine.scheduler import ScheduledRow, Scheduler, SchedulerOutput
from hybridserve.engine.stats import AdmittedStats, FinishedStats, StatsObserver, StepStats
from hybridserve.runner.model_runner import ModelRunner, PendingStep
from hybridserve.step import PostprocessDecision, RowResult, StepResult
from hybridserve.tokenizer import Tokenizer

log = logging.getLogger("hybridserve.engine")

# A finished request's CompletionOutput.finish_reason (None while it runs or waits).
_FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def prefill_flops(model: torch.nn.Module):
    """``length -> FLOPs`` of prefilling that many tokens: 2 per active weight per token
    (a mixture of experts counts the experts a token reaches), plus attention's score and
    value products, quadratic in the length."""
    weights = model.num_active_weights()
    mc = model.config
    attn_layers = sum(1 for kind in mc.layer_types if kind == "attention")
    width = mc.attention.num_heads * mc.attention.head_dim if mc.attention else 0

    def flops(length: int) -> float:
        return 2.0 * weights * length + 2.0 * attn_layers * width * length * length

    return flops


def _valid_token_ids(token_ids: list[int], vocab_size: int) -> bool:
    """Whether every one of ``token_ids`` is an ``int`` (a bool is one) in ``[0, vocab_size)``.

    One pass per distinct type, then the range in one pass through numpy: a long
    prompt's check costs no per-token Python (the same rule as checking every token's
    type and range; ``min`` and ``max`` would take two passes, each slower).
    """
    if not all(issubclass(t, int) for t in set(map(type, token_ids))):
        return False
    try:
        ids = np.fromiter(token_ids, np.int64, len(token_ids))
    except OverflowError:  # beyond int64, so beyond any vocabulary
        return False
    return bool(ids.min() >= 0 and ids.max() < vocab_size)


@dataclass
class _Group:
    """The ``n`` sequences of one user request, reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    # Report only the finished output (the offline API's mode): no per-step outputs,
    # which cost host time per request per step and copy the growing token list.
    final_only: bool = False
    # Set when committing a step for one of the children raised: the group failed.
    error: str | None = None
    # The prefix hit the caches held for the prompt when it arrived (Scheduler.predict_hit).
    predicted_cached_tokens: int = 0


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        enforce_eager: bool | None = None,
        async_scheduling: bool | None = None,
        tensor_group=None,
        tensor_workers=(),
    ) -> None:
        """``enforce_eager``: True runs every step eagerly; False replays greedy decode
        and verify steps from CUDA graphs (on a CPU: the same static-buffer step,
        eagerly); None (the default) means False on CUDA and True elsewhere.

        ``async_scheduling``: schedule and launch the next plain decode step before the
        current one's tokens are read back, so the host's work for a step overlaps the
        device's work on the step before (:meth:`step`). Needs decode graphs and no
        speculative decoding; None (the default) turns it on wherever both hold.

        ``tensor_group``: the :class:`~hybridserve.distributed.group.TensorGroup` of a
        tensor-parallel engine (this process is rank 0; ``model`` is its shard and
        ``tensor_workers`` the processes of the other ranks): the runner broadcasts every
        step to them (:mod:`hybridserve.distributed.runner`); steps run eagerly."""
        policy = getattr(model, "kernel_policy", config.kernels)
        if policy != config.kernels:
            raise ValueError(
                "config.kernels differs from the model's kernel_policy: load the model with "
                "load_model(..., policy=config.kernels)"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        cc = config.cache
        page_bytes = model.cache_spec.state_page_bytes(config.dtype, cc.ssm_state_dtype)
        host_pages = host_pages_for(cc, page_bytes)
        self.scheduler = Scheduler(config.scheduler, config.cache, prefill_flops(model), host_pages)
        if enforce_eager is None:
            enforce_eager = torch.device(config.device).type != "cuda"
        # Decode graphs pad steps with rows that write one KV block and read one state
        # page past the ranges the pools hand out.
        scratch = 0 if enforce_eager else 1
        if tensor_group is not None and not enforce_eager:
            raise ValueError("enforce_eager=False (decode graphs) does not run under "
                             "tensor_parallel_size > 1 yet; leave it unset")
        sizes = dict(
            num_kv_blocks=cc.num_kv_blocks + scratch, kv_block_size=cc.kv_block_size,
            num_state_pages=cc.num_state_pages + scratch, dtype=config.dtype,
            ssm_dtype=cc.ssm_state_dtype,
        )
        caches = model.cache_spec.allocate(**sizes, device=config.device)
        # The runner launches the state postprocess as soon as a step's choices exist on
        # the device; its decisions come back with the choices, in the step's result.
        runner_args = (model, caches, cc.kv_block_size, config.scheduler.max_num_seqs,
                       config.device)
        if tensor_group is None:
            self.runner = ModelRunner(
                *runner_args, boundary_interval=self.scheduler.boundary_interval()
            )
        else:
            from hybridserve.distributed.runner import TensorParallelRunner

            self.runner = TensorParallelRunner(
                *runner_args, boundary_interval=self.scheduler.boundary_interval(),
                group=tensor_group, workers=tensor_workers, allocate=sizes,
                host_pages=host_pages if self.scheduler.host.enabled else 0,
            )
        if self.scheduler.host.enabled:
            # The host tier mirrors every state tensor of every recurrent layer.
            self.runner.host_pool = HostStatePool(caches.states, host_pages)
        self.drafter = build_drafter(config, model)
        max_blocks = -(-config.scheduler.max_model_len // cc.kv_block_size)
        # A drafter with caches of its own replays its uniform steps from graphs of its
        # own (hybridserve.runner.draft_graphs) wherever the target may, as the policy's
        # drafter_graphs allows ("auto" is "on").
        drafter_graphs = policy.drafter_graphs != "off"
        enable_drafter_graphs = getattr(self.drafter, "enable_graphs", None)
        if enable_drafter_graphs is not None and not enforce_eager and drafter_graphs:
            enable_drafter_graphs(max_blocks, config.scheduler.max_num_seqs)
        # A drafter that reads the target's hidden states (MTP) gets them from eager and
        # decode-graph steps alike (short-row steps then run eagerly); without drafter
        # graphs the target's steps run eagerly beside it.
        self._observe = getattr(self.drafter, "observe", None)
        if self._observe is not None:
            self.runner.keep_hidden = True
            if not drafter_graphs:
                enforce_eager = True
        if not enforce_eager:
            # A drafter that samples drafts from a distribution of its own (draft model,
            # MTP head: it keeps their log q) gets the graphs' static log q buffer, so
            # sampled verify steps of its drafts replay too; n-gram drafts need none.
            distributions = (hasattr(self.drafter, "draft_logq")
                             and policy.logq_graphs != "off")
            self.runner.enable_decode_graphs(
                max_blocks=max_blocks,
                scratch_block=cc.num_kv_blocks,
                scratch_page=cc.num_state_pages,
                draft_distributions=(
                    config.speculative.num_speculative_tokens if distributions else 0
                ),
            )
        if async_scheduling is None:
            async_scheduling = not enforce_eager and self.drafter is None
        if async_scheduling and (enforce_eager or self.drafter is not None):
            raise ValueError("async_scheduling needs decode graphs and no speculative decoding")
        self.async_scheduling = async_scheduling
        # The step launched ahead and not yet read back, with its schedule.
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None
        self.groups: dict[str, _Group] = {}
        self._arrival = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.counters = {
            "requests_finished": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "steps": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verify_rows": 0,
            "spec_drafter_seconds": 0.0,
            # Prompt tokens the caches held for requests when they were added (per
            # request, not per child; Scheduler.predict_hit): set against prefix_hit_tokens.
            "prefix_predicted_hit_tokens": 0,
        }
        self.check_integrity_every_step = False
        # Gets one StepStats per step (hybridserve.engine.stats); None records nothing.
        self.stats_observer: StatsObserver | None = None
        self._step_stats: StepStats | None = None
        self._grammars = None  # the GrammarBackend, built on the first constrained request

    def grammar_backend(self):
        """The engine's :class:`~hybridserve.structured.backend.GrammarBackend` (built on
        first use). Raises ValueError when the model has no tokenizer."""
        if self._grammars is None:
            from hybridserve.structured.backend import GrammarBackend

            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer.json")
            self._grammars = GrammarBackend(self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    # ---- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError (changing nothing) on invalid input.

        ``final_only``: :meth:`step` reports the request once, when it finishes (as
        vLLM's offline ``generate`` does), instead of after every step it advances.
        """
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling params must be a SamplingParams")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token (or non-empty text)")
        if not _valid_token_ids(prompt_token_ids, self.vocab_size):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_len}: "
                "shorten the prompt or raise max_model_len (the model must have room to generate)"
            )
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"allowed_token_ids must be token ids in [0, {self.vocab_size})")
        if params.logit_bias is not None and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias must name token ids in [0, {self.vocab_size})")
        so = params.structured_outputs
        if so is not None:
            # Compiling is what can fail on the user's input: before anything is queued.
            self.grammar_backend().compile(so)
        arrival = next(self._arrival)
        arrival_time = time.monotonic()
        children = []
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed * 1009 + i
            else:
                seed = self._seed_rng.getrandbits(62)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    arrival=arrival,
                    eos_token_ids=self.eos_token_ids,
                    max_model_len=max_len,
                    sample_seed=seed,
                    parent_id=request_id if params.n > 1 else None,
                    grammar=None if so is None or so.after_token_ids else self._grammars.matcher(so),
                    pending_grammar=self._grammars.matcher(so) if so is not None and so.after_token_ids else None,
                    arrival_time=arrival_time,
                )
            )
        group = _Group(request_id, prompt, list(prompt_token_ids), children, final_only=final_only,
                       predicted_cached_tokens=self.scheduler.predict_hit(children[0]))
        self.groups[request_id] = group
        for child in children:
            self.scheduler.add(child)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        self.counters["prefix_predicted_hit_tokens"] += group.predicted_cached_tokens

    def predicted_cached_tokens(self, request_id: str) -> int:
        """The prefix hit the caches held for request ``request_id``'s prompt when it
        was added (what its ``num_cached_tokens`` will be unless the caches change
        before it is admitted); KeyError once it has finished."""
        return self.groups[request_id].predicted_cached_tokens

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its caches. Returns False if it is unknown."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for child in group.children:
            if not child.status.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            if self.drafter is not None:
                self.drafter.forget(child.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of every request that advanced or finished.

        With a ``stats_observer``, the step's :class:`~hybridserve.engine.stats.StepStats`
        go to it once the step is committed (also when the step raised: what was
        recorded before the failure).

        With async scheduling, a plain decode step is launched, then the step after it
        is scheduled and launched (:meth:`_launch_ahead`) before the first one's tokens
        are read back and committed; the second stays in flight and the next call
        starts from it. Its rows of requests that finish meanwhile (a stop token, an
        abort) are dropped when it is read back.
        """
        if self.stats_observer is None:
            return self._step()
        self._step_stats = StepStats()
        try:
            return self._step()
        finally:
            stats, self._step_stats = self._step_stats, None
            if stats:
                self.stats_observer.on_step(stats)

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            sched, pending = self._inflight
            self._inflight = None
            return self._advance(sched, pending)
        if self.drafter is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if self._step_stats is not None:
            self._stamp_scheduled(sched)
        if not sched.rows:
            if sched.transfers:
                # Only host-tier copies this step (a restore the waiting head needs).
                self._guarded(sched, lambda: self.runner.run_transfers(sched))
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                # The oldest waiting request cannot fit even in an empty engine.
                req = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"request {req.request_id} needs more KV blocks or state pages than the "
                    "engine has; raise num_kv_blocks / num_state_pages or lower max_model_len"
                )
            return []
        self.counters["steps"] += 1
        self._check_integrity(sched)
        if self.async_scheduling and sched.plain_decode:
            pending = self._guarded(sched, lambda: self.runner.launch(sched))
            if pending is not None:
                return self._advance(sched, pending)
        # The prefill rows' commit needs none of the step's results: it runs while the
        # device computes (their blocks and checkpoints are only read by later steps,
        # which the device runs after this one).
        failed: dict[str, Exception] = {}
        early: list[ScheduledRow] = []
        try:
            results = self._guarded(sched, lambda: self.runner.execute(
                sched, lambda: self._commit_prefill_rows(sched, failed, early)))
        except BaseException as exc:
            self._undo_early_commits(sched, early, exc)
            raise
        outputs = self._process(sched, results, failed)
        self._check_integrity()
        return outputs

    def _commit_prefill_rows(
        self, sched: SchedulerOutput, failed: dict[str, Exception], committed: list[ScheduledRow]
    ) -> None:
        """Commit ``sched``'s prefill rows (their state pages, checkpoints and full
        blocks) before its read-back, listing them in ``committed``; a row whose commit
        raises records its group in ``failed`` (:meth:`_process` fails it) and the rest
        commit."""
        for row in sched.rows:
            if row.is_decode:
                continue
            req = row.request
            gid = req.parent_id or req.request_id
            if gid in failed:
                continue
            try:
                self.scheduler.commit_prefill_row(row)
                committed.append(row)
            except Exception as e:
                failed[gid] = e

    def _undo_early_commits(
        self, sched: SchedulerOutput, committed: list[ScheduledRow], exc: BaseException
    ) -> None:
        """The step raised after its prefill rows were committed (its read-back: a device
        fault): their blocks and checkpoints may hold what the device never wrote. Their
        groups fail and every cached prefix is dropped, so no later step reads them."""
        if not committed:
            return
        error = exc if isinstance(exc, Exception) else RuntimeError(type(exc).__name__)
        for gid in dict.fromkeys(self.group_id(row.request) for row in committed):
            self._fail(gid, error, sched)
        self.scheduler.clear_prefix_cache()

    def _stamp_scheduled(self, sched: SchedulerOutput) -> None:
        """Record the first scheduling of the step's sequences (their queue time ends)."""
        stats = self._step_stats
        now = time.monotonic()
        for row in sched.rows:
            req = row.request
            if req.scheduled_time < 0:
                req.scheduled_time = now
                stats.admitted.append(
                    AdmittedStats(
                        queue_seconds=now - req.arrival_time,
                        prompt_tokens=req.num_prompt_tokens,
                        cached_tokens=req.num_cached_tokens,
                        kv_cached_tokens=req.kv_prefix_tokens,
                    )
                )

    def _stamp_tokens(self, req: Request, now: float) -> None:
        """``req`` got tokens in the step being committed (at ``now``)."""
        if req.first_token_time < 0:
            req.first_token_time = now
            self._step_stats.time_to_first_token.append(now - req.arrival_time)
        else:
            self._step_stats.inter_token_latency.append(now - req.last_token_time)
        req.last_token_time = now

    def _stamp_finished(self, req: Request, reason: str) -> None:
        first = req.first_token_time if req.first_token_time >= 0 else req.last_token_time
        scheduled = req.scheduled_time if req.scheduled_time >= 0 else req.arrival_time
        self._step_stats.finished.append(
            FinishedStats(
                finish_reason=reason,
                e2e_seconds=time.monotonic() - req.arrival_time,
                queue_seconds=scheduled - req.arrival_time,
                prefill_seconds=max(first - scheduled, 0.0),
                decode_seconds=max(req.last_token_time - first, 0.0),
                prompt_tokens=req.num_prompt_tokens,
                generation_tokens=len(req.output_token_ids),
                max_tokens=req.params.max_tokens,
                n=req.params.n,
            )
        )

    def _guarded(self, sched: SchedulerOutput, run):
        try:
            return run()
        except BaseException:
            # Nothing was committed: give back the pages this step was to write. The
            # requests keep their caches and are scheduled again by the next step.
            for row in sched.rows:
                self.scheduler.release_row(row)
            if sched.transfers:
                # The host-tier copies did not (all) happen: forget what they carried.
                self.scheduler.abandon_transfers(sched.transfers)
                sched.transfers = Transfers()
            raise

    def _advance(self, sched: SchedulerOutput, pending: PendingStep) -> list[RequestOutput]:
        """Launch the step after ``sched`` (in flight as ``pending``) if it can go ahead,
        then read back and commit ``sched``."""
        if pending.deferred is not None:
            # Its draw was not queued after the step before (that commit raised): now.
            self._guarded(sched, lambda: self.runner.draw(pending))
        self._inflight = self._launch_ahead(sched, pending)
        results = self._guarded(sched, lambda: self.runner.collect(pending))
        outputs = self._process(sched, results)
        self._draw_inflight()
        self._check_integrity()
        return outputs

    def _draw_inflight(self) -> None:
        """Queue the draw of the step in flight where it waits (a step with constrained
        rows launched ahead: its masks need the tokens just committed). The device runs
        that step's forward meanwhile, so the masks are filled while it computes."""
        if self._inflight is None or self._inflight[1].deferred is None:
            return
        nxt, launched = self._inflight
        try:
            self._guarded(nxt, lambda: self.runner.draw(launched))
        except BaseException:
            self._inflight = None
            raise

    def _launch_ahead(
        self, sched: SchedulerOutput, pending: PendingStep
    ) -> tuple[SchedulerOutput, PendingStep] | None:
        """Schedule and launch the plain decode step after ``sched`` before its tokens
        are on the host, or None: when a waiting request could take a seat (it is
        admitted by an ordinary step), when a row is not plain decode, or when the caches
        or the graphs cannot take it. A request that ``sched`` surely finishes (its
        length cap) gets no row.

        Waiting requests with every seat taken (a saturated engine) do not stop it: the
        next ordinary step could not admit them either, unless ``sched`` frees a seat. A
        length cap frees one knowably, so a step with such a row and requests waiting
        is not launched ahead; a stop token frees one only once read back, so the
        request it makes room for is admitted a step later than step by step would.
        A step with constrained rows goes ahead as its forward only: the masks of its
        draw follow the tokens still on the device, so the draw runs once ``sched`` is
        committed (:meth:`_draw_inflight`)."""
        if not sched.plain_decode or (self.scheduler.waiting and self.scheduler.free_seats):
            return None
        rows, sources = [], []
        running = RequestStatus.RUNNING
        for i, row in enumerate(sched.rows):
            req = row.request
            # The request's output count and length once this row's token is in.
            after = row.ahead + 1
            if (
                req.status is running
                and len(req.output_token_ids) + after < self._max_tokens(req)
                and len(req.all_token_ids) + after < req.max_model_len
            ):
                rows.append(row)
                sources.append(i)
        if not rows or (self.scheduler.waiting and len(rows) < len(sched.rows)):
            return None
        nxt = self.scheduler.schedule_ahead(rows)
        if nxt is None:
            return None
        self._check_integrity(nxt, in_flight=sched)
        launched = self._guarded(nxt, lambda: self.runner.launch(nxt, pending, sources))
        if launched is None:
            for row in nxt.rows:
                self.scheduler.drop_ahead_row(row)
            return None
        self.counters["steps"] += 1
        return nxt, launched

    def _process(
        self, sched: SchedulerOutput, step: StepResult, failed: dict[str, Exception] | None = None
    ) -> list[RequestOutput]:
        """Commit a step that ran: its tokens, state pages, finished requests; outputs.

        A request whose commit raises fails with its group (:meth:`_fail`); the others
        are committed as if it had not been in the step. Prefill rows committed during
        the step (:meth:`_commit_prefill_rows`) are not committed again; ``failed``
        holds the groups whose commit raised there.
        """
        results = step.rows
        # One clock read per step for the statistics: the step's commit time.
        committed = time.monotonic() if self._step_stats is not None else 0.0
        touched: dict[str, _Group] = {}
        failed = {} if failed is None else failed
        dropped: set[int] = set()
        groups = self.groups
        stats = self._step_stats
        for row, res in zip(sched.rows, results):
            req = row.request
            if row.ahead and req.status is not RequestStatus.RUNNING:
                # Launched ahead for a request that has finished since: drop its result.
                self.scheduler.drop_ahead_row(row)
                dropped.add(id(row))
                continue
            gid = req.parent_id or req.request_id  # group_id(), inline: once per row
            if gid in failed:
                continue
            try:
                if res.new_tokens:
                    self._append_tokens(req, res.new_tokens, res.logprobs)
                    if stats is not None:
                        self._stamp_tokens(req, committed)
                if res.prompt_logprobs:
                    self._store_prompt_logprobs(req, row.num_computed, res.prompt_logprobs)
                if not row.is_decode and not row.settled:
                    self.scheduler.commit_prefill_row(row)
            except Exception as e:
                failed[gid] = e
                continue
            group = groups.get(gid)
            if group is not None:
                touched[group.request_id] = group
        decisions = step.decisions
        decode_rows = [
            (row, res, decisions.get(i))
            for i, (row, res) in enumerate(zip(sched.rows, results)) if row.is_decode
        ]
        if decode_rows:
            # Nothing failed (the usual step): the dropped rows are all there is to skip.
            skip = dropped | {
                id(row) for row, _, _ in decode_rows if self.group_id(row.request) in failed
            } if failed else dropped
            try:
                self._commit_postprocess(decode_rows, skip, failed)
            except Exception as e:
                for row, _, _ in decode_rows:
                    if id(row) not in skip:
                        failed.setdefault(self.group_id(row.request), e)
        if self._observe is not None:
            self._hand_over_hidden(sched, results, dropped)
        running = RequestStatus.RUNNING
        for row in sched.rows:
            req = row.request
            if req.status is not running:
                continue  # finished already (or dropped): nothing to finish
            if (dropped or failed) and (id(row) in dropped or self.group_id(req) in failed):
                continue
            try:
                if req.stopped:
                    self._finish(req)
                elif self._length_capped(req):
                    self._finish(req, length=True)
            except Exception as e:
                failed[self.group_id(req)] = e
        for gid, exc in failed.items():
            group = self._fail(gid, exc, sched)
            if group is not None:
                touched[gid] = group
        outputs = []
        for g in touched.values():
            if g.final_only and not (
                g.children[0].status.finished if len(g.children) == 1
                else all(r.status.finished for r in g.children)
            ):
                continue
            try:
                outputs.append(self._make_output(g))
            except Exception as e:  # detokenizing its text raised: the group fails
                if g.error is None:
                    self._fail(g.request_id, e, sched)
                outputs.append(self._make_output(g))
        if failed or any(g.error is not None for g in touched.values()):
            # The failures were cleaned up: prove it before going on.
            held = []
            if self._inflight is not None:
                held = [p for row in self._inflight[0].rows for p in row.state_outputs.values()]
            self.scheduler.check_integrity(held)
        return outputs

    def _fail(self, gid: str, exc: Exception, sched: SchedulerOutput) -> _Group | None:
        """End group ``gid`` with an error: every child finishes (reason ``"error"``) and
        frees its caches, and the step's pages of its rows that no commit took are
        given back. Returns the group (None if it is gone)."""
        group = self.groups.get(gid)
        log.error(
            "request %s failed while its step was committed (%s: %s)",
            gid, type(exc).__name__, exc, exc_info=exc,
        )
        for row in sched.rows:
            if self.group_id(row.request) == gid:
                self.scheduler.release_row(row)
        if group is None:
            return None
        group.error = f"{type(exc).__name__}: {exc}"
        for child in group.children:
            # A child whose own finish raised may be marked finished and still hold caches.
            holds = child.block_ids or child.state_page >= 0 or child.boundary_page >= 0
            if not child.status.finished or holds or child.seat >= 0:
                self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
            if self.drafter is not None:
                self.drafter.forget(child.request_id)
        return group

    def _hand_over_hidden(self, sched: SchedulerOutput, results: list, dropped: set[int]) -> None:
        """Give the drafter the target's hidden states of the positions this step
        computed on true tokens: a prefill chunk's all, a verify row's accepted ones."""
        hidden = self.runner.last_hidden
        self.runner.last_hidden = None
        if hidden is None:
            return
        start = 0
        for row, res in zip(sched.rows, results):
            valid = len(res.new_tokens) if row.is_decode else row.num_tokens
            if id(row) not in dropped and row.request.status is RequestStatus.RUNNING:
                self._observe(row.request.request_id, row.num_computed, hidden[start : start + valid])
            start += row.num_tokens

    def _check_integrity(
        self, sched: SchedulerOutput | None = None, in_flight: SchedulerOutput | None = None
    ) -> None:
        """With ``check_integrity_every_step``: every cache reference (after a step's
        commit, or once ``sched`` is scheduled), and the KV blocks each row of ``sched``
        is about to write. ``in_flight``: the launched, uncommitted step whose pages are
        held too (by default the one launched ahead, if any)."""
        if self.check_integrity_every_step:
            if in_flight is None and self._inflight is not None:
                in_flight = self._inflight[0]
            steps = [s for s in (sched, in_flight) if s is not None]
            held = [p for s in steps for row in s.rows for p in row.state_outputs.values()]
            self.scheduler.check_integrity(held, sched.rows if sched is not None else [])
            check_drafter = getattr(self.drafter, "check_integrity", None)
            if check_drafter is not None:
                check_drafter()

    def _commit_postprocess(
        self,
        rows: list[tuple[ScheduledRow, RowResult, PostprocessDecision | None]],
        dropped: set[int],
        failed: dict[str, Exception],
    ) -> None:
        """The host's page bookkeeping from the postprocess decisions of this step (the
        runner decided them on the device, from the step's choices, and returned them in
        its result). The accepted counts the device decided with must equal the tokens
        the host appended: a mismatch is a bug, and fails the row before any of its pages
        changes hands. Rows in ``dropped`` (ids of rows whose result was dropped or whose
        request failed) change nothing. A row that cannot be committed has its exception
        recorded in ``failed`` under its group's id; the others commit.
        """
        for row, res, d in rows:
            if id(row) in dropped:
                continue
            try:
                if d is None:
                    raise RuntimeError(
                        f"request {row.request.request_id}: a decode row came back without "
                        "a postprocess decision"
                    )
                if d.num_accepted != len(res.new_tokens):
                    raise RuntimeError(
                        f"request {row.request.request_id}: the device accepted "
                        f"{d.num_accepted} tokens, the host {len(res.new_tokens)}"
                    )
                self.scheduler.commit_decode_row(
                    row, d.num_accepted, d.state_page, d.checkpoints, d.released
                )
            except Exception as e:
                failed[self.group_id(row.request)] = e

    def _propose_drafts(self) -> None:
        d = self.config.speculative.num_speculative_tokens
        decoding, asks = [], []
        for req in self.scheduler.running:
            req.draft_token_ids = []
            if req.is_prefill:
                continue
            room = min(
                d,
                self._max_tokens(req) - len(req.output_token_ids) - 1,
                req.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                decoding.append(req)
                temperature = 0.0 if req.params.greedy else req.params.temperature
                asks.append(DraftRequest(req.request_id, req.all_token_ids, room, temperature,
                                         req.sample_seed, len(req.output_token_ids)))
        started = time.perf_counter()
        proposals = self.drafter.propose_batch(asks) if asks else []
        # Host wall time of drafting (on CUDA the drafter's forwards are mostly
        # synchronous: its argmax is read back for the next draft).
        self.counters["spec_drafter_seconds"] += time.perf_counter() - started
        # Drafts sampled from the drafter's own distribution travel with it to the sampler.
        self.runner.draft_logq = getattr(self.drafter, "draft_logq", {})
        for req, drafts in zip(decoding, proposals):
            if drafts and req.grammar is not None:
                # A draft the grammar rejects could never be emitted: the run the
                # verifier may accept ends before it.
                drafts = drafts[: req.grammar.valid_prefix(drafts)]
            elif drafts and req.pending_grammar is not None:
                # No position may follow the token that starts the grammar within one
                # row (its mask would be needed before the row exists): the drafts end
                # before the token that would complete the grammar's start tag.
                drafts = drafts[: self._before_grammar_start(req, drafts)]
            req.draft_token_ids = drafts

    @staticmethod
    def _before_grammar_start(req: Request, drafts: list[int]) -> int:
        """How many of ``drafts`` can be verified in one row while ``req``'s grammar
        waits for its start tag: all of them before the one completing the tag."""
        tag = req.params.structured_outputs.after_token_ids
        seq = req.output_token_ids[-len(tag):] if len(tag) > 1 else []
        for j, t in enumerate(drafts):
            seq = (seq + [t])[-len(tag):]
            if tuple(seq) == tag:
                return j
        return len(drafts)

    def _max_tokens(self, req: Request) -> int:
        mt = req.params.max_tokens
        return mt if mt is not None else req.max_model_len

    def _length_capped(self, req: Request) -> bool:
        # _max_tokens() inline: asked for every row of every step.
        mt = req.params.max_tokens
        if mt is None:
            mt = req.max_model_len
        return len(req.output_token_ids) >= mt or len(req.all_token_ids) >= req.max_model_len

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list) -> None:
        p = req.params
        if req.draft_token_ids:
            accepted = len(tokens) - 1
            req.spec_draft_tokens += len(req.draft_token_ids)
            req.spec_accepted_tokens += accepted
            req.spec_steps += 1
            self.counters["spec_draft_tokens"] += len(req.draft_token_ids)
            self.counters["spec_accepted_tokens"] += accepted
            self.counters["spec_verify_rows"] += 1
        req.draft_token_ids = []
        for i, tok in enumerate(tokens):
            req.append_output(tok)
            if req.grammar is not None:
                req.grammar.accept(tok)
            elif req.pending_grammar is not None:
                tag = p.structured_outputs.after_token_ids
                if tuple(req.output_token_ids[-len(tag):]) == tag:
                    # The grammar applies from the next token on.
                    req.grammar, req.pending_grammar = req.pending_grammar, None
            if logprobs:
                req.logprobs.append(logprobs[i])
            self.counters["generation_tokens"] += 1
            if not p.ignore_eos and tok in req.eos_token_ids:
                self._mark_stop(req, None)
                break
            if p.stop_token_ids and tok in p.stop_token_ids:
                self._mark_stop(req, tok)
                break
            if (
                p.stop
                and self.tokenizer is not None
                and len(req.output_token_ids) >= p.min_tokens
                and self._check_stop_strings(req)
            ):
                break
            if self._length_capped(req):
                break

    @staticmethod
    def _store_prompt_logprobs(req: Request, n: int, lps: list) -> None:
        """A prefill row from position ``n`` computed the logprobs of prompt tokens
        ``n + 1 ...`` (a recompute after preemption writes the same entries again)."""
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        req.prompt_logprobs[n + 1 : n + 1 + len(lps)] = lps

    def _mark_stop(self, req: Request, reason: int | str | None) -> None:
        """Finish ``req`` after this step; ``reason`` is the stop string or token id that
        ended it (None for EOS), reported as ``stop_reason`` as vLLM does."""
        req.stopped = True
        req.stop_reason = reason

    def _output_text(self, req: Request) -> str:
        if req.detokenizer is None:
            p = req.params
            # EOS and stop tokens' text never shows, even when a parser's tag is one.
            keep = p.keep_special_token_ids - set(req.eos_token_ids) - set(p.stop_token_ids or ())
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, keep)
        return req.detokenizer.text(req.output_token_ids)

    def _check_stop_strings(self, req: Request) -> bool:
        text = self._output_text(req)
        for s in req.params.stop:
            if s in text:
                self._mark_stop(req, s)
                return True
        return False

    def _finish(self, req: Request, length: bool = False) -> None:
        status = RequestStatus.FINISHED_LENGTH if length else RequestStatus.FINISHED_STOPPED
        self.scheduler.finish(req, status)
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
        self.counters["requests_finished"] += 1
        if self._step_stats is not None:
            self._stamp_finished(req, status.value)

    # ---- outputs -----------------------------------------------------------------

    @staticmethod
    def group_id(req: Request) -> str:
        """The user-facing request id of an engine request (``n > 1`` fans out)."""
        return req.parent_id or req.request_id

    def _decode(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self._output_text(req)
        reason = req.stop_reason
        if isinstance(reason, str) and reason in text:
            cut = text.index(reason)
            text = text[: cut + len(reason)] if req.params.include_stop_str_in_output else text[:cut]
        return text

    def _make_output(self, group: _Group) -> RequestOutput:
        # Built for every request on every step it advances (a server's streaming
        # mode): one pass over the children, the finish reason by lookup.
        children = group.children
        outs = []
        for i, req in enumerate(children):
            if req.params.logprobs is not None:
                logprobs = list(req.logprobs)
                cum = sum(lp[t].logprob for lp, t in zip(req.logprobs, req.output_token_ids)) if logprobs else None
            else:
                logprobs = cum = None
            outs.append(
                CompletionOutput(
                    index=i,
                    # A failed group's text is not decoded: decoding may be what failed.
                    text=self._decode(req) if group.error is None else "",
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=cum,
                    logprobs=logprobs,
                    finish_reason=_FINISH_REASONS.get(req.status),
                    stop_reason=req.stop_reason,
                )
            )
        first = children[0]
        if len(children) == 1:
            finished = first.status.finished
            drafts, accepted = first.spec_draft_tokens, first.spec_accepted_tokens
            verify_steps, preemptions = first.spec_steps, first.num_preemptions
        else:
            finished = all(r.status.finished for r in children)
            drafts = sum(r.spec_draft_tokens for r in children)
            accepted = sum(r.spec_accepted_tokens for r in children)
            verify_steps = sum(r.spec_steps for r in children)
            preemptions = sum(r.num_preemptions for r in children)
        metrics = {
            "spec_draft_tokens": drafts,
            "spec_accepted_tokens": accepted,
            "spec_mean_accepted_length": 1.0 + accepted / verify_steps if verify_steps else 0.0,
            "num_preemptions": preemptions,
            "predicted_cached_tokens": group.predicted_cached_tokens,
        }
        if finished:
            self.groups.pop(group.request_id, None)
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None:
            # Every child computes the same prompt; the first one's entries are reported.
            # Before its prefill is done the list has holes (None) past position 0.
            prompt_logprobs = list(first.prompt_logprobs or [None] * first.num_prompt_tokens)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
            error=group.error,
        )

    # ---- statistics --------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Engine counters: requests, tokens, prefix cache and speculative decoding."""
        s = self.scheduler
        c = dict(self.counters)
        c.update(s.counters)
        q = c["prefix_query_tokens"]
        c["prefix_hit_rate"] = c["prefix_hit_tokens"] / q if q else 0.0
        c["checkpoint_pages"] = len(s.states.checkpoints)
        c["checkpoints_admitted"] = s.states.num_admitted
        c["checkpoints_evicted"] = s.states.num_evicted
        c["checkpoints_dropped"] = s.states.num_dropped
        c["host_checkpoint_pages"] = len(s.host.checkpoints)
        c["host_checkpoint_pages_total"] = s.host.num_pages
        c["host_checkpoints_offloaded"] = s.host.num_offloaded
        c["host_checkpoints_restored"] = s.host.num_restored
        c["host_checkpoints_evicted"] = s.host.num_evicted
        c["host_checkpoints_dropped"] = s.host.num_dropped
        c["kv_blocks_free"] = s.blocks.num_free
        c["kv_blocks_total"] = s.blocks.num_blocks
        c["state_pages_free"] = s.states.num_free
        c["state_pages_total"] = s.states.num_pages
        c["requests_running"] = len(s.running)
        c["requests_waiting"] = len(s.waiting)
        rows = c["spec_verify_rows"]
        c["spec_mean_accepted_length"] = (
            1.0 + c["spec_accepted_tokens"] / rows if rows else 0.0
        )
        return c
