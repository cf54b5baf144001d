"""CUDA-graph replay of a drafter's own steps (a draft model's, an MTP head's).

A drafter runs ``k`` small forwards per round: a catch-up row per request (the tokens
it has not seen: one or two in steady state), then ``k - 1`` single-token steps, each
feeding the draft the step before chose. Eagerly each is a full model step of host
launches (milliseconds on a GPU for a model whose kernels take microseconds), so the
drafter dominates the round. :class:`DraftGraphs` replays them from CUDA graphs, over
the drafter's own caches, the way :class:`~hybridserve.runner.cuda_graph.DecodeGraphs`
replays the target's decode steps (it is one, with the same buckets, static buffer
layout, scratch block and page, lazy capture into one pool).

Which steps (:meth:`DraftGraphs.shape_of_rows`): rows of one and the same length
``q <= max_q`` (the eager plan runs such a step as a DECODE step too; rows of other
lengths are grouped by length by the caller), every row continuing from a stored page
(``in_page >= 0``), its output pages distinct and none an input page, its block table
covering its positions and at most the graphs' widest, at most the largest bucket of
rows. A row (:class:`DraftRow`) names its tokens (or takes them from a device tensor:
the draft of the step before, never read back in between), its first position, its
blocks, its input page and the pages that receive the state after given offsets of the
row: a graph step writes exactly the pages the eager step writes, and padding rows only
the scratch block (their output pages are -1).

The draw (part of the graph key: greedy or sampled): per row the argmax of the logits
at its last token, or for rows with a temperature a sample of
``q = softmax(logits / temperature)`` from the request's counter-based stream
(:func:`hybridserve.drafters.base.draft_choices`, the function the eager path calls),
returned with ``log q [rows, vocab]`` for the target's ``min(1, p / q)`` test. The
temperature (its float32 bits), seed words and token index of each row travel in three
more columns of the static buffer, so a step still makes one upload.

The step's model part is the drafter's: :meth:`DraftGraphs.step_forward` runs a draft
model's forward; the MTP head's graphs (:class:`MtpGraphs`) feed the head its input
hidden states from a static buffer too and return the head's outputs at the rows' last
slots (the next step's hidden input) beside the draw.

Without capture (the default off CUDA) a replay runs the same static-buffer step
eagerly, which is what the CPU tests check against the drafter's eager path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.kernels.transfer import upload
from hybridserve.models.batch import ForwardBatch
from hybridserve.runner import sampler
from hybridserve.runner.cuda_graph import (
    GREEDY,
    DecodeGraphs,
    Sampling,
    StepShape,
    _Static,
    batch_bucket,
    blocks_bucket,
)

__all__ = ["DraftDraw", "DraftGraphs", "DraftRow", "MtpGraphs", "row_index"]

SAMPLED = Sampling(any_sampled=True)


@dataclass(frozen=True)
class DraftRow:
    """One row of a drafter's step: ``num_tokens`` tokens at positions ``start ..``
    (``tokens``: their ids, or None when the step takes them from a device tensor),
    KV slots from ``block_ids``, the state read from ``in_page`` and the state after
    offset ``o`` of the row written to ``out_pages[o]``."""

    start: int
    num_tokens: int
    block_ids: Sequence[int]
    in_page: int
    out_pages: Mapping[int, int]
    tokens: Sequence[int] | None = None


@dataclass(frozen=True)
class DraftDraw:
    """How a row's draft is chosen: ``temperature`` 0 the argmax, else a sample with the
    request's seed words at generated-token ``index``."""

    temperature: float = 0.0
    seed_lo: int = 0
    seed_hi: int = 0
    index: int = 0

    @classmethod
    def of(cls, request, step: int) -> DraftDraw:
        """The draw of draft ``step`` (0-based) of a
        :class:`~hybridserve.drafters.base.DraftRequest`."""
        if request.temperature <= 0:
            return cls()
        lo, hi = sampler.seed_words(request.sample_seed)
        return cls(float(request.temperature), lo, hi, request.first_index + step)


class _DraftStatic(_Static):
    """:class:`_Static`'s columns, then four for the draw: the temperature's float32
    bits, the seed words ``lo`` and ``hi``, the token index. :data:`TURNS` pinned host
    twins instead of two: a proposal fills several steps of one ``q`` before the device
    has run the first, and a fill waits only for the copy of the twin it reuses."""

    TURNS = 8

    def __init__(self, q: int, *args, **kwargs) -> None:
        super().__init__(q, *args, **kwargs, extra=4)
        self.draw = self.meta.shape[1] - 4
        self.pad[self.draw : self.draw + 4] = 0
        host = torch.zeros(self.TURNS, *self.meta.shape, dtype=torch.int64)
        self.staging = host.pin_memory() if self.meta.is_cuda else host
        self.copied = [None] * self.TURNS

    def end_fill(self, batch: int, params: int) -> None:
        """Copy the twin's first ``batch`` rows to the device behind the stream's queued
        work, and pass the turn (the draw's parameters are columns: ``params`` is 0)."""
        if params:
            raise ValueError("a draft step's draw parameters travel in its columns")
        t = self.turn
        self.meta[:batch].copy_(self.staging[t, :batch], non_blocking=True)
        if self.meta.is_cuda:
            self.copied[t] = torch.cuda.Event()
            self.copied[t].record()
        self.turn = (t + 1) % self.TURNS


def row_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 index tensor on ``device``, uploaded without making the host
    wait (a pageable copy would drain the queue of graph steps launched before it)."""
    return upload(torch.tensor(rows, dtype=torch.long), device)


def _float32_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


class DraftGraphs(DecodeGraphs):
    """Captures and replays a draft model's uniform steps (see the module docstring).
    ``counters["graph_steps"]`` counts replayed steps, ``counters["graph_rows"]`` their
    rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counters["graph_rows"] = 0
        self._draft_static: dict[int, _DraftStatic] = {}

    # ---- which steps ---------------------------------------------------------------

    def shape_of_rows(self, rows: Sequence[DraftRow], sampled: bool) -> StepShape | None:
        """The graph key of a step of ``rows`` (``sampled``: some row samples), or None
        when it runs eagerly."""
        if not (self.enabled and self.uniform_decode and rows):
            return None
        if sampled and not self.sampled_enabled:
            return None
        batch = batch_bucket(len(rows), self.buckets)
        q = rows[0].num_tokens
        if batch is None or not 1 <= q <= self.max_q:
            return None
        bs = self.block_size
        blocks = 0
        in_pages, out_pages = set(), []
        for row in rows:
            if row.num_tokens != q or (self.caches.states and row.in_page < 0):
                return None
            if any(not 0 <= o < q for o in row.out_pages):
                return None
            need = -(-(row.start + q) // bs)
            if need > len(row.block_ids):
                return None
            blocks = max(blocks, need)
            in_pages.add(row.in_page)
            out_pages += row.out_pages.values()
        if blocks > self.max_blocks or len(set(out_pages)) != len(out_pages):
            return None
        if in_pages.intersection(out_pages):
            return None
        return StepShape(len(rows), batch, q, blocks_bucket(blocks, self.max_blocks),
                         SAMPLED if sampled else GREEDY)

    # ---- one step ------------------------------------------------------------------

    def replay_rows(
        self,
        rows: Sequence[DraftRow],
        draws: Sequence[DraftDraw],
        tokens: torch.Tensor | None = None,
        **inputs: torch.Tensor,
    ) -> tuple | None:
        """Run the step of ``rows`` from a graph if it qualifies, reading nothing back:
        ``(drafts [rows], log q [rows, vocab] or None)`` (new tensors: the next replay
        does not overwrite them), then the model part's further outputs; or None (then
        nothing ran). ``tokens`` (device, one per row of one-token rows): the input
        tokens, when the host does not have them."""
        sampled = any(d.temperature > 0 for d in draws)
        shape = self.shape_of_rows(rows, sampled)
        if shape is None or (tokens is not None and shape.q != 1):
            return None
        st = self._draft_static.get(shape.q)
        if st is None:
            st = self._draft_static[shape.q] = _DraftStatic(
                shape.q, self.max_batch, self.max_blocks, self.scratch_block,
                self.scratch_page, self.block_size, self.device,
            )
        self.fill_rows(st, rows, draws, shape)
        if tokens is not None:
            st.meta[: shape.rows, 0] = tokens
        self.load_inputs(st, shape, **inputs)

        def forward() -> tuple:
            return self._draft_forward(st, shape)

        entry = self._graphs.get(shape.key)
        if entry is None:
            entry = self._capture_step(shape, forward)
            if entry is None:
                return None
        out = self._run_entry(entry, forward)
        self.counters["graph_steps"] += 1
        self.counters["graph_rows"] += shape.rows
        n = shape.rows
        return tuple(None if t is None else t[:n].clone() for t in out)

    def fill_rows(self, st: _DraftStatic, rows: Sequence[DraftRow],
                  draws: Sequence[DraftDraw], shape: StepShape) -> None:
        """Write ``rows`` (then padding rows up to the bucket) into the static buffer."""
        st.begin_fill()
        q, bs, h, tab, width = shape.q, self.block_size, st.host, st.tables, shape.width
        for i, (row, draw) in enumerate(zip(rows, draws)):
            line = h[i]
            blocks = np.asarray(row.block_ids[:width], dtype=np.int64)
            pos = np.arange(row.start, row.start + q, dtype=np.int64)
            line[0:q] = row.tokens if row.tokens is not None else 0
            line[q : 2 * q] = pos
            line[2 * q : 3 * q] = blocks[pos // bs] * bs + pos % bs
            line[3 * q] = row.in_page
            line[3 * q + 1 : 4 * q + 1] = -1
            for off, page in row.out_pages.items():
                line[3 * q + 1 + off] = page
            line[tab : tab + len(blocks)] = blocks
            line[tab + len(blocks) : tab + width] = -1
            line[st.draw : st.draw + 4] = (
                _float32_bits(draw.temperature), draw.seed_lo, draw.seed_hi, draw.index
            )
        h[shape.rows : shape.batch] = st.pad
        st.end_fill(shape.batch, 0)

    def load_inputs(self, st: _DraftStatic, shape: StepShape, **inputs: torch.Tensor) -> None:
        """Copy the model part's further inputs into their static buffers (none here)."""
        if inputs:
            raise TypeError(f"unexpected inputs {sorted(inputs)}")

    # ---- the static forward --------------------------------------------------------

    def step_forward(self, st: _DraftStatic, shape: StepShape, batch: ForwardBatch):
        """The model part: ``(logits at each row's last token [B, vocab], extras)``."""
        b, q = shape.batch, shape.q
        hidden = self.model.forward(st.meta[:b, 0:q].reshape(-1), batch, self.caches)
        last = hidden.view(b, q, -1)[:, q - 1]
        return self.model.compute_logits(last), ()

    def _draft_forward(self, st: _DraftStatic, shape: StepShape) -> tuple:
        """The step over the static buffer (what is captured): ``(drafts [B], log q
        [B, vocab] or None, *extras)``."""
        from hybridserve.drafters.base import draft_choices

        logits, extras = self.step_forward(st, shape, self._static_batch(st, shape))
        if shape.sampling == GREEDY:
            return (torch.argmax(logits, dim=-1), None, *extras)
        d = st.meta[: shape.batch, st.draw : st.draw + 4]
        temps = d[:, 0].to(torch.int32).view(torch.float32)
        tokens, logq = draft_choices(logits, temps, d[:, 1], d[:, 2], d[:, 3])
        return (tokens, logq, *extras)


class MtpGraphs(DraftGraphs):
    """:class:`DraftGraphs` of an MTP head: the step's model part embeds the rows'
    tokens with the target's embedding, reads the hidden states ``h_t`` of every slot
    from a static buffer (``hidden [B * q, hidden]``, copied in before the replay:
    :meth:`load_inputs`), runs the head and returns, besides the draw, the head's output
    at each row's last slot (the next drafting step's hidden input). ``model`` is the
    head, ``target`` the model whose embedding and LM head it shares."""

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module, *args, **kwargs) -> None:
        super().__init__(head, *args, **kwargs)
        self.target = target
        self.uniform_decode = head.policy.uniform_decode
        self.hidden_in = torch.zeros(self.max_batch * self.max_q, target.config.hidden_size,
                                     dtype=self.model_dtype, device=self.device)

    def load_inputs(self, st: _DraftStatic, shape: StepShape, **inputs: torch.Tensor) -> None:
        hidden = inputs.pop("hidden")
        super().load_inputs(st, shape, **inputs)
        n = shape.rows * shape.q
        self.hidden_in[:n].copy_(hidden.reshape(n, -1))
        # Padding rows read finite values (their results are dropped).
        self.hidden_in[n : shape.batch * shape.q].zero_()

    def step_forward(self, st: _DraftStatic, shape: StepShape, batch: ForwardBatch):
        b, q = shape.batch, shape.q
        embeds = self.target.model.embed(st.meta[:b, 0:q].reshape(-1))
        y = self.model(embeds, self.hidden_in[: b * q], batch, self.caches)
        last = y.view(b, q, -1)[:, q - 1]
        return self.target.compute_logits(last), (last,)
