"""The scheduler: which requests run this step, with which tokens, caches and pages.

One step
--------
1. Running requests first, oldest first: a request still in prefill gets its next
   chunk (cut to the token budget); a decoding request gets its last sampled token
   plus its draft tokens. If blocks or pages run out, the newest running request is
   preempted (all its caches released, recomputed later from its tokens; a request
   with a seed samples the same tokens again).
2. Waiting requests are admitted in arrival order while budget, seats and caches
   allow. Admission looks up the longest cached prefix h <= len - 1 that has both its
   KV blocks and a state checkpoint (docs/state-lifecycle.md, "Checkpoints") and
   starts there. A request whose prompt shares a longer prefix with one still being
   prefilled waits for the checkpoint that request is asked to leave at their junction.
   A hit whose checkpoint sits on the host tier (:mod:`hybridserve.cache.host_tier`)
   takes a fresh page, queues the copy into it, makes it a device checkpoint again and
   waits one step (the copy overlaps that step's forward); the next step admits the
   request on the device hit. The step's copies travel in ``SchedulerOutput.transfers``.
   A request asking for ``prompt_logprobs`` is admitted without a lookup: it needs
   the logits of every prompt position, which a hit would skip.

Which state each row writes (the pages come from :class:`StateCache`)
-------------------------------------------------------------------
- A prefill row (tokens [n, n + q), all of them known in advance) writes the state
  at its end (the request's new state) and at every checkpoint position inside the
  chunk: grid points, the junction, the prompt end, and the last KV-block boundary
  (kept so that a finished sequence leaves a checkpoint). Positions coincide ->
  one page with several roles, never a copy.
- A decode/verify row (the last token plus d drafts) writes the state after every
  one of its 1 + d tokens, S_0..S_d; which one survives is known only after
  verification, so :mod:`hybridserve.kernels.state_postprocess` decides it.

When pages are short, a row takes fewer rather than waiting or preempting: only the
row's end state is indispensable. Checkpoints are dropped first from the earliest grid
points (the junction and prompt-end positions go last; :meth:`Scheduler._fit_pages`),
drafts from the end, each row keeping one page for every running request still to be
scheduled in the step (:meth:`Scheduler._spare_pages`). So one request needs at most
three pages (its state, its kept boundary state, the page its step writes), and a
configuration that cannot give one ``max_model_len`` request its pages and blocks is
refused at construction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain

from hybridserve.cache.block_pool import BlockPool, extend_hashes
from hybridserve.cache.host_tier import HostCheckpointIndex
from hybridserve.cache.state_cache import StateCache
from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.step import ScheduledRow, SchedulerOutput, Transfers

__all__ = ["ScheduledRow", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the waiting and running queues and every cache reference of every request."""

    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        flops_saved: Callable[[int], float] | None = None,
        num_host_pages: int = 0,
    ) -> None:
        """``flops_saved(length)``: prefill work a checkpoint of that length saves
        (used by the ``flop_aware`` eviction policy). ``num_host_pages``: pages of the
        host checkpoint tier (0: evicted checkpoints are dropped)."""
        self.config = sched
        self.cache_config = cache
        self.block_size = cache.kv_block_size
        self._check_fits_one_request()
        self.blocks = BlockPool(cache.num_kv_blocks, cache.kv_block_size, cache.enable_prefix_caching)
        budget = cache.checkpoint_budget if cache.enable_prefix_caching else 0
        self.states = StateCache(
            cache.num_state_pages, budget, cache.eviction_policy, flops_saved, cache.eviction_alpha
        )
        self.blocks.on_evict.append(self.states.on_block_evicted)
        host_pages = num_host_pages if cache.enable_prefix_caching else 0
        self.host = HostCheckpointIndex(host_pages, cache.eviction_policy, flops_saved, cache.eviction_alpha)
        self.blocks.on_evict.append(self.host.on_block_evicted)
        if self.host.enabled:
            self.states.on_evict = self._offload
        # Waiting requests whose host hit is being restored: request id -> the fresh
        # page (one reference held until the request is admitted or finished).
        self._restoring: dict[str, int] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_seats = list(range(sched.max_num_seqs - 1, -1, -1))
        self.counters = {
            "prefix_queries": 0,
            "prefix_query_tokens": 0,
            "prefix_hit_tokens": 0,
            "prefix_hits": 0,
            "prefix_state_miss_tokens": 0,
            "preemptions": 0,
            "host_hits": 0,
        }

    def _check_fits_one_request(self) -> None:
        """Refuse caches too small for a single request of ``max_model_len`` tokens: it
        would be admitted and then never finish (or never be admitted at all)."""
        cache, max_len = self.cache_config, self.config.max_model_len
        # Computed tokens never reach max_model_len: the last token is sampled, not fed.
        blocks = self._blocks_needed(max_len - 1)
        if cache.num_kv_blocks < blocks:
            raise ValueError(
                f"num_kv_blocks={cache.num_kv_blocks} cannot hold one sequence of "
                f"max_model_len={max_len} ({blocks} blocks of {self.block_size} tokens): "
                "raise num_kv_blocks or lower max_model_len"
            )
        pages = 2 + int(self._keeps_boundary())
        if cache.num_state_pages < pages:
            raise ValueError(
                f"num_state_pages={cache.num_state_pages} cannot run one request: it needs "
                f"{pages} (its state, the page a step writes"
                + (", its kept block-boundary state" if pages > 2 else "")
                + "); raise num_state_pages"
            )

    # ---- queue management --------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark ``req`` finished and release its caches (admitting a final checkpoint)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._drop_restore_hold(req)
        # A failed request, like an aborted one, leaves no checkpoint behind.
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self._admit_boundary_checkpoint(req)
        self._release_caches(req)

    def _release_caches(self, req: Request) -> None:
        self.blocks.release(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        self.states.release([req.state_page, req.boundary_page])
        req.state_page = -1
        req.boundary_page = -1
        req.boundary_len = 0
        if req.seat >= 0:
            self.free_seats.append(req.seat)
            req.seat = -1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_caches(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)

    # ---- checkpoint positions ----------------------------------------------------

    def _checkpoint_worthy(self, req: Request, p: int) -> bool:
        if not self.cache_config.enable_prefix_caching or p % self.block_size:
            return False
        policies = self.cache_config.checkpoint_policies
        if "grid" in policies and p % self.cache_config.state_interval == 0:
            return True
        return p in req.extra_checkpoints

    def _keeps_boundary(self) -> bool:
        return (
            self.cache_config.enable_prefix_caching
            and "finished" in self.cache_config.checkpoint_policies
        )

    def _prefill_outputs(self, req: Request, n: int, q: int) -> list[int]:
        """Prefix lengths in (n, n + q] whose state a prefill row must write."""
        end = n + q
        wanted = {end}
        if self.cache_config.enable_prefix_caching:
            first = (n // self.block_size + 1) * self.block_size
            for p in range(first, end + 1, self.block_size):
                if self._checkpoint_worthy(req, p):
                    wanted.add(p)
            if self._keeps_boundary():
                last_boundary = end // self.block_size * self.block_size
                if last_boundary > n:
                    wanted.add(last_boundary)
        return sorted(wanted)

    # ---- admission ---------------------------------------------------------------

    def _probe(
        self, tokens: list[int], hashes: list[int], touch: bool = True
    ) -> tuple[int, list[int], int, int, int | None]:
        """What the caches hold for ``tokens`` (whose full-block hashes are ``hashes``):
        the longest usable device hit's length, its KV blocks and checkpoint page; the
        length of the longest cached KV prefix (checkpoint or not); and the key of a
        longer hit whose checkpoint is on the host tier (None if there is none).
        ``touch``: mark the checkpoints on the path recently used (an admission does;
        a prediction changes nothing)."""
        bs = self.block_size
        # BlockPool.lookup and the indexes' has() inline, in passes over the path rather
        # than one pass doing all per block: this runs over every block of the prompt
        # (504 of them for an 8k-token prompt's cached prefix).
        index, blocks = self.blocks.hash_to_block, self.blocks.blocks
        hit_blocks: list[int] = []
        for h in hashes:
            block_id = index.get(h)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        # A hit is confirmed by the blocks' tokens (a hash collision costs a miss): all
        # of them compared at once (a registered block holds block_size tokens), block
        # by block only to find where they differ.
        stored = [blocks[b].token_ids for b in hit_blocks]
        if list(chain.from_iterable(stored)) != tokens[: len(stored) * bs]:
            first = next(i for i, t in enumerate(stored) if t != tuple(tokens[i * bs : (i + 1) * bs]))
            del hit_blocks[first:]
        # The deepest device checkpoint on the path, and a host-tier one deeper still.
        device, host = self.states.checkpoints, self.host.checkpoints
        depth, host_key = 0, None
        for i in range(len(hit_blocks) - 1, -1, -1):
            h = hashes[i]
            if h in device:
                depth = i + 1
                break
            if host_key is None and h in host:
                host_key = h
        best_page = -1
        if depth:
            best_page = device[hashes[depth - 1]].page
            if touch:
                # The device checkpoints on the hit path, shallowest first.
                self.states.touch([h for h in hashes[:depth] if h in device])
        return depth * bs, hit_blocks[:depth], best_page, len(hit_blocks) * bs, host_key

    def predict_hit(self, req: Request) -> int:
        """The prompt tokens a waiting ``req`` would take from the caches if it were
        admitted now: the deepest block boundary whose KV blocks are all cached and that
        has a checkpoint, on the device or on the host tier (which admission restores).
        Read only. Admission can find less (evicted meanwhile) or more (a request ahead
        of it writes checkpoints, or it waits for a shared prefill); the block hashes it
        computes are the ones admission would, and are kept on ``req`` for it.

        Cheaper than admission's walk (:meth:`_probe`), which it precedes on every
        request: index membership only, trusting the chained hashes (admission compares
        each hit block's tokens too, so a hash collision could only make the prediction
        differ, never the hit). On an 8,064-token cached prefix it is about a third of
        the probe's time (the token comparison is most of that)."""
        if not self.cache_config.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        tokens = req.all_token_ids
        hashes = self._hashes(req, (len(tokens) - 1) // bs)
        # The cached KV prefix: the leading blocks whose hashes the block index holds.
        cached = self.blocks.hash_to_block
        depth = 0
        for h in hashes:
            if h not in cached:
                break
            depth += 1
        # Its deepest checkpoint, on the device (the probe's best) or on the host tier
        # (one deeper than every device checkpoint, which admission restores).
        device, host = self.states.checkpoints, self.host.checkpoints
        for i in range(depth - 1, -1, -1):
            h = hashes[i]
            if h in device:
                return (i + 1) * bs
            ckpt = host.get(h)
            if ckpt is not None:
                return ckpt.length
        return 0

    def _lookup_prefix(self, req: Request) -> tuple[int, list[int], int, int | None, int]:
        """Longest usable device hit (length h, its KV blocks, checkpoint page), the
        key of a longer host-tier hit and the longest cached KV prefix (the junction,
        where the prompt leaves the cached path, which is recorded as a checkpoint
        position)."""
        tokens = req.all_token_ids
        hashes = self._hashes(req, (len(tokens) - 1) // self.block_size)
        best_len, hit_blocks, best_page, junction, host_key = self._probe(tokens, hashes)
        if junction > best_len and "junction" in self.cache_config.checkpoint_policies:
            req.extra_checkpoints.add(junction)
        return best_len, hit_blocks, best_page, host_key, junction

    # ---- the host tier -----------------------------------------------------------

    def _offload(self, key: int, ckpt) -> None:
        """A device checkpoint is being evicted: keep it on the host tier. A page that a
        queued restore still writes cannot be copied from yet: that one is dropped."""
        if ckpt.page in self.host.restoring_into():
            return
        self.host.offload(key, ckpt.length, ckpt.page, ckpt.prefix_hashes)

    def _start_restore(self, req: Request, key: int) -> bool:
        """Bring host checkpoint ``key`` back into a fresh device page for ``req``
        (which waits a step). False when no device page can be had."""
        if not self.states.can_allocate(1):
            return False
        ckpt, page = self.host.restore(key, lambda: self.states.allocate(1)[0])
        self.states.admit(key, ckpt.length, page, ckpt.prefix_hashes)
        self._restoring[req.request_id] = page
        self.counters["host_hits"] += 1
        return True

    def _drop_restore_hold(self, req: Request) -> None:
        page = self._restoring.pop(req.request_id, None)
        if page is not None:
            self.states.release([page])

    def abandon_transfers(self, transfers: Transfers) -> None:
        """A step's host-tier copies failed (some may not have run): drop the host
        checkpoints its offloads were to fill and the device checkpoints its restores
        were to fill, so that no hit ever reads a page whose data never arrived."""
        filled = {hp for _, hp in transfers.offloads}
        for key, ckpt in list(self.host.checkpoints.items()):
            if ckpt.host_page in filled:
                self.host.drop(key)
        restored = {page for _, page in transfers.restores}
        for key, ckpt in list(self.states.checkpoints.items()):
            if ckpt.page in restored:
                self.states.drop(key)

    def _drain(self, out: SchedulerOutput) -> SchedulerOutput:
        out.transfers = self.host.drain()
        return out

    def _wait_for_shared_prefill(self, req: Request, rows: list[ScheduledRow]) -> bool:
        """In-flight junctions: should ``req`` wait for a prefix being prefilled now?

        When ``req`` shares at least two more KV blocks of its prompt with a running
        request that has not yet computed them than the cache can give it today, the
        shared tokens would be computed twice. Instead, the running request is asked
        to leave a checkpoint where the two prompts part (the junction; added to this
        step's row when the junction falls inside it) and ``req`` waits, in arrival
        order, until that checkpoint exists. Returns True if ``req`` should wait.
        """
        cc = self.cache_config
        if (
            not cc.enable_prefix_caching
            or "junction" not in cc.checkpoint_policies
            or req.num_computed_tokens
            or req.params.prompt_logprobs is not None  # it would not use the checkpoint
        ):
            return False
        bs = self.block_size
        mine = self._hashes(req, (req.num_tokens - 1) // bs)
        cached, _, _, _, _ = self._probe(req.all_token_ids, mine)
        for other in self.running:
            theirs = self._hashes(other, other.num_prompt_tokens // bs)
            shared = 0
            while shared < min(len(mine), len(theirs)) and mine[shared] == theirs[shared]:
                shared += 1
            junction = shared * bs
            if junction < cached + 2 * bs or other.num_computed_tokens >= junction:
                continue
            if self._ensure_checkpoint(other, junction, rows):
                return True
        return False

    def _ensure_checkpoint(self, req: Request, p: int, rows: list[ScheduledRow]) -> bool:
        """Make ``req`` (still short of ``p`` computed tokens) leave a checkpoint at ``p``."""
        row = next((r for r in rows if r.request is req), None)
        in_row = row is not None and row.num_computed < p <= row.num_computed + row.num_tokens
        if in_row and p not in row.state_outputs:
            if not self.states.can_allocate(1):
                return False
            row.state_outputs[p] = self.states.allocate(1)[0]
        req.extra_checkpoints.add(p)
        return True

    def _try_admit(self, req: Request, budget: int) -> tuple[int, list[int]]:
        """Admit ``req`` if caches allow.

        Returns the tokens its first chunk takes (0: not admitted) and the prefix
        lengths whose state that chunk writes.
        """
        caching = self.cache_config.enable_prefix_caching
        # A request asking for prompt logprobs needs the logits of every prompt position
        # (position 0's predicts token 1), so no prefix hit can serve it: it does not
        # read the cache (it still writes checkpoints and blocks others can hit).
        reads_cache = caching and req.params.prompt_logprobs is None
        h, hit_blocks, hit_page, host_key, kv_prefix = 0, [], -1, None, 0
        if caching and req.num_computed_tokens == 0:
            if "prompt_end" in self.cache_config.checkpoint_policies:
                # The prompt's end serves a prompt that extends it; the last boundary
                # before its final token serves the same prompt again (a hit must
                # leave at least one token to compute).
                bs = self.block_size
                for end in (req.num_prompt_tokens // bs * bs, (req.num_prompt_tokens - 1) // bs * bs):
                    if end > 0:
                        req.extra_checkpoints.add(end)
            if reads_cache:
                h, hit_blocks, hit_page, host_key, kv_prefix = self._lookup_prefix(req)
        # One restore per admission: a request that already waited for one takes the
        # device hit it finds now (a longer one may have gone to the host since).
        if (
            host_key is not None
            and req.request_id not in self._restoring
            and self._start_restore(req, host_key)
        ):
            req.extra_checkpoints.clear()
            return 0, []
        q = min(req.num_tokens - h, budget)
        new_blocks = self._blocks_needed(h + q) - len(hit_blocks)
        # Hit blocks on the free queue are taken off it by acquire(): count them as used.
        hit_free = self.blocks.num_free_of(hit_blocks)
        # Hold the hit checkpoint before counting reclaimable pages: it must not be one.
        if hit_page >= 0:
            self.states.incref(hit_page)
        self._drop_restore_hold(req)
        if new_blocks + hit_free > self.blocks.num_free or not self.states.can_allocate(1):
            self.states.release([hit_page])
            req.extra_checkpoints.clear()
            return 0, []
        outputs = self._fit_pages(req, self._prefill_outputs(req, h, q), h + q, reserve=0)
        self.blocks.acquire(hit_blocks)
        req.block_ids = hit_blocks + self.blocks.allocate(new_blocks)
        req.num_registered_blocks = len(hit_blocks)
        req.state_page = hit_page
        req.num_computed_tokens = h
        if reads_cache:
            self.counters["prefix_queries"] += 1
            self.counters["prefix_query_tokens"] += req.num_tokens
            self.counters["prefix_hit_tokens"] += h
            self.counters["prefix_hits"] += int(h > 0)
            # KV blocks were cached beyond the hit, but no checkpoint of the state there.
            self.counters["prefix_state_miss_tokens"] += max(kv_prefix - h, 0)
        if req.num_preemptions == 0:
            req.num_cached_tokens = h
            req.kv_prefix_tokens = max(kv_prefix, h)
        req.seat = self.free_seats.pop()
        req.status = RequestStatus.RUNNING
        return q, outputs

    def _spare_pages(self, want: int, reserve: int) -> int:
        """How many of ``want`` pages a row may take now, keeping ``reserve`` for later
        rows; at least 1 (the caller has checked that one can be allocated)."""
        if self.states.num_free - reserve >= want:
            return want
        spare = self.states.num_free + self.states.num_reclaimable() - reserve
        return max(1, min(want, spare))

    def _fit_pages(self, req: Request, positions: list[int], end: int, reserve: int) -> list[int]:
        """``positions`` (a prefill row's, ending at ``end``) cut to :meth:`_spare_pages`.

        ``end`` (the row's new state) always stays; then the junction and prompt-end
        positions (``req.extra_checkpoints``), then the latest positions: a late
        checkpoint saves more prefill than an early one, and the latest block boundary
        is the one a finished sequence keeps.
        """
        limit = self._spare_pages(len(positions), reserve)
        if len(positions) <= limit:
            return positions
        ranked = sorted(
            positions, key=lambda p: (p == end, p in req.extra_checkpoints, p), reverse=True
        )
        return sorted(ranked[:limit])

    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []

        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.status is not RequestStatus.RUNNING:
                i += 1
                continue
            n = req.num_computed_tokens
            if req.is_prefill:
                q, drafts = min(req.num_tokens - n, budget), 0
            else:
                drafts = min(len(req.draft_token_ids), budget - 1)
                q = 1 + drafts
            need_blocks = self._blocks_needed(n + q) - len(req.block_ids)
            # Preempt only for the row's indispensable page (its end state).
            while need_blocks > self.blocks.num_free or not self.states.can_allocate(1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                i += 1
                continue
            # One page stays for each running request after this one (preemption only
            # cuts self.running's tail, so req is still at index i).
            reserve = len(self.running) - 1 - i
            if req.is_prefill:
                positions = self._fit_pages(req, self._prefill_outputs(req, n, q), n + q, reserve)
            else:
                if drafts:
                    drafts = self._spare_pages(1 + drafts, reserve) - 1
                req.draft_token_ids = req.draft_token_ids[:drafts]
                q = 1 + drafts
                positions = list(range(n + 1, n + q + 1))
                need_blocks = self._blocks_needed(n + q) - len(req.block_ids)
            if need_blocks > 0:
                req.block_ids += self.blocks.allocate(need_blocks)
            rows.append(self._make_row(req, q, drafts, positions, decode=not req.is_prefill))
            budget -= q
            i += 1

        while (
            self.waiting
            and budget > 0
            and len(rows) < self.config.max_num_seqs
            and self.free_seats
            and not preempted
        ):
            req = self.waiting[0]
            if self._wait_for_shared_prefill(req, rows):
                break
            q, positions = self._try_admit(req, budget)
            if q == 0:
                break
            self.waiting.popleft()
            self.running.append(req)
            rows.append(self._make_row(req, q, 0, positions, decode=False))
            budget -= q
        return self._drain(SchedulerOutput(rows=rows, preempted=preempted))

    def schedule_ahead(self, rows: list[ScheduledRow]) -> SchedulerOutput | None:
        """The plain decode step after ``rows`` (plain decode rows of the step in flight,
        one token each), scheduled before that step's tokens reach the host.

        Each row continues from the page its predecessor writes (the state after its one
        token, which a plain decode step always keeps) with one new page and, at a block
        boundary, one new KV block. Nothing is preempted: None when the caches cannot
        take every row (the next step is then scheduled the ordinary way, after the
        tokens are in). A request that the step in flight finishes gets its row's
        result dropped and its page released (:meth:`drop_ahead_row`).
        """
        bs = self.block_size
        # Per row: the blocks its next token needs beyond those it holds
        # (_blocks_needed(num_computed + 2), inline: this runs for every row of every
        # plain decode step).
        extra = [-(-(r.num_computed + 2) // bs) - len(r.request.block_ids) for r in rows]
        if sum(extra) > self.blocks.num_free or not self.states.can_allocate(len(rows)):
            return None
        # Taking every page at once hands out the pages taking them row by row would, in
        # the same order, unless a checkpoint is evicted on the way: for a page (too few
        # free) or for a KV block (a cached block's reuse drops the checkpoints on it,
        # freeing their pages; only with prefix caching, and only where a row takes one).
        batched = self.states.num_free >= len(rows) and (
            not self.cache_config.enable_prefix_caching or max(extra, default=0) <= 0
        )
        pages = self.states.allocate(len(rows)) if batched else None
        out = []
        for i, prev in enumerate(rows):
            req = prev.request
            n = prev.num_computed + 1
            if extra[i] > 0:
                req.block_ids += self.blocks.allocate(extra[i])
            out.append(ScheduledRow(
                request=req, num_computed=n, num_tokens=1, num_drafts=0, samples=True,
                state_in_page=prev.state_outputs[n], is_decode=True,
                state_outputs={n + 1: pages[i] if pages is not None else self.states.allocate(1)[0]},
                ahead=True,
            ))
        return self._drain(SchedulerOutput(rows=out, preempted=[]))

    def drop_ahead_row(self, row: ScheduledRow) -> None:
        """Release what a row scheduled ahead holds when its request finished meanwhile
        (its KV block went with the request's blocks)."""
        self.release_row(row)

    def release_row(self, row: ScheduledRow) -> None:
        """Give back the step's references on ``row``'s pages unless a commit took
        them: a step that failed, a row dropped or not committed (its request failed)."""
        if not row.settled:
            self.states.release(list(row.state_outputs.values()))
            row.settled = True

    def _make_row(
        self, req: Request, q: int, drafts: int, positions: list[int], decode: bool
    ) -> ScheduledRow:
        """A row of ``q`` tokens whose states at ``positions`` go to freshly taken pages."""
        n = req.num_computed_tokens
        pages = self.states.allocate(len(positions))
        return ScheduledRow(
            request=req,
            num_computed=n,
            num_tokens=q,
            num_drafts=drafts,
            samples=n + q >= req.num_tokens,
            state_in_page=req.state_page,
            is_decode=decode,
            state_outputs=dict(zip(positions, pages)),
        )

    # ---- after the forward -------------------------------------------------------

    def commit_prefill_row(self, row: ScheduledRow) -> None:
        """Apply a prefill row's state outputs: all of its tokens are accepted."""
        req = row.request
        end = row.num_computed + row.num_tokens
        kept_boundary = -1
        admits = []
        for p, page in sorted(row.state_outputs.items()):
            if self._checkpoint_worthy(req, p):
                admits.append(self._checkpoint_entry(req, p, page))
            if self._keeps_boundary() and p % self.block_size == 0:
                kept_boundary = p
        # In order, in one call: their prefixes overlap (StateCache.admit_all).
        self.states.admit_all([a for a in admits if a is not None])
        self._advance(req, end, row.state_outputs[end], row.state_outputs.get(kept_boundary, -1), kept_boundary)
        self.states.release(list(row.state_outputs.values()))
        row.settled = True

    def commit_decode_row(
        self,
        row: ScheduledRow,
        num_accepted: int,
        new_state_page: int,
        checkpoints: Sequence[tuple[int, int]],
        released: Sequence[int],
    ) -> None:
        """Apply the state postprocess's decision for a decode/verify row.

        ``new_state_page`` (S_{a-1}) takes over the step's reference as the request's
        state. ``checkpoints`` are the ``(prefix length, page)`` pairs the postprocess
        kept at boundaries crossed by the accepted tokens; the index (or the request's
        boundary page) takes its own reference and the step's is dropped, unless the
        page is also the new state. ``released`` are the unused S_j (the step's
        references) and the previous state page (the request's reference).
        """
        req = row.request
        if checkpoints:  # most decode steps cross no boundary
            kept_len, kept_page = -1, -1
            for p, page in checkpoints:
                if self._checkpoint_worthy(req, p):
                    self._admit_checkpoint(req, p, page)
                if self._keeps_boundary() and p > kept_len:
                    kept_len, kept_page = p, page
            if kept_page >= 0:
                self.states.incref(kept_page)
                self.states.release([req.boundary_page])
                req.boundary_page, req.boundary_len = kept_page, kept_len
            self.states.release([page for _, page in checkpoints if page != new_state_page])
        self.states.release(released)
        req.state_page = new_state_page
        row.settled = True
        req.num_computed_tokens = row.num_computed + num_accepted
        self._register_full_blocks(req)

    def boundary_interval(self) -> int:
        """The boundary interval the state postprocess reports crossings of."""
        if not self.cache_config.enable_prefix_caching:
            return 1 << 30
        if self._keeps_boundary():
            return self.block_size
        return self.cache_config.state_interval

    def _advance(self, req: Request, new_computed: int, state_page: int, boundary_page: int, boundary_len: int) -> None:
        # Take the request's references before dropping the step's (a page may be both).
        self.states.incref(state_page)
        self.states.release([req.state_page])
        req.state_page = state_page
        if boundary_page >= 0:
            self.states.incref(boundary_page)
            self.states.release([req.boundary_page])
            req.boundary_page, req.boundary_len = boundary_page, boundary_len
        req.num_computed_tokens = new_computed
        self._register_full_blocks(req)

    def _admit_checkpoint(self, req: Request, p: int, page: int) -> None:
        entry = self._checkpoint_entry(req, p, page)
        if entry is not None:
            self.states.admit(*entry)

    def _checkpoint_entry(self, req: Request, p: int, page: int) -> tuple | None:
        """The :meth:`StateCache.admit` arguments of ``req``'s checkpoint at ``p`` in
        ``page``; None when there is none to admit."""
        if p > req.num_tokens:
            return None  # tokens of that prefix were dropped (a stop cut the accepted drafts)
        hashes = self._hashes(req, p // self.block_size)
        return hashes[-1], p, page, hashes

    def _admit_boundary_checkpoint(self, req: Request) -> None:
        if req.boundary_page >= 0 and req.boundary_len <= req.num_computed_tokens:
            self._admit_checkpoint(req, req.boundary_len, req.boundary_page)

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The chained hashes of ``req``'s first ``num_blocks`` full blocks (cached)."""
        hashes = req.block_hashes
        if len(hashes) < num_blocks:
            extend_hashes(hashes, req.all_token_ids, self.block_size, num_blocks)
        return hashes[:num_blocks]

    def _register_full_blocks(self, req: Request) -> None:
        if not self.cache_config.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens, req.num_tokens) // bs
        hashes = self._hashes(req, full)
        tokens = req.all_token_ids
        for i in range(req.num_registered_blocks, full):
            self.blocks.register(req.block_ids[i], hashes[i], tokens[i * bs : (i + 1) * bs])
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    # ---- maintenance -------------------------------------------------------------

    def clear_prefix_cache(self) -> None:
        """Drop every checkpoint and forget every free block's hash."""
        self.states.clear()
        self.host.clear()
        self.blocks.clear_cache()

    def check_integrity(self, step_pages: list[int] = (), rows: list[ScheduledRow] = ()) -> None:
        """Raise AssertionError if any cache reference is lost, duplicated or negative.

        ``rows``: rows scheduled and not yet committed. Each may write only KV blocks
        its request owns alone and that are not in the prefix index (the blocks of
        ``[num_computed, num_computed + num_tokens)``), and a row's request has
        registered exactly its full computed blocks (so an admission's hit blocks are
        ``hit // kv_block_size``: none past the checkpoint it starts from).
        """
        bs = self.block_size
        writes = []
        for row in rows:
            req = row.request
            n, q = row.num_computed, row.num_tokens
            last = (n + q - 1) // bs
            if len(req.block_ids) <= last:
                raise AssertionError(
                    f"request {req.request_id} writes token {n + q - 1} but holds "
                    f"{len(req.block_ids)} KV blocks"
                )
            writes += req.block_ids[n // bs : last + 1]
            # A row scheduled ahead runs before its predecessor's tokens are committed.
            full = min(n, req.num_tokens) // bs if self.cache_config.enable_prefix_caching else 0
            if not row.ahead and req.num_registered_blocks != full:
                raise AssertionError(
                    f"request {req.request_id} at {n} computed tokens has "
                    f"{req.num_registered_blocks} registered KV blocks, expected {full}"
                )
        self.blocks.check_integrity(writes)
        holders = list(step_pages) + list(self._restoring.values())
        block_refs = [0] * self.blocks.num_blocks
        for req in self.running:
            holders += [req.state_page, req.boundary_page]
            for b in req.block_ids:
                block_refs[b] += 1
        for block in self.blocks.blocks:
            if block.ref_count != block_refs[block.block_id]:
                raise AssertionError(
                    f"KV block {block.block_id}: ref_count {block.ref_count}, held {block_refs[block.block_id]}"
                )
        for req in self.waiting:
            if req.block_ids or req.state_page >= 0 or req.boundary_page >= 0:
                raise AssertionError(f"waiting request {req.request_id} holds caches")
        self.states.check_integrity(holders)
        self.host.check_integrity()
        waiting_ids = {r.request_id for r in self.waiting}
        if not set(self._restoring) <= waiting_ids:
            raise AssertionError("a restore hold belongs to no waiting request")
        used_seats = [r.seat for r in self.running]
        if len(set(used_seats)) != len(used_seats) or len(used_seats) + len(self.free_seats) != self.config.max_num_seqs:
            raise AssertionError("request seats are lost or shared")
