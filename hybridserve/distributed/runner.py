"""Rank 0's runner and the step plan it broadcasts to the other ranks.

**Why broadcast** (rather than every rank running the same scheduler): the scheduler is
host state that grows with every request (its prefix index, LRU clocks, drafts, grammar
matchers, detokenizers, stop strings), fed by inputs only rank 0 sees (the API's
requests, aborts, arrival times). Keeping ``tp`` copies deterministic would mean
feeding every rank every input in the same order and proving no decision reads a
clock or a hash seed; one bug there and ranks run different pages silently. Instead
the engine (scheduler, drafter, sampler, state postprocess, page bookkeeping) runs on
rank 0 only and sends, per step, exactly what a worker's forward reads: each row's
input token ids, block table, computed count, state input page and output pages, and
the step's host-tier copies (and, for a request asking for prompt logprobs, the prompt
tokens its positions predict: computing those logits is a collective). Page ids, checkpoints and postprocess decisions are then
the same on every rank by construction (there is one of each), and a worker keeps no
request state at all.

A worker runs each step's host-tier copies and forward (the all-reduces of its
row-parallel projections pair with rank 0's) up to the logits, whose vocabulary shards
are all-gathered; it samples nothing and decides nothing: the state postprocess moves
page ids only, so the pages its forward wrote hold the states rank 0's decisions name.

The plan travels over the group's gloo control channel as a few int64 arrays (one
pickle a step). Decode graphs and async scheduling are off under tensor parallelism.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridserve.runner.model_runner import ModelRunner
from hybridserve.step import SchedulerOutput, StepResult, Transfers

# Row header fields in the plan, in order (prompt_logprobs: -1 for None).
_HEADER = ("num_computed", "num_tokens", "num_drafts", "samples", "state_in_page",
           "is_decode", "num_blocks", "num_outputs", "prompt_logprobs", "prompt_len")


def encode_step(sched: SchedulerOutput) -> dict:
    """What a worker needs of ``sched``: int64 arrays (see the module docstring)."""
    header, tokens, blocks, outputs, prompt = [], [], [], [], []
    for row in sched.rows:
        if row.ahead:
            raise RuntimeError("a step scheduled ahead cannot run under tensor parallelism")
        req = row.request
        n, q, d = row.num_computed, row.num_tokens, row.num_drafts
        tokens += req.all_token_ids[n : n + q - d]
        tokens += req.draft_token_ids[:d]
        blocks += req.block_ids
        for p, page in row.state_outputs.items():
            outputs += (p, page)
        k = req.params.prompt_logprobs
        if k is not None:
            # The prompt tokens this row's positions predict (the runner's prompt
            # logprobs compute the logits there, a collective every rank joins).
            prompt += req.prompt_token_ids[n + 1 : n + 1 + q]
        header += (n, q, d, int(row.samples), row.state_in_page, int(row.is_decode),
                   len(req.block_ids), len(row.state_outputs), -1 if k is None else k,
                   len(req.prompt_token_ids))
    t = sched.transfers
    return {
        "header": np.asarray(header, dtype=np.int64),
        "tokens": np.asarray(tokens, dtype=np.int64),
        "blocks": np.asarray(blocks, dtype=np.int64),
        "outputs": np.asarray(outputs, dtype=np.int64),
        "prompt": np.asarray(prompt, dtype=np.int64),
        "offloads": list(t.offloads),
        "restores": list(t.restores),
    }


class _Tokens:
    """A row's input tokens standing in for ``all_token_ids`` at offset ``start``: the
    runner slices ``all_token_ids[n : n + q - d]`` and nothing else."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start = start
        self.tokens = tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start : s.stop - self.start]


class _Prompt(_Tokens):
    """The prompt tokens a row's positions predict, standing in for ``prompt_token_ids``
    (its length is the whole prompt's)."""

    __slots__ = ("length",)

    def __init__(self, start: int, tokens: list[int], length: int) -> None:
        super().__init__(start, tokens)
        self.length = length

    def __len__(self) -> int:
        return self.length


class _PlannedParams:
    __slots__ = ("prompt_logprobs",)

    def __init__(self, prompt_logprobs: int | None) -> None:
        self.prompt_logprobs = prompt_logprobs


_NO_PROMPT_LOGPROBS = _PlannedParams(None)


class _PlannedRequest:
    """The fields of :class:`~hybridserve.step.ScheduledRequest` a worker's forward reads."""

    __slots__ = ("all_token_ids", "draft_token_ids", "block_ids", "params", "prompt_token_ids")

    def __init__(self, all_token_ids: _Tokens, draft_token_ids: list[int],
                 block_ids: list[int], params: _PlannedParams, prompt_token_ids) -> None:
        self.all_token_ids = all_token_ids
        self.draft_token_ids = draft_token_ids
        self.block_ids = block_ids
        self.params = params
        self.prompt_token_ids = prompt_token_ids


class _PlannedRow:
    """The fields of :class:`~hybridserve.step.ScheduledRow` a worker's forward reads (a
    plain slotted object: a worker builds hundreds a step)."""

    __slots__ = ("request", "num_computed", "num_tokens", "num_drafts", "samples",
                 "state_in_page", "is_decode", "state_outputs")

    def __init__(self, request, n, q, d, samples, state_in, is_decode, outputs) -> None:
        self.request = request
        self.num_computed = n
        self.num_tokens = q
        self.num_drafts = d
        self.samples = samples
        self.state_in_page = state_in
        self.is_decode = is_decode
        self.state_outputs = outputs


def decode_step(plan: dict) -> SchedulerOutput:
    """The worker's :class:`SchedulerOutput` of an :func:`encode_step` plan."""
    header = plan["header"].reshape(-1, len(_HEADER)).tolist()
    tokens = plan["tokens"].tolist()
    blocks = plan["blocks"].tolist()
    outputs = plan["outputs"].tolist()
    prompt = plan["prompt"].tolist()
    rows = []
    t = b = o = w = 0
    for n, q, d, samples, state_in, is_decode, nb, no, k, length in header:
        toks = tokens[t : t + q]
        params, window = _NO_PROMPT_LOGPROBS, None
        if k >= 0:
            width = len(prompt[w : w + q][: max(0, length - n - 1)])
            params, window = _PlannedParams(k), _Prompt(n + 1, prompt[w : w + width], length)
            w += width
        req = _PlannedRequest(_Tokens(n, toks[: q - d]), toks[q - d :], blocks[b : b + nb],
                              params, window)
        outs = dict(zip(outputs[o : o + 2 * no : 2], outputs[o + 1 : o + 2 * no : 2]))
        rows.append(_PlannedRow(req, n, q, d, samples, state_in, is_decode, outs))
        t, b, o = t + q, b + nb, o + 2 * no
    transfers = Transfers([tuple(x) for x in plan["offloads"]], [tuple(x) for x in plan["restores"]])
    return SchedulerOutput(rows, transfers=transfers)


class TensorParallelRunner(ModelRunner):
    """Rank 0's :class:`ModelRunner`: before each step it runs, it broadcasts the step's
    plan, so every worker runs the same forward beside it. ``group``: the
    :class:`~hybridserve.distributed.group.TensorGroup`; ``workers``: the processes of
    ranks 1.. (joined by :meth:`close`). The constructor sends the workers the cache
    sizes (``allocate``: the arguments of
    :meth:`~hybridserve.models.base.CacheSpec.allocate`, ``host_pages``: the host tier's
    pages, 0 for none), which they allocate in their own shapes."""

    def __init__(self, *args, group, workers=(), allocate: dict, host_pages: int = 0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.workers = list(workers)
        self._in_step = False
        self._closed = False
        self.group.broadcast_object(("caches", {"allocate": allocate, "host_pages": host_pages,
                                                "kv_block_size": self.block_size,
                                                "max_num_seqs": self.max_num_seqs}))

    def enable_decode_graphs(self, *args, **kwargs):
        raise ValueError("decode graphs do not run under tensor_parallel_size > 1 yet "
                         "(leave enforce_eager unset or True)")

    def execute(self, sched: SchedulerOutput, overlap=None) -> StepResult:
        self._send(("step", encode_step(sched)))
        self._in_step = True
        try:
            return super().execute(sched, overlap)
        finally:
            self._in_step = False

    def run_transfers(self, sched: SchedulerOutput) -> None:
        if not self._in_step and sched.transfers:
            # A step of host-tier copies only (the engine calls this directly).
            t = sched.transfers
            self._send(("transfers", {"offloads": list(t.offloads), "restores": list(t.restores)}))
        super().run_transfers(sched)

    def gather_state_pages(self, pages: list[int]) -> list[dict[int, dict[str, torch.Tensor]]]:
        """Every rank's shard of state ``pages`` (per rank: recurrent layer -> tensor name
        -> ``[len(pages), ...]`` on the CPU), in rank order (tests, debugging)."""
        self._send(("read_pages", list(pages)))
        return self.group.all_gather_object(read_pages(self.caches, pages))

    def _send(self, message: tuple) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel workers were shut down")
        self.group.broadcast_object(message)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they leave their loop and exit) and wait for them."""
        if self._closed:
            return
        self._closed = True
        try:
            self.group.broadcast_object(("stop", None))
        finally:
            self.group.close()
            for proc in self.workers:
                proc.join(timeout_s)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)


def read_pages(caches, pages: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's state tensors at ``pages``, copied to the CPU."""
    index = torch.tensor(pages, dtype=torch.long)
    return {
        layer: {name: t.index_select(0, index.to(t.device)).cpu() for name, t in tensors.items()}
        for layer, tensors in caches.states.items()
    }
