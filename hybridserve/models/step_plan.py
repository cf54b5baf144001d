"""The step plan: how every recurrent layer of one forward runs, decided once per step.

The runner describes a step as a :class:`~hybridserve.models.batch.ForwardBatch` (rows,
positions, KV slots, state pages) and the model turns it into a planned batch once,
before the forward (:meth:`HybridForCausalLM.plan_step
<hybridserve.models.hybrid.HybridForCausalLM.plan_step>`); no layer re-derives the plan
and nothing is memoised on the batch. A graph step builds its planned batch directly
over its static device buffers (:mod:`hybridserve.runner.cuda_graph`).

The step's kind (:class:`StepKind`), from the rows and the engine's
:class:`~hybridserve.config.KernelPolicy`:

- ``DECODE``: every row runs the same ``q <= MAX_DECODE_TOKENS`` tokens from a stored
  state (``q = 1`` plain decode, ``1 + d`` uniform verify rows) and no output page is an
  input page: one batched conv update and one batched recurrence, the row length unrolled;
- ``SHORT``: every row is at most ``max_short_tokens`` long (a prompt's tail after a cached
  prefix, decode rows beside a short chunk): one conv that writes its windows and the
  recurrence token by token over rows of any length;
- ``PACKED``: any other step whose pages qualify, when a packed scan is available: one
  variable-length conv and the segmented chunked scan;
- ``ROWS``: the per-row reference path (the oracle; also a step that breaks the page
  rule, which the engine never plans: it gathers every input before writing).

The attention layers read the batch's ``uniform_q`` (their batched decode path) and their
tensors; the recurrent layers read :class:`StatePlan`, whose fields are the index tensors
every recurrent family shares (pages are per step, not per layer or family).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.config import KernelPolicy
from hybridserve.kernels import ssd_chunk_states, ssd_chunked, ssd_two_pass, ssd_varlen
from hybridserve.kernels.conv_varlen import token_rows, window_token_list
from hybridserve.kernels.gdn_varlen import VarlenPlan
from hybridserve.kernels.ssm_chunks import SHORT_ROW_CHUNK
from hybridserve.kernels.transfer import upload_lists as upload

__all__ = ["MAX_DECODE_TOKENS", "StatePlan", "StepKind", "plan_states", "short_triton", "short_walk",
           "uniform_q"]

# Rows longer than this are prefill chunks: the chunked scan serves them better, and the
# decode ops unroll their row length.
MAX_DECODE_TOKENS = 16


class StepKind(enum.Enum):
    DECODE = "decode"
    SHORT = "short"
    PACKED = "packed"
    ROWS = "rows"


@dataclass(frozen=True)
class StatePlan:
    """Index tensors of one step's recurrent layers (on the model's device).

    Shared by every kind but ``ROWS`` (which reads the batch's host lists):

    - ``in_pages [R]`` int32: each row's input page, -1 for the zero state;
    - ``token_out_pages [T]`` int32: the page that receives the state after each packed
      token, -1 for none (``DECODE``: row ``r``'s token ``t`` at ``r * q + t``);
    - ``query_start [R + 1]`` int32 (None for ``DECODE``: rows of ``q`` tokens) and
      ``token_row [T]`` int64 (the row of each token; None for ``DECODE``);
    - ``unclamped [T]`` bool or None: the tokens of one-token rows that continue from a
      stored state (the dt clamp exception of :class:`~hybridserve.models.config.MambaParams`;
      for ``DECODE`` with ``q == 1`` every token is one, and the field is None);
    - ``window_tokens [W]`` int32 (``SHORT`` and ``PACKED``): the tokens that have an
      output page, ascending (:func:`~hybridserve.kernels.conv_varlen.window_token_list`),
      so the conv writes its windows over those tokens only; None where the pages exist
      only on the device (a CUDA-graph step) or ``KernelPolicy.conv_window_slabs`` does
      not take that writer: the conv's full-grid writer.

    ``PACKED`` only: ``init_rows`` / ``init_pages`` (int64) the non-empty rows that start
    from a stored state and their pages, ``out_pages [K]`` (int64) the state requests'
    pages in the batch's order, ``segments`` the scan's cut of the rows, ``scan`` the
    scan primitive. ``triton``: the step's conv and recurrence launches take the Triton
    kernels (else the torch twins). ``prefetch`` (``SHORT`` with ``triton``): the
    recurrence loads each token's operands one token ahead
    (``KernelPolicy.token_prefetch``); ``chunk`` (``SHORT`` with ``triton``): it walks
    the rows in chunks of that many tokens (``KernelPolicy.short_row_chunks``), 0 token
    by token.
    """

    kind: StepKind
    num_rows: int
    q: int = 0
    in_pages: torch.Tensor | None = None
    token_out_pages: torch.Tensor | None = None
    query_start: torch.Tensor | None = None
    token_row: torch.Tensor | None = None
    unclamped: torch.Tensor | None = None
    window_tokens: torch.Tensor | None = None
    triton: bool = False
    prefetch: bool = False
    chunk: int = 0
    init_rows: torch.Tensor | None = None
    init_pages: torch.Tensor | None = None
    out_pages: torch.Tensor | None = None
    segments: ssd_varlen.Segments | None = None
    scan: ssd_varlen.ScanFn | None = None
    # Every kind but DECODE whose pages qualify, when a family runs rows of any length
    # token by token (Gated DeltaNet): the per-token index tensors, with their host
    # values (plan_states(..., varlen=True)).
    varlen: VarlenPlan | None = None

    @property
    def decode_out_pages(self) -> torch.Tensor:
        """``[R, q]`` view of ``token_out_pages`` (``DECODE``)."""
        return self.token_out_pages.view(self.num_rows, self.q)


def packed_scan(policy: KernelPolicy, device: torch.device, compute: torch.dtype):
    """The scan primitive of the packed path here, or None when it is not taken."""
    mode = policy.packed_prefill
    if mode == "reference":
        return ssd_chunked.ssd_scan_fused_reference
    if device.type != "cuda" or compute != torch.float32:
        return None
    if mode in ("auto", "triton"):
        return ssd_two_pass.ssd_scan_two_pass
    if mode == "fused":
        return ssd_chunked.ssd_scan_fused
    if mode == "chunk_states":
        return ssd_chunk_states.ssd_scan_chunk_states
    if mode == "fla" and ssd_varlen.fla_available():
        return ssd_varlen.ssd_scan_varlen_fla
    return None


def short_triton(policy: KernelPolicy, device: torch.device, compute: torch.dtype) -> bool | None:
    """Whether short steps take the short path with the Triton kernels (True), with the
    twins (False), or not at all (None)."""
    mode = policy.short_rows
    if mode == "reference":
        return False
    if mode == "triton" or (mode == "auto" and device.type == "cuda" and compute == torch.float32):
        return True
    return None


def short_walk(policy: KernelPolicy, device: torch.device, triton: bool) -> dict:
    """How a short step's recurrence kernel walks its rows, as :class:`StatePlan` fields
    (``prefetch``, ``chunk``); the twins (``triton`` False) walk token by token. One rule
    for eager short steps and captured ones."""
    return {
        "prefetch": triton and policy.token_prefetch != "off",
        "chunk": SHORT_ROW_CHUNK if triton and policy.short_row_chunks != "off" else 0,
    }


def uniform_q(query_start: Sequence[int]) -> int:
    """``q`` when every row runs the same ``1 <= q <= MAX_DECODE_TOKENS`` tokens, else 0."""
    rows = len(query_start) - 1
    if rows == 0:
        return 0
    q = query_start[1] - query_start[0]
    if not 1 <= q <= MAX_DECODE_TOKENS:
        return 0
    if any(query_start[i + 1] - query_start[i] != q for i in range(rows)):
        return 0
    return q


def plan_states(
    batch,
    policy: KernelPolicy,
    device: torch.device,
    compute: torch.dtype,
    varlen: bool = False,
) -> StatePlan:
    """The :class:`StatePlan` of a (host-described) ``batch``: its kind, then the index
    tensors that kind reads, in one upload (``varlen``: also the per-token tensors of
    every step but ``DECODE`` whose pages qualify)."""
    plan = _plan_states(batch, policy, device, compute, varlen)
    if not varlen or plan.kind is StepKind.DECODE:
        return plan
    if plan.query_start is None:
        if not batch.writes_only_unread_pages() or batch.num_tokens == 0:
            return plan
        out_host = batch.token_out_pages()
        slabs = policy.conv_window_slabs != "off"
        start, pages, outs, *windows = upload(
            [batch.query_start, batch.state_in_page, out_host]
            + ([window_token_list(out_host)] if slabs else []),
            torch.int32, device,
        )
        windows = windows[0] if slabs else None
        token_row = token_rows(start, batch.num_tokens)
    else:
        start, pages, outs, token_row, windows = (
            plan.query_start, plan.in_pages, plan.token_out_pages, plan.token_row,
            plan.window_tokens,
        )
    return dataclasses.replace(plan, varlen=VarlenPlan(
        num_rows=batch.num_rows, query_start=start, in_pages=pages, token_out_pages=outs,
        token_row=token_row, query_start_host=tuple(batch.query_start),
        token_out_pages_host=tuple(batch.token_out_pages()), window_tokens=windows,
    ))


def _plan_states(
    batch, policy: KernelPolicy, device: torch.device, compute: torch.dtype, varlen: bool
) -> StatePlan:
    rows, tokens = batch.num_rows, batch.num_tokens
    qs = list(batch.query_start)
    in_pages = list(batch.state_in_page)
    unread = batch.writes_only_unread_pages()
    q = uniform_q(qs) if policy.uniform_decode else 0
    if q and unread and all(page >= 0 for page in in_pages):
        out = batch.token_out_pages()
        pages, outs = upload([in_pages, out], torch.int32, device)
        return StatePlan(
            StepKind.DECODE, rows, q, in_pages=pages, token_out_pages=outs,
            triton=device.type == "cuda" and compute == torch.float32,
        )
    if not unread or tokens == 0:
        return StatePlan(StepKind.ROWS, rows)
    single = [qs[i] for i in range(rows) if qs[i + 1] - qs[i] == 1 and in_pages[i] >= 0]
    short = short_triton(policy, device, compute)
    longest = max(qs[i + 1] - qs[i] for i in range(rows))
    if short is not None and longest <= policy.max_short_tokens:
        flags = [0] * tokens
        for t in single:
            flags[t] = 1
        out_host = batch.token_out_pages()
        slabs = policy.conv_window_slabs != "off"
        start, pages, outs, unclamped, *windows = upload(
            [qs, in_pages, out_host, flags] + ([window_token_list(out_host)] if slabs else []),
            torch.int32, device,
        )
        windows = windows[0] if slabs else None
        return StatePlan(
            StepKind.SHORT, rows, in_pages=pages, token_out_pages=outs, query_start=start,
            token_row=token_rows(start, tokens),
            unclamped=unclamped != 0 if single else None, window_tokens=windows, triton=short,
            **short_walk(policy, device, short),
        )
    scan = packed_scan(policy, device, compute)
    if scan is None:
        return StatePlan(StepKind.ROWS, rows)
    chunk = ssd_varlen.SCAN_CHUNK if ssd_varlen.chunk_states_supported(scan) else None
    segments = ssd_varlen.plan_segments(
        qs, batch.state_out_row, batch.state_out_offset, device, chunk
    )
    init_rows = [i for i in range(rows) if in_pages[i] >= 0 and qs[i + 1] > qs[i]]
    out_host = batch.token_out_pages()
    slabs = policy.conv_window_slabs != "off"
    start, pages, outs, *windows = upload(
        [qs, in_pages, out_host] + ([window_token_list(out_host)] if slabs else []),
        torch.int32, device,
    )
    windows = windows[0] if slabs else None
    init_r, init_p, req_pages, single_t = upload(
        [init_rows, [in_pages[i] for i in init_rows], batch.state_out_page, single],
        torch.int64, device,
    )
    unclamped = None
    if single:
        unclamped = torch.zeros(tokens, dtype=torch.bool, device=device)
        unclamped[single_t] = True
    return StatePlan(
        StepKind.PACKED, rows, in_pages=pages, token_out_pages=outs, query_start=start,
        token_row=token_rows(start, tokens), unclamped=unclamped, window_tokens=windows,
        triton=device.type == "cuda" and compute == torch.float32,
        init_rows=init_r, init_pages=init_p, out_pages=req_pages, segments=segments, scan=scan,
    )
