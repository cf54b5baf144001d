"""CUDA-graph replay of decode and verify steps.

A decode step of the fast path launches about a thousand small kernels; at batch 16-64
on an H200 their launch costs dominate the step. This module captures the whole step
(the model forward, the logits and the draw) once per shape and replays it.

Which steps (:meth:`DecodeGraphs.shape_of`): decode and verify rows (``1 + d`` tokens for a
row carrying ``d`` drafts; the step runs the longest row's count ``q`` and pads the
shorter rows, see :meth:`DecodeGraphs.fill`), every row continuing from a stored state
page and writing its states to pages that are not input pages, no row asking for
penalties or logprobs (their inputs and outputs change size from step to step), and at
most the largest batch bucket of rows. Greedy rows take the argmax; sampled rows
(temperature, top-k, top-p, min-p, seeds) draw inside the graph with the batched
sampler's counter-based stream, so a replayed step draws exactly the tokens an eager
step would. Anything else (prefill, steps mixing prefill and decode, penalties,
biases, logprobs, too many rows, a context longer than the block tables' width) returns
None and the runner runs the step eagerly.

Verify steps with a drafter's distributions (sampled rows whose drafts a draft model or
an MTP head sampled from its own ``q``: the runner hands each row's ``log q``, or None,
to :meth:`DecodeGraphs.replay`): the key's :class:`Sampling` says ``drafted`` (never
which rows), the row's draft flags ride in its static buffer line (``_Static.flags``),
their ``log q`` in the graphs' one static ``log q`` buffer
(:meth:`DecodeGraphs.enable_draft_distributions`: float32, ``[max_batch * k, vocab]``,
allocated only when the engine's drafter produces distributions), and the draw runs
:func:`~hybridserve.runner.sampler.speculative_choices` over every draft slot of the
shape, keeping it where the flag is set and the point-mass draw everywhere else: point-mass
drafts (n-gram, or any row whose ``log q`` the runner did not hand over), greedy rows,
a row's padding slots and padding rows. Every op of that test is row by row, so a
flagged slot gives the eager sampler's token, and the step the eager step's tokens and
acceptance. Without the buffer such steps run eagerly.

Masked steps (rows with a grammar, ``allowed_token_ids`` or ``min_tokens``): the key's
:class:`Sampling` says the step masks (never which rows do), and the step is two
graphs, the forward and the logits, then the masks and the draw. Every position's mask
(int32 bitmask words) goes into a static mask buffer, all ones for rows that mask
nothing and for padding; the draw sets the excluded tokens to ``-inf`` first, which is
what the eager sampler does to its masked positions, so the tokens are the eager
step's. The host replays the forward, then fills the masks (the matchers' work, which
on CUDA runs while the device computes the forward), then replays the draw
(:meth:`DecodeGraphs.draw`). A masked step scheduled ahead (async scheduling) returns
after its forward with a :class:`DeferredDraw`: its masks follow tokens still on the
device, and its draw runs once the step before is committed.

Shapes: a graph is keyed by ``(B, q, W)`` and, for steps that sample, the draw's needs
(:class:`Sampling`: top-k rounded up to a power of two, whether top-p / min-p apply):
``B`` the batch bucket (the smallest of
:data:`BATCH_BUCKETS` holding the step's rows), ``W`` the block-table width bucket
(:func:`blocks_bucket` of the longest row's block count). The attention of a replayed
step reads ``W * kv_block_size`` key positions per row (masked by position), so ``W``
buckets are powers of two up to 32 blocks, then multiples of 16. Graphs are captured
lazily, on the first step of each key, into one shared memory pool.

Static inputs: per ``q``, one int64 device buffer ``meta [B_max, cols]`` holds, per
row, the token ids, positions, KV slots, the input state page, the ``q`` output pages,
the block table and the draft flags (layout in :class:`_Static`), and one float64 buffer the draw
parameters of every position (:data:`~hybridserve.runner.sampler.PARAM_COLUMNS`). The
host fills pinned twins and copies them with asynchronous transfers (the parameters
only in steps that sample); the graph reads their slices. Rows
past the step's own (padding up to the bucket) read a scratch state page and write no
state (output pages -1, which the decode kernels skip), and write their keys and
values to a scratch KV block that no request owns; their block table names only that
block, so their attention sees one key. The engine allocates the scratch block and
page past the ranges its pools hand out.

Short-row steps (:meth:`DecodeGraphs.replay_short`): the first token of a prompt whose
prefix is cached runs one step of a few hundred tokens over thousands of cached ones;
its kernels are short and its launches (several per layer) dominate. Such steps
(prefill rows only, greedy or sampled without penalties or logprobs, at most
:data:`SHORT_BATCH_BUCKETS`' largest rows, every row at most the policy's
``max_short_tokens``) replay a graph keyed by :class:`ShortShape`: the rows bucket, the
tokens every row is padded to (:func:`short_tokens_bucket`), the kernel policy and the
draw (:class:`Sampling`); the block tables are always the widest (the prefill attention
walks a row's keys up to its positions, so one graph serves every context length). The
static buffer (:class:`_ShortStatic`) has the decode layout for ``q`` = the padded row
length, plus the offset of each row's last real token (the draw reads its logits). A
row's padding tokens come after its real ones, repeat its last token and position,
write their keys to the scratch block and no state; padding rows sit at position 0 of
the scratch block, read the scratch page and write no state. Gated DeltaNet layers get
their packed-rows plan (:class:`~hybridserve.kernels.gdn_varlen.VarlenPlan`) over the same
buffer: device tensors, and on the host only the padded shape's row starts (no pages), so
such a step qualifies only where that path runs token by token
(:func:`~hybridserve.models.layers.gated_deltanet.short_rows_on_device`). Mixture-of-experts
layers on the grouped kernels route and sort on the device (their per-expert loop reads
the experts present back: a CPU path, never captured). The prefill attention's
tile map depends only on the padded shape: the warm-up run before the capture computes
and uploads it into the batch's ``attention_tiles``, and the capture reuses it (nothing
is uploaded inside a capture). Exactness: per padded shape the kernels compute every
real token as the eager step does (no kernel mixes tokens of a row across its padding);
on CUDA the matrix products of a padded step run on more rows than the eager step's,
and cuBLAS may pick another kernel for another row count (as for decode graphs' padding
rows).

Hidden states (``keep_hidden``, for a drafter that reads the target's: MTP): a replayed
decode step also keeps its final hidden states ``[B * q, hidden]`` (row ``i``'s token
``t`` at ``i * q + t``; a captured graph's stay in its pool) in ``last_hidden``, and
short-row steps run eagerly (the eager step keeps its own).

Without capture (``capture=False``, the default off CUDA) a "replay" runs the same
static-buffer forward eagerly: the CPU tests check the buffer building, the padding
and the fallbacks against the ordinary path that way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.config import runs_triton
from hybridserve.kernels.gdn_varlen import VarlenPlan
from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.models.layers.gated_deltanet import short_rows_on_device
from hybridserve.models.layers.moe import Experts
from hybridserve.models.step_plan import (
    MAX_DECODE_TOKENS,
    StatePlan,
    StepKind,
    short_triton,
    short_walk,
    uniform_q,
)
from hybridserve.runner import sampler
from hybridserve.step import SchedulerOutput, kv_slot
from hybridserve.structured.backend import bitmask_words

__all__ = [
    "BATCH_BUCKETS",
    "GREEDY",
    "DeferredDraw",
    "SHORT_BATCH_BUCKETS",
    "DecodeGraphs",
    "Sampling",
    "ShortShape",
    "StepShape",
    "batch_bucket",
    "blocks_bucket",
    "short_tokens_bucket",
]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Short-row steps (a prompt's tail after a cached prefix): few rows, many tokens each.
SHORT_BATCH_BUCKETS = (1, 2, 4, 8)
# The fewest tokens a short-row graph pads a row to: rows of at most MAX_DECODE_TOKENS
# would make a uniform step, which the eager plan runs as a decode step.
MIN_SHORT_TOKENS = 2 * MAX_DECODE_TOKENS


def short_tokens_bucket(tokens: int) -> int:
    """The token count a short-row graph pads a row of ``tokens`` to: the next power of
    two, at least :data:`MIN_SHORT_TOKENS`."""
    return max(MIN_SHORT_TOKENS, 1 << max(tokens - 1, 0).bit_length())


def batch_bucket(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None when none does."""
    for b in buckets:
        if b >= rows:
            return b
    return None


def blocks_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a step whose longest row spans ``blocks`` KV blocks:
    a power of two up to 32, then a multiple of 16, never past ``max_blocks``."""
    if blocks <= 32:
        w = 1
        while w < blocks:
            w *= 2
    else:
        w = -(-blocks // 16) * 16
    return min(w, max_blocks)


@dataclass(frozen=True)
class Sampling:
    """What a step's draw must do (part of the graph key): whether any row samples,
    the top-k width the step's largest top-k rounds up to (a power of two; 0: none),
    whether any row truncates by top-p or min-p, whether any row masks tokens (a
    grammar, ``allowed_token_ids``, ``min_tokens``: the step then reads every position's
    mask from the static mask buffer, all ones for the rows that mask nothing, so the
    key says whether a step is masked, never which rows are), whether any sampled row
    verifies drafts its drafter sampled from a distribution of its own (``drafted``: the
    draw then runs :func:`~hybridserve.runner.sampler.speculative_choices` over every
    draft slot with the static ``log q`` buffer and keeps it where the slot's flag is
    set; again the key never says which rows). Greedy steps are ``Sampling()``."""

    any_sampled: bool = False
    top_k: int = 0
    any_top_p: bool = False
    any_min_p: bool = False
    masked: bool = False
    drafted: bool = False


GREEDY = Sampling()


@dataclass(frozen=True)
class StepShape:
    """The graph key of a step: ``rows`` real rows padded to ``batch``, ``q`` tokens a
    row, block tables ``width`` blocks wide, and its draw (:class:`Sampling`)."""

    rows: int
    batch: int
    q: int
    width: int
    sampling: Sampling = GREEDY

    @property
    def key(self) -> tuple:
        """Greedy steps keep the plain ``(batch, q, width)`` key."""
        if self.sampling == GREEDY:
            return (self.batch, self.q, self.width)
        return (self.batch, self.q, self.width, self.sampling)


@dataclass(frozen=True)
class ShortShape:
    """The graph key of a short-row step: ``rows`` real rows padded to ``batch``, every
    row padded to ``tokens`` tokens, block tables ``width`` blocks wide (always the
    graphs' widest: one graph serves every context length), under the model's kernel
    ``policy`` (a comparison may swap the model for another policy)."""

    rows: int
    batch: int
    tokens: int
    width: int
    policy: object = None
    sampling: Sampling = GREEDY

    @property
    def key(self) -> tuple:
        return ("short", self.batch, self.tokens, self.width, self.policy, self.sampling)


@dataclass
class DeferredDraw:
    """A masked step whose forward is queued and whose draw is not
    (:meth:`DecodeGraphs.draw` runs it): its static buffer, key, graphs, the forward's
    logits where nothing is captured, and whether its masks are filled already."""

    st: _Static
    shape: StepShape
    entry: tuple
    logits: torch.Tensor | None
    filled: bool = False


class _Static:
    """The static input buffer of one ``q`` (and its pinned host twin).

    Columns: ``[0, q)`` token ids, ``[q, 2q)`` positions, ``[2q, 3q)`` KV slots,
    ``3q`` the input state page, ``[3q + 1, 4q + 1)`` the output state pages,
    ``[4q + 1, 4q + 1 + max_blocks)`` the block table (-1 padded), then ``extra``
    columns of a subclass's, then with ``flags`` (a verify step's buffer) ``q - 1``
    draft flags from column :attr:`flags`: 1 where the row's draft ``j`` (its token at
    column ``j + 1``) was sampled from a drafter's distribution, whose ``log q`` the
    graphs' static buffer holds (:meth:`DecodeGraphs.enable_draft_distributions`), 0
    for point-mass drafts, greedy rows, a row's padding slots and padding rows. The
    flags ride in the same upload as the rest of the row.
    """

    def __init__(self, q: int, max_batch: int, max_blocks: int, scratch_block: int,
                 scratch_page: int, block_size: int, device: torch.device,
                 extra: int = 0, flags: bool = False) -> None:
        self.q = q
        self.tables = 4 * q + 1
        self.flags = self.tables + max_blocks + extra
        cols = self.flags + (q - 1 if flags else 0)
        self.meta = torch.zeros(max_batch, cols, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # Two pinned host twins, filled in turn: a step scheduled ahead is filled while
        # the copy of the step before it may still be queued, so a fill never writes
        # the twin whose copy it has not seen finish (``copied``).
        host = torch.zeros(2, max_batch, cols, dtype=torch.int64)
        self.staging = host.pin_memory() if pin else host
        self.turn = 0
        self.copied: list[torch.cuda.Event | None] = [None, None]
        # Per position, the sampler's parameter columns (sampler.PARAM_COLUMNS); a
        # padding row or position draws greedily (temperature 0) and is dropped.
        ncol = len(sampler.PARAM_COLUMNS)
        self.params = torch.zeros(max_batch * q * ncol, dtype=torch.float64, device=device)
        params_host = torch.zeros(2, max_batch * q * ncol, dtype=torch.float64)
        self.params_staging = params_host.pin_memory() if pin else params_host
        # Per position, its token mask (int32 bitmask words), for masked steps only:
        # allocated on the first (ensure_masks), with two pinned twins of its own.
        self.masks: torch.Tensor | None = None
        self.mask_staging: torch.Tensor | None = None
        self.mask_turn = 0
        self.mask_copied: list[torch.cuda.Event | None] = [None, None]
        # Masked steps' logits ([max_batch * q, vocab]), between their two graphs.
        self.logits: torch.Tensor | None = None
        # A padding row: token 0 at positions 0 .. q - 1 of the scratch block, reading the
        # scratch page and writing no state.
        pad = np.full(cols, -1, dtype=np.int64)
        pad[0:q] = 0
        pad[q : 2 * q] = np.arange(q)
        pad[2 * q : 3 * q] = scratch_block * block_size + np.arange(q) % block_size
        pad[3 * q] = scratch_page
        pad[self.tables] = scratch_block
        pad[self.flags :] = 0  # no draft of a padding row carries a distribution
        self.pad = pad

    @property
    def host(self) -> np.ndarray:
        """The host twin the next fill writes (a numpy view)."""
        return self.staging[self.turn].numpy()

    @property
    def params_host(self) -> np.ndarray:
        return self.params_staging[self.turn].numpy().reshape(self.meta.shape[0], self.q, -1)

    def ensure_masks(self, words: int) -> None:
        """Allocate the mask buffer for masks of ``words`` int32 words (once)."""
        if self.masks is not None and self.masks.shape[1] == words:
            return
        rows = self.meta.shape[0] * self.q
        self.masks = torch.full((rows, words), -1, dtype=torch.int32, device=self.meta.device)
        host = torch.full((2, rows, words), -1, dtype=torch.int32)
        self.mask_staging = host.pin_memory() if self.meta.is_cuda else host
        self.mask_copied = [None, None]

    def begin_masks(self) -> np.ndarray:
        """The mask twin the next mask fill writes (``[max_batch * q, words]``), once the
        copy that last read it has run."""
        t = self.mask_turn
        if self.mask_copied[t] is not None:
            self.mask_copied[t].synchronize()
        return self.mask_staging[t].numpy()

    def end_masks(self, positions: int) -> None:
        """Copy the mask twin's first ``positions`` rows to the device behind the
        stream's queued work, and pass the turn."""
        t = self.mask_turn
        self.masks[:positions].copy_(self.mask_staging[t, :positions], non_blocking=True)
        if self.masks.is_cuda:
            self.mask_copied[t] = torch.cuda.Event()
            self.mask_copied[t].record()
        self.mask_turn = 1 - t

    def begin_fill(self) -> None:
        """Wait until the copy that last read this turn's twin has run."""
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()

    def end_fill(self, batch: int, params: int) -> None:
        """Copy the twin's first ``batch`` rows (and ``params`` parameter values) to the
        device behind the stream's queued work, and pass the turn."""
        t = self.turn
        self.meta[:batch].copy_(self.staging[t, :batch], non_blocking=True)
        if params:
            self.params[:params].copy_(self.params_staging[t, :params], non_blocking=True)
        if self.meta.is_cuda:
            self.copied[t] = torch.cuda.Event()
            self.copied[t].record()
        self.turn = 1 - t


class _ShortStatic(_Static):
    """The static input buffer of short-row steps whose rows are padded to ``q`` tokens:
    :class:`_Static`'s columns, then one more (``last``): the offset of the row's last
    real token, whose logits the step draws from. A padding row sits at position 0 for
    every token (its keys and its block table are the scratch block's), reads the
    scratch page and writes no state."""

    def __init__(self, q: int, max_batch: int, max_blocks: int, scratch_block: int,
                 scratch_page: int, block_size: int, device: torch.device) -> None:
        super().__init__(q, max_batch, max_blocks, scratch_block, scratch_page, block_size,
                         device, extra=1)
        self.last = self.tables + max_blocks
        self.pad[q : 2 * q] = 0
        self.pad[self.last] = 0
        # Rows of q tokens each: the row starts and every token's row never change.
        self.query_start = torch.arange(0, (max_batch + 1) * q, q, dtype=torch.int32,
                                        device=device)
        self.token_row = torch.arange(max_batch * q, device=device) // q
        self.row_base = torch.arange(0, max_batch * q, q, device=device)
        # Per batch size: the prefill attention's tile maps (ForwardBatch.attention_tiles).
        self.tiles: dict[int, dict[int, torch.Tensor]] = {}
        # The rows' context lengths of the last fill (host): only the torch twin of the
        # attention reads them, which runs without capture.
        self.context_lens: list[int] = []


class DecodeGraphs:
    """Captures and replays decode and verify steps (see the module docstring), and
    short-row steps (:meth:`replay_short`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        caches: ModelCaches,
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        scratch_block: int,
        scratch_page: int,
        device: torch.device | str,
        capture: bool | None = None,
        buckets: Sequence[int] = BATCH_BUCKETS,
    ) -> None:
        self.model = model
        self.model_dtype = next(model.parameters()).dtype
        # A policy without the batched decode ops sends every step to the eager paths.
        policy = getattr(model, "kernel_policy", None)
        self.uniform_decode = policy is None or policy.uniform_decode
        self.caches = caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA-graph capture needs a CUDA device")
        top = batch_bucket(max_num_seqs, buckets)
        self.buckets = tuple(b for b in buckets if top is None or b <= top)
        self.max_batch = self.buckets[-1]
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_page = scratch_page
        self.max_q = min(MAX_DECODE_TOKENS, block_size)
        self._static: dict[int, _Static] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._pool = None
        # False after a capture failed: every later step runs eagerly.
        self.enabled = True
        # False after the capture of a sampled step failed (its draw holds several
        # [rows x vocab] temporaries, the largest memory of any step): later sampled
        # steps run eagerly, greedy ones keep their graphs.
        self.sampled_enabled = True
        self._short_static: dict[int, _ShortStatic] = {}
        # KernelPolicy.short_graphs; False after a short-row capture failed: later
        # short-row steps run eagerly.
        mode = policy.short_graphs if policy is not None else "auto"
        self.short_enabled = mode != "off"
        # KernelPolicy.sampler: the sampled draw of a captured step as its Triton kernel.
        self.sampler_kernels = policy.sampler if policy is not None else "auto"
        # Gated DeltaNet layers run a short step from the plan's per-token tensors
        # (VarlenPlan), which a graph step builds over its static buffer.
        spec = getattr(model, "cache_spec", None)
        self.gdn = bool(getattr(spec, "gdn_layers", ()))
        # Mixture-of-experts layers on the per-expert loop read the experts present back
        # (a host sync no capture can record): such short steps are not captured. Which
        # path they take, per KernelPolicy.moe (the same for every MoE layer).
        self._experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
        self._moe_grouped: dict[str, bool] = {}
        self.counters = {"graph_steps": 0, "eager_steps": 0, "captures": 0,
                         "short_graph_steps": 0, "short_captures": 0, "masked_graph_steps": 0,
                         "deferred_draws": 0, "drafted_graph_steps": 0}
        # The static log q buffer of drafts sampled from a drafter's distribution
        # (enable_draft_distributions; None: such steps run eagerly) and the most drafts
        # per row it holds.
        self.static_logq: torch.Tensor | None = None
        self.max_drafted = 0
        # Keep each replayed decode step's final hidden states (``last_hidden``,
        # ``[B * q, hidden]``: row i's token t at i * q + t) for a drafter that reads
        # them (MTP); short-row steps then run eagerly (the eager path keeps them).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self._hidden: dict[tuple, torch.Tensor] = {}
        # Host seconds spent filling masked steps' token masks (the grammar matchers'
        # work; on CUDA it overlaps the forward queued before it).
        self.mask_seconds = 0.0
        self.capture_errors: list[str] = []
        # The scratch page and block start as zeros: padding rows then compute on finite
        # values (their results are dropped either way).
        with torch.no_grad():
            for state in caches.state_tensors():
                state[scratch_page].zero_()
            for k, v in caches.kv.values():
                k[scratch_block].zero_()
                v[scratch_block].zero_()

    def enable_draft_distributions(self, max_drafts: int) -> None:
        """Replay sampled verify steps whose drafts a drafter sampled from a
        distribution of its own (a draft model's, an MTP head's: ``Sampling.drafted``),
        by allocating the static ``log q`` buffer their acceptance test reads. The
        engine calls this only when its drafter produces distributions (never for
        n-gram drafts or without speculation); without it such steps run eagerly.

        ``max_drafts``: the most drafts a row carries (``num_speculative_tokens``; at
        most ``max_q - 1`` are ever verified in a graph).

        The buffer: ``[max_batch * k, vocab]`` in
        :data:`~hybridserve.runner.sampler.LOGQ_DTYPE` (float32: the dtype the drafters
        and the eager sampler use too, so both paths test on the same values; why not
        float64 is said there), zero-filled, one buffer for every ``q``. A step of ``B`` rows
        of ``q`` tokens uses its first ``B * (q - 1)`` rows, row ``i``'s draft ``j`` at
        ``i * (q - 1) + j``: a contiguous view, so the captured draw reads it without a
        gather. ``k`` rows per batch row, not ``q`` (the last position of a row never
        holds a draft): at 256 rows, 3 drafts and a 152k vocabulary that is 0.44 GiB.
        The fill copies only the flagged drafts' rows (:meth:`fill`, on the device); a
        slot nobody flags (point-mass drafts, greedy rows, padding) keeps what it held,
        zeros or an earlier step's ``log q``: finite, and its result is discarded by
        the flag."""
        if max_drafts < 1:
            raise ValueError(f"max_drafts={max_drafts}: a drafter proposes at least one draft")
        k = min(max_drafts, self.max_q - 1)
        if k < 1:
            return  # no graph verifies a draft (max_q is 1)
        vocab = self.model.config.vocab_size
        self.static_logq = torch.zeros(self.max_batch * k, vocab, dtype=sampler.LOGQ_DTYPE,
                                      device=self.device)
        self.max_drafted = k

    # ---- which steps ---------------------------------------------------------------

    def shape_of(
        self, sched: SchedulerOutput, logqs: Sequence[torch.Tensor | None] | None = None
    ) -> StepShape | None:
        """The graph key of ``sched``, or None when the step must run eagerly.

        ``logqs``: per row, the drafter's ``log q [>= num_drafts, vocab]`` of the drafts
        it sampled from its distribution, or None (point-mass drafts, greedy rows, no
        drafts); such a step (``Sampling.drafted``) needs the static ``log q`` buffer
        (:meth:`enable_draft_distributions`) wide enough for its rows."""
        rows = sched.rows
        if not self.enabled or not rows or not self.uniform_decode:
            return None
        batch = batch_bucket(len(rows), self.buckets)
        if batch is None:
            return None
        # Rows may carry different draft counts: the step runs the longest row's token
        # count q, and shorter rows are padded (see fill()).
        q = max(row.num_tokens for row in rows)
        if not 1 <= q <= self.max_q:
            return None
        bs = self.block_size
        blocks = 0
        in_pages = set()
        out_pages = set()
        masked = False
        words = bitmask_words(self.model.config.vocab_size)
        # The per-params tests once per distinct params object of the step (requests
        # often share one), not once per row; keyed by identity, within this call only.
        by_params: dict[int, tuple[bool, bool]] = {}
        for row in rows:
            n = row.num_computed
            rq = row.num_tokens
            req = row.request
            params = req.params
            tests = by_params.get(id(params))
            if tests is None:
                tests = by_params[id(params)] = (
                    sampler.graph_samplable(params), params.token_masked
                )
            if (
                rq < 1
                or row.num_drafts != rq - 1
                or not row.samples
                or row.state_in_page < 0
                or len(row.state_outputs) != rq
                or not tests[0]
            ):
                return None
            if rq == 1:  # a plain decode row: its one output page, without a list
                out = row.state_outputs.get(n + 1, -1)
                if out < 0:
                    return None
                out_pages.add(out)
            else:
                outs = [row.state_outputs.get(n + 1 + t, -1) for t in range(rq)]
                if min(outs) < 0:
                    return None
                out_pages.update(outs)
            # sampler.needs_mask(params, grammar), from the params' cached half.
            if req.grammar is not None or tests[1]:
                grammar = req.grammar
                if grammar is not None and getattr(grammar, "words", words) != words:
                    return None  # the eager step names the mismatch
                masked = True
            elif row.ahead and getattr(req, "pending_grammar", None) is not None:
                # The token still on the device may start its grammar: masked, the mask
                # filled when the draw runs (after that token is committed).
                masked = True
            in_pages.add(row.state_in_page)
            need = -(-(n + rq) // bs)
            if need > len(row.request.block_ids):
                return None
            if need > blocks:
                blocks = need
        if blocks > self.max_blocks or in_pages & out_pages:
            return None
        drafted = logqs is not None and any(logq is not None for logq in logqs)
        if drafted:
            buf = self.static_logq
            if buf is None or q - 1 > self.max_drafted:
                return None
            for row, logq in zip(rows, logqs):
                if logq is not None and (logq.shape[-1] != buf.shape[1]
                                         or logq.shape[0] < row.num_drafts):
                    return None  # the eager step names the mismatch
        # Every distinct params object once: the draw depends on which params the step
        # has, not on how many rows share each.
        distinct = list({id(row.request.params): row.request.params for row in rows}.values())
        sampling = self._sampling_of(distinct, masked, drafted)
        if sampling is None:
            return None
        return StepShape(len(rows), batch, q, blocks_bucket(blocks, self.max_blocks), sampling)

    def _sampling_of(
        self, params: list, masked: bool = False, drafted: bool = False
    ) -> Sampling | None:
        """What the draw of rows of ``params`` must do (:class:`Sampling`; ``masked``:
        some row masks tokens; ``drafted``: some sampled row verifies drafts with their
        ``log q``), or None when they sample or mask and sampled graphs are
        off. A greedy row is plain argmax when nothing masks or penalises it; rows whose
        params are not plain (a grammar waiting for its start tag) but that mask
        nothing draw as such."""
        if not masked and not drafted and all(
            sampler.samples_by_argmax(p) or (p.greedy and sampler.graph_samplable(p)) for p in params
        ):
            return GREEDY
        if not self.sampled_enabled:
            return None
        vocab = self.model.config.vocab_size
        k = max((sampler.active_top_k(p, vocab) for p in params), default=0)
        return Sampling(
            any_sampled=any(not p.greedy for p in params),
            top_k=min(1 << (k - 1).bit_length(), vocab) if k else 0,
            any_top_p=any(sampler.active_top_p(p) < 1.0 for p in params),
            any_min_p=any(sampler.active_min_p(p) > 0.0 for p in params),
            masked=masked,
            drafted=drafted,
        )

    # ---- one step ------------------------------------------------------------------

    def replay(
        self,
        sched: SchedulerOutput,
        tokens: torch.Tensor | None = None,
        logqs: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor | DeferredDraw, int] | None:
        """Run ``sched`` from a graph if it qualifies, reading nothing back: the device
        output (row ``i``'s choices at ``[i * q, i * q + num_tokens)``) and ``q``, or
        None (then nothing ran). ``tokens`` (device, one per row): the input tokens of a
        step of one-token rows scheduled ahead, which the host does not have yet.
        ``logqs``: per row, the ``log q`` of drafts sampled from a drafter's
        distribution, or None (:meth:`shape_of`).

        A masked step scheduled ahead (``tokens`` given) runs its forward only and
        returns a :class:`DeferredDraw` in place of the output: its masks follow the
        tokens still on the device, so :meth:`draw` fills them and replays the draw
        once the step before is committed."""
        shape = self.shape_of(sched, logqs)
        if tokens is not None and (shape is None or shape.q != 1):
            return None
        if shape is None:
            return None
        st = self._static.get(shape.q)
        if st is None:
            st = self._static[shape.q] = _Static(
                shape.q, self.max_batch, self.max_blocks, self.scratch_block,
                self.scratch_page, self.block_size, self.device, flags=True,
            )
        self.fill(st, sched, shape, logqs)
        if tokens is not None:
            st.meta[: shape.rows, 0] = tokens
        if shape.sampling.masked:
            deferred = self._masked_forward(st, sched, shape, fill_first=tokens is None)
            if deferred is None:
                return None
            if self.keep_hidden:
                self.last_hidden = self._hidden[shape.key]
            self.counters["graph_steps"] += 1
            self.counters["masked_graph_steps"] += 1
            self.counters["drafted_graph_steps"] += shape.sampling.drafted
            if tokens is not None:
                self.counters["deferred_draws"] += 1
                return deferred, shape.q
            return self.draw(deferred, sched), shape.q
        key = shape.key
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(st, shape)
            if entry is None:
                return None
        out = self._run_entry(entry, lambda: self._forward(st, shape))
        if self.keep_hidden:
            self.last_hidden = self._hidden[key]
        self.counters["graph_steps"] += 1
        self.counters["drafted_graph_steps"] += shape.sampling.drafted
        return out, shape.q

    def _masked_forward(
        self, st: _Static, sched: SchedulerOutput, shape: StepShape, fill_first: bool
    ) -> DeferredDraw | None:
        """The first half of a masked step: the forward and the logits, as a graph of
        their own (captured with the draw's on a key's first step). ``fill_first``: fill
        the masks now where the key is captured, before its warm-up (the step's draw
        follows at once). None when a capture failed (nothing ran)."""
        entry = self._graphs.get(shape.key)
        filled = False
        if entry is None:
            if fill_first:
                self.fill_masks(st, sched, shape)
                filled = True
            entry = self._capture_masked(st, shape)
            if entry is None:
                return None
        (forward, logits), _ = entry
        if forward is not None:
            forward.replay()
        else:
            logits = self._static_logits(st, shape)
        return DeferredDraw(st, shape, entry, logits, filled)

    def _static_logits(self, st: _Static, shape: StepShape) -> torch.Tensor:
        """The forward of a masked step, its logits copied into the buffer's static
        logits (what its draw graph reads): one buffer per ``q``, not a captured output
        per key, which at a large vocabulary would hold ``[B * q, vocab]`` per key. The
        buffer is allocated on the first call, the warm-up before a capture."""
        logits = self._forward_logits(st, shape)
        n = shape.batch * shape.q
        if st.logits is None or st.logits.dtype != logits.dtype or st.logits.shape[1] != logits.shape[1]:
            st.logits = torch.empty(st.meta.shape[0] * st.q, logits.shape[1], dtype=logits.dtype,
                                    device=logits.device)
        st.logits[:n].copy_(logits)
        return st.logits[:n]

    def draw(self, deferred: DeferredDraw, sched: SchedulerOutput) -> torch.Tensor:
        """The second half of a masked step (its forward queued by :meth:`replay`): fill
        the masks on the host (the grammar matchers' work; on CUDA it overlaps the
        queued forward) and upload them, then replay the draw. ``sched``: the step's
        schedule; its rows' committed grammar states are the step's (a step scheduled
        ahead draws after the step before it is committed). Returns the device output
        (as :meth:`replay`'s)."""
        st, shape = deferred.st, deferred.shape
        if not deferred.filled:
            self.fill_masks(st, sched, shape)
        _, (draw, out) = deferred.entry
        if draw is not None:
            draw.replay()
            return out
        return self._draw(st, shape, deferred.logits)

    def fill_masks(self, st: _Static, sched: SchedulerOutput, shape: StepShape) -> None:
        """Write every position's token mask of a masked step into the static mask
        buffer (the pinned twin, then one copy): the masked rows' from their matchers and
        params (:func:`~hybridserve.runner.sampler.fill_masks`, row ``i``'s positions at
        ``i * q``), all ones for everything else (rows that mask nothing, a row's
        padding positions, padding rows)."""
        t0 = time.perf_counter()
        q = shape.q
        vocab = self.model.config.vocab_size
        st.ensure_masks(bitmask_words(vocab))
        h = st.begin_masks()
        h[: shape.batch * q] = -1
        rows, starts = [], []
        for i, row in enumerate(sched.rows):
            req = row.request
            if not sampler.needs_mask(req.params, req.grammar):
                continue
            if getattr(getattr(req, "status", None), "finished", False):
                continue  # finished since the step was launched: its row is dropped
            # Its first index is the committed output's length also for a row scheduled
            # ahead: its draw runs once the token before it is committed (draw()).
            rows.append(sampler.SampleRow.of(row))
            starts.append(i * q)
        sampler.fill_masks(rows, h, vocab, starts)
        st.end_masks(shape.batch * q)
        self.mask_seconds += time.perf_counter() - t0

    def fill(
        self,
        st: _Static,
        sched: SchedulerOutput,
        shape: StepShape,
        logqs: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Write the step's rows (then padding rows up to the bucket) into the static
        buffer: the pinned host twin first, then one asynchronous copy. A ``drafted``
        step also sets its rows' draft flags and copies each flagged row's ``log q``
        (``logqs[i][:num_drafts]``, on the device) into the static ``log q`` buffer
        (:meth:`enable_draft_distributions` gives the layout)."""
        st.begin_fill()
        q, bs, h = shape.q, self.block_size, st.host
        tab = st.tables
        width = shape.width
        scratch = self.scratch_block * bs
        rows = sched.rows
        if q == 1:
            # Plain decode: every column at once (the values the general loop below writes).
            n = [row.num_computed for row in rows]
            # An ahead row's token is not on the host: the replay copies it in on the device.
            h[: len(rows), 0] = [
                0 if row.ahead else row.request.all_token_ids[c] for row, c in zip(rows, n)
            ]
            h[: len(rows), 1] = n
            h[: len(rows), 2] = [
                kv_slot(row.request.block_ids, c, bs) for row, c in zip(rows, n)
            ]
            h[: len(rows), 3] = [row.state_in_page for row in rows]
            h[: len(rows), 4] = [row.state_outputs[c + 1] for row, c in zip(rows, n)]
            # The block tables as one flat list, converted once: numpy converts a flat
            # list of ints about twice as fast as the same values as a list of rows.
            pad = [-1] * width
            flat: list[int] = []
            for row in rows:
                blocks = row.request.block_ids
                if len(blocks) >= width:
                    flat += blocks[:width]
                else:
                    flat += blocks
                    flat += pad[len(blocks):]
            h[: len(rows), tab : tab + width] = np.array(flat, dtype=np.int64).reshape(len(rows), width)
        else:
            for i, row in enumerate(rows):
                req = row.request
                n = row.num_computed
                d = row.num_drafts
                rq = row.num_tokens
                blocks = req.block_ids
                line = h[i]
                line[0 : rq - d] = req.all_token_ids[n : n + rq - d]
                if d:
                    line[rq - d : rq] = req.draft_token_ids[:d]
                for t in range(rq):
                    pos = n + t
                    line[q + t] = pos
                    line[2 * q + t] = kv_slot(blocks, pos, bs)
                    line[3 * q + 1 + t] = row.state_outputs[pos + 1]
                # Padding positions of a row shorter than q: they come after the row's
                # real tokens, so neither the recurrence nor the causal attention of a
                # real token sees them. They repeat the last real token and position (so
                # every key they look up through the block table exists), write their
                # keys to the scratch block and no state (-1), and their argmax is dropped.
                for t in range(rq, q):
                    line[t] = line[rq - 1]
                    line[q + t] = n + rq - 1
                    line[2 * q + t] = scratch + t % bs
                    line[3 * q + 1 + t] = -1
                line[3 * q] = row.state_in_page
                k = min(len(blocks), width)
                line[tab : tab + k] = blocks[:k]
                line[tab + k : tab + width] = -1
        h[shape.rows : shape.batch] = st.pad
        if shape.sampling.drafted:
            d = q - 1
            flags = h[: shape.rows, st.flags : st.flags + d]
            flags[:] = 0
            for i, (row, logq) in enumerate(zip(rows, logqs)):
                if logq is not None:
                    flags[i, : row.num_drafts] = 1
                    # Queued on the stream after every replay that read the buffer before.
                    self.static_logq[i * d : i * d + row.num_drafts].copy_(logq[: row.num_drafts])
        params = 0
        if shape.sampling.any_sampled:
            # Every position's draw parameters; rows shorter than q and padding rows
            # draw greedily (their choices are dropped).
            ph = st.params_host
            ph[: shape.batch] = 0.0
            for i, row in enumerate(sched.rows):
                req = row.request
                # An ahead row draws the token after the one still on the device.
                ph[i, : row.num_tokens] = sampler.position_params(
                    req.params, req.sample_seed, len(req.output_token_ids) + row.ahead,
                    row.num_tokens, self.model.config.vocab_size,
                )
            params = shape.batch * q * ph.shape[-1]
        st.end_fill(shape.batch, params)

    # ---- the static forward --------------------------------------------------------

    def _forward(self, st: _Static, shape: StepShape) -> torch.Tensor:
        """The step over the static buffer: ``[B * q]`` chosen ids (what is captured)."""
        return self._draw(st, shape, self._forward_logits(st, shape))

    def _static_batch(self, st: _Static, shape: StepShape) -> ForwardBatch:
        """The planned DECODE batch of a step over the static buffer ``st`` (what
        :meth:`_forward_logits` and a drafter's graphs run the model on)."""
        b, q, w = shape.batch, shape.q, shape.width
        m = st.meta[:b]
        # The step plan of a DECODE step over the static buffer, built directly: no host
        # lists (what a replay reads exists only on the device), pages from the buffer.
        states = None
        if self.caches.states:
            compute = torch.promote_types(self.model_dtype, torch.float32)
            states = StatePlan(
                StepKind.DECODE, b, q,
                in_pages=m[:, 3 * q].to(torch.int32),
                token_out_pages=m[:, 3 * q + 1 : 4 * q + 1].to(torch.int32).reshape(-1),
                triton=self.device.type == "cuda" and compute == torch.float32,
            )
        return ForwardBatch(
            query_start=None,
            num_computed=None,
            positions=m[:, q : 2 * q].reshape(-1),
            context_lens=None,
            block_tables=m[:, st.tables : st.tables + w].to(torch.int32),
            slot_mapping=m[:, 2 * q : 3 * q].reshape(-1),
            state_in_page=None,
            state_out_row=None,
            state_out_offset=None,
            state_out_page=None,
            planned=True,
            uniform_q=q,
            states=states,
            # Sizes the attention's key axis only: W blocks for every row; the true
            # context of a row comes from its positions on the device.
            max_context=w * self.block_size,
        )

    def _forward_logits(self, st: _Static, shape: StepShape) -> torch.Tensor:
        """The forward over the static buffer: ``[B * q, vocab]`` logits."""
        m = st.meta[: shape.batch]
        batch = self._static_batch(st, shape)
        hidden = self.model.forward(m[:, 0 : shape.q].reshape(-1), batch, self.caches)
        if self.keep_hidden:
            # The step's final hidden states (a captured step's stay in the graph's pool
            # and hold each replay's values).
            self._hidden[shape.key] = hidden
        return self.model.compute_logits(hidden)

    def _draw(self, st: _Static, shape: StepShape, logits: torch.Tensor) -> torch.Tensor:
        """The draw of a static step from its ``logits``: ``[B * q]`` chosen ids. A
        masked step first sets every position's excluded tokens to ``-inf`` (the mask
        buffer; what the eager sampler does to its masked positions before anything
        else), then draws as the batched sampler does."""
        b, q = shape.batch, shape.q
        sm = shape.sampling
        if sm.masked:
            logits = sampler.apply_dense_bitmasks(logits.float(), st.masks[: b * q])
            if not sm.any_sampled:
                return sampler.argmax_ids(logits)
        if sm == GREEDY:
            return sampler.argmax_ids(logits)
        plan = sampler.DrawPlan(
            packed=st.params, num_positions=b * q, num_penalties=0, logprob_positions=[],
            logprob_k=[], max_logprobs=0, max_top_k=sm.top_k, any_sampled=sm.any_sampled,
            any_top_p=sm.any_top_p, any_min_p=sm.any_min_p,
        )
        return sampler.sample_step(logits, plan, st.params, self._drafted(st, shape),
                                   self.sampler_kernels)

    def _drafted(self, st: _Static, shape: StepShape) -> tuple | None:
        """The draw's ``drafted`` input of a static step (None unless ``drafted``):
        every draft slot of the shape (row ``i``'s position ``j < q - 1``, at ``i * q +
        j``), its ``log q`` (the buffer's first ``B * (q - 1)`` rows), its draft (the
        row's token at ``j + 1``) and its flag. Built from device ops only, so the
        capture records it; the speculative test runs on every slot (row by row, so a
        flagged slot's choice is the eager step's) and the flags keep the point-mass
        choice everywhere else."""
        if not shape.sampling.drafted:
            return None
        b, q = shape.batch, shape.q
        d = q - 1
        m = st.meta[:b]
        device = m.device
        pos = (torch.arange(b, device=device)[:, None] * q
               + torch.arange(d, device=device)[None, :]).reshape(-1)
        use = m[:, st.flags : st.flags + d].reshape(-1) != 0
        return pos, self.static_logq[: b * d], m[:, 1:q].reshape(-1), use

    def _record(self, key: tuple, forward):
        """Capture ``forward()`` (one step on its static buffers) as the graph of
        ``key`` and return ``(graph, output)``; without capture, ``(None, None)`` (the
        step then runs eagerly on the same buffers). A warm-up runs first on a side stream:
        it compiles the Triton kernels, sets up the BLAS handles and fills the attention's
        tile maps, and it is harmless because the forward is idempotent for one step's
        inputs (it writes this step's keys, values and output states, the same again on
        the replay). Raises what the capture raised."""
        if not self.capture:
            entry = (None, None)
            self._graphs[key] = entry
            return entry
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        entry = (graph, out)
        self._graphs[key] = entry
        return entry

    @staticmethod
    def _run_entry(entry: tuple, forward):
        """Run a step from its entry ``(graph, output)``: replay the graph and return
        its output, or without a graph run ``forward()`` eagerly and return its result."""
        graph, out = entry
        if graph is None:
            return forward()
        graph.replay()
        return out

    def _capture_masked(self, st: _Static, shape: StepShape):
        """Capture a masked step's two graphs (:meth:`_masked_forward`, :meth:`draw`) and return
        ``((forward graph, logits), (draw graph, choices))``, the graphs None without
        capture; None when a capture failed (masked and sampled steps then run
        eagerly, greedy unmasked ones keep their graphs)."""
        key = shape.key
        try:
            forward = self._record(key + ("forward",), lambda: self._static_logits(st, shape))
            logits = forward[1]
            draw = self._record(key + ("draw",), lambda: self._draw(st, shape, logits))
        except Exception as e:
            self.capture_errors.append(f"{key}: {type(e).__name__}: {e}")
            self.sampled_enabled = False
            return None
        entry = (forward, draw)
        self._graphs[key] = entry
        if forward[0] is not None:
            self.counters["captures"] += 2
        return entry

    def _capture(self, st: _Static, shape: StepShape):
        """Capture the step of ``shape`` over ``st`` (:meth:`_capture_step`)."""
        return self._capture_step(shape, lambda: self._forward(st, shape))

    def _capture_step(self, shape: StepShape, forward):
        """Record ``forward()`` as the graph of ``shape`` (:meth:`_record`) and return
        its entry; None when the capture failed (then greedy steps, or sampled ones as
        ``shape`` is, run eagerly from now on)."""
        try:
            entry = self._record(shape.key, forward)
        except Exception as e:  # a failed capture turns graphs off; the step runs eagerly
            self.capture_errors.append(f"{shape.key}: {type(e).__name__}: {e}")
            if shape.sampling == GREEDY:
                self.enabled = False
            else:
                self.sampled_enabled = False
            return None
        if entry[0] is not None:
            self.counters["captures"] += 1
        return entry

    # ---- short-row steps -------------------------------------------------------------

    def short_shape_of(self, sched: SchedulerOutput, model: torch.nn.Module) -> ShortShape | None:
        """The graph key of a short-row step of ``model``, or None when it runs eagerly.

        Which steps: prefill rows only (no decode or verify rows, no drafts), each of at
        least two tokens and at most the policy's ``max_short_tokens``, rows of different
        lengths or longer than :data:`MAX_DECODE_TOKENS` (so the eager plan is the
        short-row path, not a decode step), at most the largest of
        :data:`SHORT_BATCH_BUCKETS` rows, no output page repeated or read by any row,
        no row asking for prompt logprobs (the eager forward computes them from every
        position's hidden state), no sampling row asking for penalties, logprobs or a
        grammar (greedy rows take the
        argmax of their last token's logits, sampled rows draw there as decode graphs
        do), on a model
        whose eager plan takes the short-row path and (when capturing) the Triton prefill
        attention (its twin reads host context lengths) and the grouped expert kernels
        (the per-expert loop reads back the experts present), and whose Gated DeltaNet
        layers (if any) run that path from device values
        (:func:`~hybridserve.models.layers.gated_deltanet.short_rows_on_device`). Rows are
        padded to
        :func:`short_tokens_bucket` of the longest row: the padding tokens come after the
        row's real tokens (so no real token sees them), repeat its last token and
        position, write their keys to the scratch block and no state.
        """
        rows = sched.rows
        if not (self.enabled and self.short_enabled and rows) or self.keep_hidden:
            return None
        batch = batch_bucket(len(rows), SHORT_BATCH_BUCKETS)
        if batch is None or batch > self.max_batch:
            return None
        policy = getattr(model, "kernel_policy", None)
        if policy is None:
            return None
        compute = torch.promote_types(self.model_dtype, torch.float32)
        if self.caches.states and short_triton(policy, self.device, compute) is None:
            return None
        if self.capture and not (runs_triton(policy.prefill_attention, self.device)
                                 and self._moe_captures(policy)):
            return None
        bs = self.block_size
        blocks = 0
        longest = 0
        starts = [0]
        in_pages = set()
        out_pages: list[int] = []
        for row in rows:
            n, rq = row.num_computed, row.num_tokens
            if (
                row.is_decode
                or row.num_drafts
                or rq < 2
                or rq > policy.max_short_tokens
                or row.request.params.prompt_logprobs is not None
                or (row.samples and not sampler.graph_samplable(row.request.params))
                or (row.samples and sampler.needs_mask(row.request.params, row.request.grammar))
            ):
                return None
            for p in row.state_outputs:
                if not n < p <= n + rq:
                    return None
            need = -(-(n + rq) // bs)
            if need > len(row.request.block_ids):
                return None
            blocks = max(blocks, need)
            longest = max(longest, rq)
            starts.append(starts[-1] + rq)
            if row.state_in_page >= 0:
                in_pages.add(row.state_in_page)
            out_pages += row.state_outputs.values()
        if blocks > self.max_blocks or (policy.uniform_decode and uniform_q(starts)):
            return None
        if len(set(out_pages)) != len(out_pages) or in_pages.intersection(out_pages):
            return None
        tokens = short_tokens_bucket(longest)
        if self.gdn and not short_rows_on_device(policy, self.device, compute, tokens):
            return None
        # Rows that do not sample draw greedily (their choice is dropped).
        sampling = self._sampling_of([row.request.params for row in rows if row.samples])
        if sampling is None:
            return None
        # The tables are always the widest: the prefill attention walks a row's keys up to
        # its positions, not its table's width, so one graph serves every context length.
        return ShortShape(len(rows), batch, tokens, self.max_blocks, policy, sampling)

    def _moe_captures(self, policy) -> bool:
        """Whether the model's MoE layers (if any) take the grouped kernels under
        ``policy``: no host sync in their step."""
        if self._experts is None:
            return True
        ok = self._moe_grouped.get(policy.moe)
        if ok is None:
            ok = self._moe_grouped[policy.moe] = self._experts.grouped(self.model_dtype,
                                                                       policy.moe)
        return ok

    def replay_short(self, sched: SchedulerOutput, model: torch.nn.Module) -> torch.Tensor | None:
        """Run the short-row step ``sched`` of ``model`` from a graph if it qualifies
        (:meth:`short_shape_of`), reading nothing back: the device tensor of the rows'
        choices (row ``i``'s at ``i``; a row that does not sample has one too, dropped), or
        None (then nothing ran)."""
        shape = self.short_shape_of(sched, model)
        if shape is None:
            return None
        st = self._short_static.get(shape.tokens)
        if st is None:
            st = self._short_static[shape.tokens] = _ShortStatic(
                shape.tokens, self.max_batch, self.max_blocks, self.scratch_block,
                self.scratch_page, self.block_size, self.device,
            )
        self.fill_short(st, sched, shape)
        entry = self._graphs.get(shape.key)
        if entry is None:
            entry = self._capture_short(st, shape, model)
            if entry is None:
                return None
        graph, out = entry
        if graph is not None:
            graph.replay()
        else:
            out = self._short_forward(st, shape, model)
        self.counters["short_graph_steps"] += 1
        return out[: shape.rows]

    def fill_short(self, st: _ShortStatic, sched: SchedulerOutput, shape: ShortShape) -> None:
        """Write the step's rows, each padded to ``shape.tokens`` tokens, then padding rows
        up to the bucket, into the static buffer (the pinned twin, then one copy)."""
        st.begin_fill()
        q, bs, h = shape.tokens, self.block_size, st.host
        tab, width = st.tables, shape.width
        scratch = self.scratch_block * bs
        pad_slots = scratch + np.arange(q) % bs
        context = []
        for i, row in enumerate(sched.rows):
            req = row.request
            n, rq = row.num_computed, row.num_tokens
            line = h[i]
            blocks = np.asarray(req.block_ids[:width], dtype=np.int64)
            pos = np.arange(n, n + rq, dtype=np.int64)
            line[0:rq] = req.all_token_ids[n : n + rq]
            line[rq:q] = line[rq - 1]
            line[q : q + rq] = pos
            line[q + rq : 2 * q] = n + rq - 1
            line[2 * q : 2 * q + rq] = blocks[pos // bs] * bs + pos % bs
            line[2 * q + rq : 3 * q] = pad_slots[rq:]
            line[3 * q] = row.state_in_page
            line[3 * q + 1 : 4 * q + 1] = -1
            for p, page in row.state_outputs.items():
                line[3 * q + p - n] = page  # the state after token p - 1 - n of the row
            line[tab : tab + len(blocks)] = blocks
            line[tab + len(blocks) : tab + width] = -1
            line[st.last] = rq - 1
            context.append(n + rq)
        h[shape.rows : shape.batch] = st.pad
        st.context_lens = context + [1] * (shape.batch - shape.rows)
        params = 0
        if shape.sampling != GREEDY:
            # One draw a row, from its last real token: the parameters of its next
            # generated token, [batch, columns] from the buffer's start (padding rows and
            # rows that do not sample draw greedily and are dropped).
            ncol = len(sampler.PARAM_COLUMNS)
            params = shape.batch * ncol
            ph = st.params_staging[st.turn].numpy()[:params].reshape(shape.batch, ncol)
            ph[:] = 0.0
            vocab = self.model.config.vocab_size
            for i, row in enumerate(sched.rows):
                if row.samples:
                    req = row.request
                    ph[i] = sampler.position_params(
                        req.params, req.sample_seed, len(req.output_token_ids), 1, vocab
                    )[0]
        st.end_fill(shape.batch, params)

    def _short_forward(self, st: _ShortStatic, shape: ShortShape, model) -> torch.Tensor:
        """The short-row step over the static buffer: ``[B]`` chosen ids (what is captured):
        the forward of ``B`` rows of ``q`` tokens each, then the argmax of every row's
        last real token's logits."""
        b, q, w = shape.batch, shape.tokens, shape.width
        m = st.meta[:b]
        states = None
        if self.caches.states:
            compute = torch.promote_types(self.model_dtype, torch.float32)
            in_pages = m[:, 3 * q].to(torch.int32)
            out_pages = m[:, 3 * q + 1 : 4 * q + 1].to(torch.int32).reshape(-1)
            query_start, token_row = st.query_start[: b + 1], st.token_row[: b * q]
            varlen = None
            if self.gdn:
                # Gated DeltaNet's per-token tensors: the same device tensors; on the host
                # only the padded shape's row starts (constants of the graph), no pages.
                varlen = VarlenPlan(
                    num_rows=b, query_start=query_start, in_pages=in_pages,
                    token_out_pages=out_pages, token_row=token_row,
                    query_start_host=tuple(range(0, (b + 1) * q, q)),
                    token_out_pages_host=None,
                )
            triton = bool(short_triton(shape.policy, self.device, compute))
            states = StatePlan(
                StepKind.SHORT, b, in_pages=in_pages, token_out_pages=out_pages,
                query_start=query_start, token_row=token_row, triton=triton, varlen=varlen,
                **short_walk(shape.policy, self.device, triton),
            )
        batch = ForwardBatch(
            # Host row starts of the padded rows (static); the attention's tile map
            # comes from them (and from the zero computed counts, which only order it).
            query_start=list(range(0, (b + 1) * q, q)),
            num_computed=[0] * b,
            positions=m[:, q : 2 * q].reshape(-1),
            # Read by the attention's torch twin only, which is never captured.
            context_lens=None if self.capture else list(st.context_lens),
            block_tables=m[:, st.tables : st.tables + w].to(torch.int32),
            slot_mapping=m[:, 2 * q : 3 * q].reshape(-1),
            state_in_page=None,
            state_out_row=None,
            state_out_offset=None,
            state_out_page=None,
            planned=True,
            uniform_q=0,
            states=states,
            max_context=w * self.block_size,
            attention_tiles=st.tiles.setdefault(b, {}),
        )
        hidden = model.forward(m[:, 0:q].reshape(-1), batch, self.caches)
        last = st.row_base[:b] + m[:, st.last]
        logits = model.compute_logits(hidden.index_select(0, last))
        sm = shape.sampling
        if sm == GREEDY:
            return sampler.argmax_ids(logits)
        plan = sampler.DrawPlan(
            packed=st.params, num_positions=b, num_penalties=0, logprob_positions=[],
            logprob_k=[], max_logprobs=0, max_top_k=sm.top_k, any_sampled=sm.any_sampled,
            any_top_p=sm.any_top_p, any_min_p=sm.any_min_p,
        )
        return sampler.sample_step(logits, plan, st.params, kernels=self.sampler_kernels)

    def _capture_short(self, st: _ShortStatic, shape: ShortShape, model):
        try:
            entry = self._record(shape.key, lambda: self._short_forward(st, shape, model))
        except Exception as e:  # a failed capture turns short graphs off; eager from here
            self.capture_errors.append(f"{shape.key}: {type(e).__name__}: {e}")
            if shape.sampling == GREEDY:
                self.short_enabled = False
            else:
                self.sampled_enabled = False
            return None
        if entry[0] is not None:
            self.counters["short_captures"] += 1
        return entry
