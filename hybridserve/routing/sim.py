"""Replicas without a model: the engine's real cache logic on a token trace, in modelled time.

A :class:`SimReplica` runs the real :class:`~hybridserve.engine.scheduler.Scheduler`
(its BlockPool, StateCache, admission, checkpoint placement, eviction and
preemption) and publishes the same cache events an engine does. Only the forward is
missing: the tokens a request "samples" are given in advance (its scripted reply),
and a step takes the time :class:`StepCost` models. Hit rates therefore follow the
engine exactly, because they depend on the token trace and the cache policies, not
on the weights; times are a model, stated by its constants.

Decode rows carry one token and no drafts; their state postprocess decision is the
one docs/state-lifecycle.md gives for a = q = 1: the row's one output page becomes the
request's state, it is also the checkpoint when the new length is on the verify
interval, and the previous state page is released.

:func:`simulate` replays a multi-turn trace (conversations whose next turn arrives a
think time after the previous reply ends) through a :class:`~hybridserve.routing.router.Router`
over N replicas and reports hit rate, TTFT and where every turn went.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

from hybridserve.cache.events import EventLog
from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.engine.request import Request, RequestStatus, SamplingParams
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput
from hybridserve.routing.router import Router


@dataclass(frozen=True, slots=True)
class StepCost:
    """Modelled seconds of one step: ``overhead`` + ``per_token`` per computed token +
    ``per_attended`` per (computed token x context position it attends to)."""

    overhead: float = 0.005
    per_token: float = 40e-6
    per_attended: float = 2e-9

    def seconds(self, sched: SchedulerOutput) -> float:
        t = self.overhead
        for row in sched.rows:
            q, n = row.num_tokens, row.num_computed
            t += self.per_token * q + self.per_attended * q * (n + (q + 1) / 2)
        return t


@dataclass
class Turn:
    """One request of a conversation: its full prompt and its scripted reply."""

    conversation: int
    index: int
    prompt: list[int]
    reply: list[int]


@dataclass
class Conversation:
    turns: list[Turn]
    start: float  # arrival time of the first turn
    think: float  # seconds between a reply's end and the next turn's arrival


def multi_turn_trace(
    num_conversations: int,
    turns: int = 4,
    system_len: int = 96,
    user_len: tuple[int, int] = (24, 72),
    reply_len: tuple[int, int] = (16, 48),
    num_system_prompts: int = 2,
    arrival_rate: float = 4.0,
    think: float = 1.0,
    vocab: int = 32000,
    seed: int = 0,
) -> list[Conversation]:
    """Chat conversations: a shared system prompt (one of ``num_system_prompts``), then
    ``turns`` user messages; turn k+1's prompt is turn k's prompt + reply + a new user
    message, so every turn extends the previous one. Conversations start as a Poisson
    process of ``arrival_rate`` per second; all tokens are fixed here, independent of
    routing."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    systems = [rand(system_len) for _ in range(num_system_prompts)]
    out, t = [], 0.0
    for c in range(num_conversations):
        t += rng.expovariate(arrival_rate)
        history = list(rng.choice(systems))
        conv = []
        for k in range(turns):
            prompt = history + rand(rng.randint(*user_len))
            reply = rand(rng.randint(*reply_len))
            conv.append(Turn(c, k, prompt, reply))
            history = prompt + reply
        out.append(Conversation(conv, t, think * rng.uniform(0.5, 1.5)))
    return out


class SimReplica:
    """The real scheduler of one engine, stepped without a model (module docstring)."""

    def __init__(
        self, cache: CacheConfig, sched: SchedulerConfig, cost: StepCost, num_host_pages: int = 0
    ) -> None:
        self.scheduler = s = Scheduler(sched, cache, num_host_pages=num_host_pages)
        self.events = EventLog().attach(s.blocks, s.states, s.host)
        self.cost = cost
        self.interval = self.scheduler.boundary_interval()
        self.replies: dict[str, list[int]] = {}
        self.busy_until = 0.0
        self._n = 0

    def add(self, request_id: str, prompt: list[int], reply: list[int]) -> None:
        params = SamplingParams(max_tokens=len(reply), temperature=0.0)
        max_len = self.scheduler.config.max_model_len
        self.scheduler.add(Request(request_id, list(prompt), params, self._n, max_model_len=max_len))
        self.replies[request_id] = list(reply)
        self._n += 1

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[float, list[str], list[tuple[str, int]]]:
        """One step. Returns its modelled seconds, the request ids that sampled their
        first token, and (request id, cached prompt tokens) of those that finished."""
        s = self.scheduler
        sched = s.schedule()
        if not sched.rows:
            raise RuntimeError("a simulated replica has work it cannot schedule; enlarge its caches")
        first, done = [], []
        for row in sched.rows:
            req = row.request
            if row.samples:
                if not req.output_token_ids:
                    first.append(req.request_id)
                req.append_output(self.replies[req.request_id][len(req.output_token_ids)])
            if row.is_decode:
                n = row.num_computed
                page = row.state_outputs[n + 1]
                ckpts = [(n + 1, page)] if (n + 1) % self.interval == 0 else []
                s.commit_decode_row(row, 1, page, ckpts, [row.state_in_page] if row.state_in_page >= 0 else [])
            else:
                s.commit_prefill_row(row)
        for row in sched.rows:
            req = row.request
            if req.status is RequestStatus.RUNNING and len(req.output_token_ids) >= req.params.max_tokens:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
                done.append((req.request_id, req.num_cached_tokens))
                del self.replies[req.request_id]
        return self.cost.seconds(sched), first, done


@dataclass
class SimResult:
    policy: str
    num_replicas: int
    hit_rate: float  # cached prompt tokens / prompt tokens, over every turn
    ttft_p50: float
    ttft_p90: float
    makespan: float
    # (conversation, turn) -> replica that served it
    placement: dict[tuple[int, int], int] = field(default_factory=dict)
    # (conversation, turn) -> per replica, the reusable depth the router saw on arrival
    depths: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    per_replica_requests: list[int] = field(default_factory=list)
    routing: dict[str, int] = field(default_factory=dict)

    def sticky_fraction(self) -> float:
        """Share of turns k+1 served by the replica that served turn k."""
        pairs = [(p, self.placement.get((c, k + 1))) for (c, k), p in self.placement.items()]
        pairs = [(a, b) for a, b in pairs if b is not None]
        return sum(a == b for a, b in pairs) / max(1, len(pairs))


def simulate(
    trace: list[Conversation],
    num_replicas: int,
    policy: str,
    cache: CacheConfig,
    sched: SchedulerConfig | None = None,
    cost: StepCost | None = None,
    max_queue: int = 8,
    seed: int = 0,
) -> SimResult:
    """Replay ``trace`` over ``num_replicas`` simulated replicas routed by ``policy``.

    Events reach the router after every step of the replica that emitted them (a
    replica publishes per step). A turn is routed when it arrives; its TTFT is the end
    of the step that sampled its first token minus its arrival."""
    sched = sched or SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=4096)
    cost = cost or StepCost()
    replicas = [SimReplica(cache, sched, cost) for _ in range(num_replicas)]
    router = Router(num_replicas, cache.kv_block_size, policy, max_queue=max_queue, seed=seed)
    # heap of (time, order, kind, payload): arrivals and step ends
    heap: list = []
    order = 0
    for conv in trace:
        heap.append((conv.start, order, "arrive", (conv.turns[0].conversation, 0)))
        order += 1
    heapq.heapify(heap)
    by_id = {conv.turns[0].conversation: conv for conv in trace}
    arrival: dict[str, float] = {}
    ttft: list[float] = []
    placement: dict[tuple[int, int], int] = {}
    depths: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = cached_tokens = 0
    stepping = [False] * num_replicas
    now = 0.0

    def kick(r: int) -> None:
        nonlocal order
        rep = replicas[r]
        if stepping[r] or not rep.has_work():
            return
        seconds, first, done = rep.step()
        stepping[r] = True
        heapq.heappush(heap, (now + seconds, order, "step_end", (r, first, done)))
        order += 1

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == "arrive":
            c, k = payload
            turn = by_id[c].turns[k]
            depths[(c, k)] = router.depths(turn.prompt) if policy == "checkpoint" else []
            r = router.route(turn.prompt).replica
            rid = f"c{c}t{k}"
            arrival[rid] = now
            placement[(c, k)] = r
            replicas[r].add(rid, turn.prompt, turn.reply)
            prompt_tokens += len(turn.prompt)
            kick(r)
            continue
        r, first, done = payload
        stepping[r] = False
        router.apply_events(r, replicas[r].events.drain())
        for rid in first:
            ttft.append(now - arrival[rid])
        for rid, cached in done:
            cached_tokens += cached
            router.finished(r)
            c, k = (int(x) for x in rid[1:].split("t"))
            conv = by_id[c]
            if k + 1 < len(conv.turns):
                heapq.heappush(heap, (now + conv.think, order, "arrive", (c, k + 1)))
                order += 1
        kick(r)
    counts = [0] * num_replicas
    for r in placement.values():
        counts[r] += 1
    ttft.sort()
    return SimResult(
        policy=policy,
        num_replicas=num_replicas,
        hit_rate=cached_tokens / max(1, prompt_tokens),
        ttft_p50=statistics.median(ttft),
        ttft_p90=ttft[int(0.9 * (len(ttft) - 1))],
        makespan=now,
        placement=placement,
        depths=depths,
        per_replica_requests=counts,
        routing={k: v for k, v in router.counters.items() if v},
    )
