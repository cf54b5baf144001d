"""A second, smaller model as the drafter, with KV blocks and state pages of its own.

The draft model is any checkpoint the engine can load whose vocabulary is the
target's. It runs through the same paged forward as the target
(:mod:`hybridserve.models.batch`) on caches of its own: KV blocks from a private
:class:`~hybridserve.cache.block_pool.BlockPool` and state pages from a private free
list. Nothing is shared with the target's pools, so the target's page ownership
(docs/state-lifecycle.md) is untouched by drafting.

State lifecycle of one request (``L`` tokens in the sequence at a proposal, ``c`` of
them already in the drafter's caches, state page ``P`` holding the drafter's state
after token ``c - 1``):

1. **catch-up**: one row feeds tokens ``c .. L - 1`` (the tokens the drafter has not
   seen: at least the target's last token) from ``P``; its state after token ``L - 1``
   goes to a fresh page ``P0``, which becomes the committed state (``P`` is released;
   a forward never writes the page it reads). Its logits give draft ``d1``.
2. **drafting**: ``k - 1`` single-token rows feed ``d1 .. d(k-1)`` at positions
   ``L .. L + k - 2``, each from the previous row's page to a fresh page ``Pi``: the
   state after draft ``di``. Their logits give ``d2 .. dk``. The pages ``Pi`` are kept
   beside the committed page, as the target keeps ``S_0 .. S_d``.
3. **selection** (at the next proposal): verification accepted ``a - 1`` drafts and
   appended the target's token after them, so the sequence is now ``L + a`` tokens.
   The drafter compares its fed drafts with the new tokens: the first ``j`` match
   (``j = min(a - 1, k - 1)``), so page ``Pj`` (or ``P0`` for ``j = 0``) is the state
   after token ``L + j - 1``: it becomes the committed page by id, and every other
   page of the proposal goes back to the free list. No state is copied.
4. **the bonus token**: the target's own token at position ``L + a - 1`` (and ``dk``
   when every draft was accepted: it was proposed, never fed) has not been seen by the
   drafter; the next catch-up row (step 1) feeds it first. KV entries the drafter wrote
   for rejected drafts sit past its context length and are overwritten by the catch-up.

Prefix cache (with prefix caching on): the catch-up also writes the state at the last
KV block boundary it crosses to a fresh page (or shares the committed page when the
boundary is ``L``) and admits it to the drafter's own checkpoint index, under the same
chained block hashes as the target's, after registering the full blocks it completed;
a new request starts from the longest prefix whose blocks and checkpoint are cached,
reading the checkpoint page and never writing it.

The selection is by content: the state after a token prefix depends on nothing but
the prefix, so whichever path produced the matching drafts, the page holds the exact
state. A request the engine preempts keeps its drafter caches (its tokens survive
preemption); when the drafter's pools run short, the least recently drafted requests
outside the current batch lose theirs and are caught up from token 0 when they next
draft. Greedy requests get the draft model's argmax; sampled requests get samples of
its distribution ``q`` (:func:`~hybridserve.drafters.base.choose_drafts`), which the
target accepts with ``min(1, p / q)`` (:func:`hybridserve.runner.sampler.speculative_choices`).

Where the target replays decode graphs, the drafter's uniform steps (the drafting
steps, and catch-up rows of one length) replay graphs of their own over its caches
(:meth:`DraftModelDrafter.enable_graphs`, :mod:`hybridserve.runner.draft_graphs`): the
same pages written, each step fed the drafts the step before chose on the device, the
drafts read back once per proposal.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridserve.cache.block_pool import BlockPool, chain_hash
from hybridserve.cache.state_cache import StateCache
from hybridserve.default_model import DRAFT_PATH
from hybridserve.drafters.base import DraftRequest, draft_choices, draw_tensors, read_back_drafts
from hybridserve.models.batch import ForwardBatch
from hybridserve.runner.draft_graphs import DraftDraw, DraftGraphs, DraftRow, row_index

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig


# Short names for ``speculative_config.model``: draft models shipped with the package.
NAMED_DRAFT_MODELS = {"default-draft": DRAFT_PATH}


def resolve_draft_model(model: str) -> Path:
    """The checkpoint directory ``speculative_config.model`` names: a short name of
    :data:`NAMED_DRAFT_MODELS` (``"default-draft"``: the draft model trained for the
    embedded default model, for that model), else a path."""
    if model in NAMED_DRAFT_MODELS:
        return NAMED_DRAFT_MODELS[model]
    return Path(model).expanduser()


def _keep_logq(store: dict, requests: Sequence[DraftRequest], logq: dict[int, list]) -> None:
    """Record ``log q`` of each sampled request's drafts under its key."""
    for i, qs in logq.items():
        if qs and all(q is not None for q in qs):
            store[requests[i].key] = torch.stack(qs)


@dataclass
class _Seq:
    """The drafter's caches of one request."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V and state the drafter's caches hold
    page: int = -1  # state after token computed - 1; -1: the zero state (computed == 0)
    fed: list[tuple[int, int]] = field(default_factory=list)  # (draft, page after it)
    last_used: int = 0
    hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks


class DraftModelDrafter:
    """Drafts with a second model on caches of its own (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_kv_blocks: int,
        kv_block_size: int,
        num_state_pages: int,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str,
        enable_caching: bool = False,
    ) -> None:
        self.model = model
        self.block_size = kv_block_size
        self.device = torch.device(device)
        # One KV block and one state page past the pools' ranges: the scratch block and
        # page that padding rows of the drafter's graph steps write (enable_graphs).
        self.caches = model.cache_spec.allocate(
            num_kv_blocks + 1, kv_block_size, num_state_pages + 1, dtype, ssm_dtype, device
        )
        self.num_kv_blocks = num_kv_blocks
        self.graphs: DraftGraphs | None = None
        self.enable_caching = enable_caching
        self.blocks = BlockPool(num_kv_blocks, kv_block_size, enable_caching=enable_caching)
        # Checkpoints (the drafter's prefix cache) may hold a quarter of the pages.
        self.states = StateCache(num_state_pages, num_state_pages // 4 if enable_caching else 0)
        self.blocks.on_evict.append(self.states.on_block_evicted)
        self.num_state_pages = num_state_pages
        self._seqs: dict[Hashable, _Seq] = {}
        self._clock = itertools.count(1)
        # Per key: log q of each draft of the latest proposal (sampled requests only).
        self.draft_logq: dict[Hashable, torch.Tensor] = {}
        self.counters = {"catch_up_tokens": 0, "draft_forwards": 0, "evictions": 0,
                         "prefix_hit_tokens": 0}

    def enable_graphs(self, max_blocks: int, max_rows: int,
                      capture: bool | None = None) -> DraftGraphs:
        """Replay the drafter's uniform steps from CUDA graphs over its own caches
        (:mod:`hybridserve.runner.draft_graphs`): ``max_blocks`` the widest block table
        (a sequence of ``max_model_len`` tokens), ``max_rows`` the most rows a step has
        (the engine's ``max_num_seqs``); ``capture`` None captures on CUDA only, False
        runs the same static-buffer steps eagerly (the CPU tests' mode)."""
        self.graphs = DraftGraphs(
            self.model, self.caches, self.block_size, max_rows, max_blocks,
            self.num_kv_blocks, self.num_state_pages, self.device, capture,
        )
        return self.graphs

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module) -> DraftModelDrafter:
        """Load ``config.speculative.model`` and size its caches from the engine's: as many KV
        blocks as the target, and ``1 + k`` state pages per running request."""
        from hybridserve.models.loader import load_model

        spec = config.speculative
        path = resolve_draft_model(spec.model)
        if not (path / "config.json").exists():
            raise ValueError(
                f"speculative_config.model={spec.model!r} is not a checkpoint directory "
                "(no config.json)"
            )
        draft = load_model(path, dtype=config.dtype, device=config.device)
        tv, dv = target.config.vocab_size, draft.config.vocab_size
        if tv != dv:
            raise ValueError(
                f"speculative_config.model has vocab_size={dv}, the target {tv}: a draft "
                "model must share the target's vocabulary"
            )
        max_len = config.scheduler.max_model_len
        if draft.config.max_position_embeddings < max_len:
            raise ValueError(
                f"speculative_config.model has max_position_embeddings="
                f"{draft.config.max_position_embeddings} < max_model_len={max_len}"
            )
        k = spec.num_speculative_tokens
        cc = config.cache
        # Every running request holds a committed page and up to k proposal pages; the
        # slack lets a new proposal's pages be taken before the old ones are released.
        pages = config.scheduler.max_num_seqs * (k + 2) + 2
        return cls(
            draft, cc.num_kv_blocks, cc.kv_block_size, pages + pages // 3, config.dtype,
            cc.ssm_state_dtype, config.device, enable_caching=cc.enable_prefix_caching,
        )

    # ---- bookkeeping ---------------------------------------------------------------

    def forget(self, key: Hashable) -> None:
        self.draft_logq.pop(key, None)
        seq = self._seqs.pop(key, None)
        if seq is None:
            return
        self._release_pages([seq.page] + [p for _, p in seq.fed])
        self.blocks.release(seq.blocks)

    def _release_pages(self, pages: Sequence[int]) -> None:
        self.states.release([p for p in pages if p >= 0])

    def _extend_hashes(self, seq: _Seq, toks: Sequence[int], upto: int) -> None:
        """Chained hashes of ``seq``'s full blocks of ``toks[:upto]``."""
        bs = self.block_size
        for b in range(len(seq.hashes), upto // bs):
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(chain_hash(parent, toks[b * bs : (b + 1) * bs]))

    def _lookup(self, seq: _Seq, toks: Sequence[int]) -> None:
        """Start a new ``seq`` from the longest cached prefix of ``toks`` (leaving at
        least one token to feed): its KV blocks shared, its state the checkpoint page
        (read, never written: the catch-up writes a fresh page)."""
        if not self.enable_caching:
            return
        self._extend_hashes(seq, toks, len(toks) - 1)
        found: list[int] = []
        for b, h in enumerate(seq.hashes):
            block = self.blocks.lookup(h, toks[b * self.block_size : (b + 1) * self.block_size])
            if block is None:
                break
            found.append(block)
        for n in range(len(found), 0, -1):
            ckpt = self.states.lookup(seq.hashes[n - 1])
            if ckpt is not None:
                self.blocks.acquire(found[:n])
                self.states.incref(ckpt.page)
                seq.blocks, seq.page, seq.computed = found[:n], ckpt.page, ckpt.length
                self.counters["prefix_hit_tokens"] += ckpt.length
                return

    def _checkpoint_point(self, seq: _Seq, toks: Sequence[int]) -> int:
        """The block boundary ``B`` inside this catch-up (``computed < B <= L``) whose
        state becomes a checkpoint, or 0 (caching off, no boundary, already cached)."""
        bs = self.block_size
        boundary = (len(toks) // bs) * bs
        if not self.enable_caching or boundary <= seq.computed or boundary < bs:
            return 0
        self._extend_hashes(seq, toks, boundary)
        return 0 if self.states.has(seq.hashes[boundary // bs - 1]) else boundary

    def _reconcile(self, seq: _Seq, toks: Sequence[int]) -> None:
        """Make the committed page the state after the longest fed prefix that the
        sequence confirms (step 3 of the module docstring); release the rest."""
        j = 0
        while (
            j < len(seq.fed)
            and seq.computed + j < len(toks)
            and toks[seq.computed + j] == seq.fed[j][0]
        ):
            j += 1
        if j:
            keep = seq.fed[j - 1][1]
            self._release_pages([seq.page] + [p for _, p in seq.fed if p != keep])
            seq.page = keep
            seq.computed += j
        else:
            self._release_pages([p for _, p in seq.fed])
        seq.fed = []

    def _reserve(self, seq: _Seq, tokens: int, pages: int, keep: set[int]) -> list[int] | None:
        """Blocks for ``tokens`` positions and ``pages`` fresh pages for ``seq``,
        evicting the least recently used requests outside ``keep`` (ids of the batch's
        sequences) when short; None when even that is not enough."""
        need_blocks = -(-tokens // self.block_size) - len(seq.blocks)
        while need_blocks > self.blocks.num_free or not self.states.can_allocate(pages):
            victims = [(s.last_used, key) for key, s in self._seqs.items() if id(s) not in keep]
            if not victims:
                return None
            self.forget(min(victims)[1])
            self.counters["evictions"] += 1
        if need_blocks > 0:
            seq.blocks += self.blocks.allocate(need_blocks)
        return self.states.allocate(pages)

    # ---- proposing ------------------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        for r in requests:
            self.draft_logq.pop(r.key, None)
        live: list[tuple[int, _Seq, list[int], list[int]]] = []  # (index, seq, toks, pages)
        keep = {id(s) for r in requests if (s := self._seqs.get(r.key)) is not None}
        for i, r in enumerate(requests):
            if r.k <= 0 or not r.token_ids:
                continue
            toks = list(r.token_ids)
            seq = self._seqs.get(r.key)
            if seq is not None:
                self._reconcile(seq, toks)
                if seq.computed >= len(toks):
                    # Nothing left to feed (cannot happen when the target appends its
                    # own token each step): start over rather than guess.
                    self.forget(r.key)
                    seq = None
            if seq is None:
                seq = self._seqs[r.key] = _Seq()
                self._lookup(seq, toks)
                keep.add(id(seq))
            seq.last_used = next(self._clock)
            # Positions up to L + k - 2 are written (drafts d1 .. d(k-1)); k pages, and
            # one more for a checkpoint inside the catch-up.
            point = self._checkpoint_point(seq, toks)
            extra = 1 if 0 < point < len(toks) else 0
            pages = self._reserve(seq, len(toks) + r.k - 1, r.k + extra, keep)
            if pages is None:
                self.forget(r.key)
                continue
            if extra:
                # The checkpoint's page goes last: pages[0 .. k - 1] are the proposal's.
                pages = pages[1:] + pages[:1]
            live.append((i, seq, toks, pages, point))
        if not live:
            return out
        # Step 1: the catch-up rows (one forward, or one graph step per row length).
        rows = []
        for _, seq, toks, pages, point in live:
            extras = [(point - 1 - seq.computed, pages[-1])] if 0 < point < len(toks) else []
            rows.append((seq, toks[seq.computed :], seq.computed, seq.page, pages[0], extras))
        reqs = [requests[i] for i, *_ in live]
        first, first_logq = self._step(rows, reqs, 0)
        for (_, seq, toks, pages, point), row in zip(live, rows):
            self.counters["catch_up_tokens"] += len(row[1])
            start = seq.computed
            self._release_pages([seq.page])
            seq.page, seq.computed = pages[0], len(toks)
            if point:
                self._admit(seq, toks, start, point, row[5][0][1] if row[5] else seq.page)
        live = [(i, seq, toks, pages[: requests[i].k]) for i, seq, toks, pages, _ in live]
        # Step 2: k - 1 single-token rows per request, one step per draft position, each
        # fed the drafts the step before chose on the device; read back once at the end.
        n = len(live)
        steps = [(list(range(n)), first, first_logq)]  # (rows of live, drafts, log q)
        cur = first
        step = 1
        while True:
            act = [j for j, (i, *_) in enumerate(live) if requests[i].k > step]
            if not act:
                break
            rows = []
            for j in act:
                _, seq, toks, pages = live[j]
                rows.append((seq, None, len(toks) + step - 1, pages[step - 1], pages[step], []))
            index = row_index(act, self.device)
            drafts, logq = self._step(rows, [reqs[j] for j in act], step,
                                      cur.index_select(0, index))
            steps.append((act, drafts, logq))
            cur = cur.index_put((index,), drafts)
            step += 1
        logqs = read_back_drafts(steps, [i for i, *_ in live], requests, out)
        for i, seq, _, pages in live:
            # Draft s was fed at step s, whose state went to pages[s].
            seq.fed = [(out[i][s - 1], pages[s]) for s in range(1, len(out[i]))]
            # Pages reserved for drafts a request did not need (k counted every one).
            self._release_pages(pages[len(out[i]) :])
        _keep_logq(self.draft_logq, requests, logqs)
        return out

    def _step(
        self, rows: list[tuple], reqs: Sequence[DraftRequest], step: int,
        tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ``step`` of every row (:meth:`_forward`'s rows; a row's tokens None:
        one token each, from the device tensor ``tokens``): rows of one length replay a
        graph step when graphs are on and the rows qualify, the rest run one eager
        forward. Returns the drafts ``[rows]`` and, when some request samples, ``log q
        [rows, vocab]`` (:func:`~hybridserve.drafters.base.draft_choices`), on the
        device: nothing is read back."""
        n = len(rows)
        sampled = any(r.temperature > 0 for r in reqs)
        drafts = torch.empty(n, dtype=torch.long, device=self.device)
        logq = None
        pending = list(range(n))
        if self.graphs is not None:
            groups: dict[int, list[int]] = {}
            for j, row in enumerate(rows):
                groups.setdefault(1 if row[1] is None else len(row[1]), []).append(j)
            for group in groups.values():
                whole = len(group) == n  # one group of every row, in order: no gathers
                index = None if whole else row_index(group, self.device)
                got = self.graphs.replay_rows(
                    [self._graph_row(rows[j]) for j in group],
                    [DraftDraw.of(reqs[j], step) for j in group],
                    tokens if tokens is None or whole else tokens.index_select(0, index),
                )
                if got is None:
                    continue
                if whole:
                    return got
                drafts.index_copy_(0, index, got[0])
                if got[1] is not None:
                    if logq is None:
                        logq = torch.empty(n, got[1].shape[1], dtype=got[1].dtype,
                                           device=self.device)
                    logq.index_copy_(0, index, got[1])
                done = set(group)
                pending = [j for j in pending if j not in done]
        if pending:
            if tokens is not None:
                fed = tokens[pending].tolist()  # the eager forward builds on the host
                rows = [(rows[j][0], [t], *rows[j][2:]) for j, t in zip(pending, fed)]
            else:
                rows = [rows[j] for j in pending]
            logits = self._forward(rows)
            index = row_index(pending, self.device)
            if sampled:
                args = draw_tensors([reqs[j] for j in pending], [step] * len(pending),
                                    self.device)
                chosen, q = draft_choices(logits, *args)
                if logq is None:
                    logq = torch.empty(n, q.shape[1], dtype=q.dtype, device=self.device)
                logq.index_copy_(0, index, q)
            else:
                chosen = torch.argmax(logits, dim=-1)
            drafts.index_copy_(0, index, chosen)
        if sampled and logq is None:
            raise AssertionError("a sampled draft step produced no log q")
        return drafts, logq

    def _graph_row(self, row: tuple) -> DraftRow:
        seq, toks, start, page_in, page_out, extras = row
        q = 1 if toks is None else len(toks)
        outs = {q - 1: page_out}
        outs.update(dict(extras))
        return DraftRow(start, q, seq.blocks, page_in, outs, toks)

    def _admit(self, seq: _Seq, toks: Sequence[int], first: int, point: int, page: int) -> None:
        """Register the full blocks the catch-up completed (true tokens only, never
        written again) and admit the state after token ``point - 1`` (on ``page``) as
        the checkpoint of that prefix. An extra page's reference passes to the index."""
        bs = self.block_size
        for b in range(first // bs, point // bs):
            self.blocks.register(seq.blocks[b], seq.hashes[b], toks[b * bs : (b + 1) * bs])
        self.states.admit(seq.hashes[point // bs - 1], point, page, seq.hashes[: point // bs])
        if page != seq.page:
            self._release_pages([page])

    def _forward(self, rows: list[tuple]) -> torch.Tensor:
        """One packed forward of ``(seq, tokens, first position, page in, page out[,
        extras])`` rows; the state after each row's last token goes to its page out,
        and the state after offset ``o`` to page ``p`` for each ``(o, p)`` of extras.
        Returns the logits ``[rows, vocab]`` at each row's last token."""
        self.counters["draft_forwards"] += 1
        bs = self.block_size
        ids, positions, slots, query_start = [], [], [], [0]
        max_blocks = max(len(seq.blocks) for seq, *_ in rows)
        tables = torch.full((len(rows), max_blocks), -1, dtype=torch.int32)
        out_row, out_off, out_page = [], [], []
        for r, (seq, toks, start, _, page_out, *extras) in enumerate(rows):
            for off, page in [(len(toks) - 1, page_out)] + (extras[0] if extras else []):
                out_row.append(r)
                out_off.append(off)
                out_page.append(page)
            ids += toks
            for pos in range(start, start + len(toks)):
                positions.append(pos)
                slots.append(seq.blocks[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + len(toks))
            tables[r, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        dev = self.device
        batch = ForwardBatch(
            query_start=query_start,
            num_computed=[row[2] for row in rows],
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            context_lens=[row[2] + len(row[1]) for row in rows],
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_in_page=[row[3] for row in rows],
            state_out_row=out_row,
            state_out_offset=out_off,
            state_out_page=out_page,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        hidden = self.model.forward(input_ids, batch, self.caches)
        last = torch.tensor([e - 1 for e in query_start[1:]], dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden[last])

    def check_integrity(self) -> None:
        """Every page reference is a request's (committed or proposal) or a checkpoint's;
        every KV block's count equals the requests holding it."""
        held = [p for s in self._seqs.values() for p in [s.page] + [q for _, q in s.fed] if p >= 0]
        self.states.check_integrity(held)
        self.blocks.check_integrity()
        counts: dict[int, int] = {}
        for s in self._seqs.values():
            for b in s.blocks:
                counts[b] = counts.get(b, 0) + 1
        for block in self.blocks.blocks:
            if block.ref_count != counts.get(block.block_id, 0):
                raise AssertionError(
                    f"draft model KV block {block.block_id}: ref_count {block.ref_count}, "
                    f"holders {counts.get(block.block_id, 0)}"
                )
