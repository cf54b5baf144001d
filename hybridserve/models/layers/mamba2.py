"""Mamba2 mixer against :class:`~hybridserve.models.batch.ForwardBatch` (torch reference path).

Per row: in_proj -> split (z, xBC, dt) -> causal depthwise conv starting from the row's
conv window -> SSD scan starting from the row's SSM state -> D skip -> grouped gated
RMSNorm -> out_proj. The row's initial state is page ``state_in_page[i]`` (zeros for
-1); every requested ``(offset, page)`` gets the conv window and SSM state *after* the
row's token at that offset (see :mod:`hybridserve.models.batch`).

All initial states are gathered before any page is written, so the result does not
depend on the order rows are processed in even if a caller broke the "never write a
page you read" rule.

The path of a step is decided once, by the step plan
(:mod:`hybridserve.models.step_plan`), and read from ``batch.states``:

- ``DECODE`` (every row the same few tokens from a stored state: plain decode, uniform
  verify rows): one batched conv update and one batched recurrence
  (:mod:`hybridserve.kernels.mamba_decode`) that read the rows' pages and write the
  requested states to their output pages; on the Triton kernels both in one launch
  (``conv_ssm_update``, for steps of at most ``KernelPolicy.fused_decode_max_rows`` rows, unless
  ``KernelPolicy.fused_decode`` is off);
- ``SHORT`` (rows all short: the tail of a prompt after a cached prefix, decode rows beside
  a short chunk): the same recurrence over rows of any length, after one conv launch that
  also writes the requested windows; no host read;
- ``PACKED`` (every other step, on CUDA with fla-core and a float32 scan, or with the
  twin scan where the policy asks): all rows at once through one variable-length conv that
  writes the requested windows (:mod:`hybridserve.kernels.conv_varlen`) and the segmented
  varlen scan of :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill`;
- ``ROWS``: the per-row path above, the oracle.

The plan also says whether the launches take the Triton kernels or their torch twins
(``batch.states.triton``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.config import KernelPolicy
from hybridserve.kernels import mamba_decode, ssd_varlen
from hybridserve.kernels.conv1d import causal_conv1d_reference
from hybridserve.kernels.conv_varlen import conv_varlen, conv_varlen_reference
from hybridserve.kernels.ssd import discretize_dt, ssd_chunked_reference, ssd_step_reference
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.config import MambaParams
from hybridserve.models.layers.norm import GatedRMSNorm
from hybridserve.models.layers.recurrent import RecurrentLayer, StateTensor
from hybridserve.models.step_plan import StatePlan, StepKind


class Mamba2Mixer(RecurrentLayer):
    """The Mamba2 family (:class:`~hybridserve.models.layers.recurrent.RecurrentLayer`).
    Module names and shapes match the Hugging Face checkpoints (``in_proj``, ``conv1d``,
    ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``)."""

    family = "mamba2"

    def __init__(
        self, hidden_size: int, p: MambaParams, policy: KernelPolicy | None = None
    ) -> None:
        super().__init__()
        self.p = p
        policy = policy or KernelPolicy()
        self.in_proj = nn.Linear(
            hidden_size, p.intermediate_size + p.conv_dim + p.n_heads, bias=p.proj_bias
        )
        self.conv1d = nn.Conv1d(
            p.conv_dim,
            p.conv_dim,
            p.d_conv,
            groups=p.conv_dim,
            bias=p.conv_bias,
            padding=p.d_conv - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(p.n_heads))
        self.A_log = nn.Parameter(torch.zeros(p.n_heads))
        self.D = nn.Parameter(torch.ones(p.n_heads))
        self.norm = GatedRMSNorm(p.intermediate_size, p.n_groups, p.norm_eps, policy.norms)
        # Uniform steps on the Triton kernels: conv and recurrence in one launch (the fused
        # kernel takes conv widths 2 to 4, every Mamba2 checkpoint's).
        self._fused_decode = policy.fused_decode and 2 <= p.d_conv <= 4
        self._fused_decode_max_rows = policy.fused_decode_max_rows
        self.out_proj = nn.Linear(p.intermediate_size, hidden_size, bias=p.proj_bias)

    def state_tensors(self) -> tuple[StateTensor, ...]:
        """One page: the conv window (model dtype) and the SSM state (state dtype)."""
        p = self.p
        return (
            StateTensor("conv", (p.conv_dim, p.d_conv - 1), "model"),
            StateTensor("ssm", (p.n_heads, p.head_dim, p.d_state), "state"),
        )

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> ``[T, hidden]``; writes the requested states to their pages
        of ``states["conv"]`` and ``states["ssm"]``."""
        conv_cache, ssm_cache = states["conv"], states["ssm"]
        p = self.p
        zxbcdt = self.in_proj(h)
        z, xbc, dt = zxbcdt.split([p.intermediate_size, p.conv_dim, p.n_heads], dim=-1)
        weight = self.conv1d.weight[:, 0, :]
        bias = self.conv1d.bias
        # float32 at least: the scan and its states are kept in float32 even for bf16 weights.
        compute = torch.promote_types(h.dtype, torch.float32)
        A = self._decay_rates(compute)
        gs = p.n_groups * p.d_state

        plan = batch.states
        if plan is None:
            raise ValueError("a Mamba layer needs a planned batch (model.plan_step)")
        if plan.kind is StepKind.DECODE:
            y = self._decode_rows(xbc, dt, A, plan, conv_cache, ssm_cache)
            # The cast to the weights' dtype happens inside the norm's single pass.
            return self.out_proj(self.norm(y.to(compute), z, out_dtype=h.dtype))
        if plan.kind is StepKind.SHORT:
            y = self._short_rows(xbc, dt, A, plan, conv_cache, ssm_cache)
            return self.out_proj(self.norm(y, z, out_dtype=h.dtype))
        if plan.kind is StepKind.PACKED:
            y = self._prefill_rows(xbc, dt, A, plan, conv_cache, ssm_cache)
            return self.out_proj(self.norm(y, z, out_dtype=h.dtype))

        initial = [
            (conv_cache[page], ssm_cache[page]) if page >= 0 else (None, None)
            for page in batch.state_in_page
        ]
        writes: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        y = torch.empty(h.shape[0], p.intermediate_size, dtype=compute, device=h.device)
        for i in range(batch.num_rows):
            s, e = batch.query_start[i], batch.query_start[i + 1]
            q = e - s
            if q == 0:
                continue
            outputs = batch.state_outputs_of(i)
            offsets = [off for off, _ in outputs]
            conv_in, ssm_in = initial[i]
            xbc_i, windows = causal_conv1d_reference(
                xbc[s:e], weight, bias, conv_in, p.activation, offsets
            )
            x, B, C = xbc_i.split([p.intermediate_size, gs, gs], dim=-1)
            x = x.reshape(q, p.n_heads, p.head_dim)
            B = B.reshape(q, p.n_groups, p.d_state)
            C = C.reshape(q, p.n_groups, p.d_state)
            # A one-token continuation takes the per-token recurrent step, as the reference
            # implementation's decode does (which also skips the dt clamp there).
            single = q == 1 and ssm_in is not None
            limit = p.time_step_limit
            if single and not p.clamp_dt_in_single_token_step:
                limit = None
            # float32 at least, whatever the activations' dtype (mamba_decode, Numerics).
            dt_i = discretize_dt(dt[s:e].to(compute), self.dt_bias.to(compute), limit)
            if single:
                y0, state = ssd_step_reference(x[0], dt_i[0], A, B[0], C[0], self.D, ssm_in)
                y_i = y0[None]
                states = state[None].expand(len(offsets), *state.shape)
            else:
                y_i, states = ssd_chunked_reference(
                    x, dt_i, A, B, C, p.chunk_size, self.D, ssm_in, offsets
                )
            y[s:e] = y_i.reshape(q, -1)
            for (_, page), window, state in zip(outputs, windows, states):
                writes.append((page, window, state))
        for page, window, state in writes:
            conv_cache[page] = window.to(conv_cache.dtype)
            ssm_cache[page] = state.to(ssm_cache.dtype)
        return self.out_proj(self.norm(y, z, out_dtype=h.dtype))

    def _decay_rates(self, dtype: torch.dtype) -> torch.Tensor:
        """``A = -exp(A_log)`` in ``dtype``, computed once per weights: a decode step would
        otherwise spend a cast and two elementwise kernels per layer on it. Recomputed
        when ``A_log`` changes (its version counter moves on every in-place write, as
        loading weights does) or moves."""
        key = (self.A_log._version, self.A_log.data_ptr(), self.A_log.device, dtype)
        cached = self.__dict__.get("_A_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, -torch.exp(self.A_log.detach().to(dtype)))
            self.__dict__["_A_cache"] = cached
        return cached[1]

    def _split_heads(
        self, xbc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output ``[T, conv_dim]`` as ``x [T, H, P]``, ``B, C [T, G, N]`` (views of
        column slices: rows keep the conv output's stride)."""
        p = self.p
        t = xbc.shape[0]
        gs = p.n_groups * p.d_state
        x, B, C = xbc.split([p.intermediate_size, gs, gs], dim=-1)
        return (x.view(t, p.n_heads, p.head_dim), B.view(t, p.n_groups, p.d_state),
                C.view(t, p.n_groups, p.d_state))

    def _decode_rows(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        plan: StatePlan,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The fast path of a uniform step: ``[T, intermediate]`` scan output (compute dtype)."""
        p = self.p
        t = xbc.shape[0]
        weight = self.conv1d.weight[:, 0, :]
        # Triton on CUDA (float32 recurrence); the torch twin elsewhere, and for float64.
        fast = plan.triton
        # The reference's single-token step skips the dt clamp (see MambaParams); rows of
        # several tokens take the chunked scan there, which clamps.
        limit = p.time_step_limit
        if plan.q == 1 and not p.clamp_dt_in_single_token_step:
            limit = None
        if fast and self._fused_decode and plan.num_rows <= self._fused_decode_max_rows:
            # One launch: the raw projection's xBC and dt (column slices, no copies) in,
            # the recurrence's output out; windows and states to their pages.
            y = mamba_decode.conv_ssm_update(
                xbc,
                dt,
                weight.contiguous(),
                self.conv1d.bias,
                A,
                self.D,
                conv_cache,
                ssm_cache,
                plan.in_pages,
                plan.decode_out_pages,
                p.activation,
                dt_bias=self.dt_bias,
                time_step_limit=limit,
            )
            return y.reshape(t, p.intermediate_size)
        conv = mamba_decode.conv_decode_update if fast else mamba_decode.conv_decode_update_reference
        ssm = mamba_decode.ssm_update if fast else mamba_decode.ssm_update_reference
        xbc = conv(
            # The kernel takes rows at any stride (a column slice of the projection, no
            # copy); the twin views rows of tokens.
            xbc if fast else xbc.contiguous(),
            weight.contiguous(),
            self.conv1d.bias,
            conv_cache,
            plan.in_pages,
            plan.decode_out_pages,
            p.activation,
        )
        x, B, C = self._split_heads(xbc)
        # The projection's raw dt: the recurrence discretises it in float32 itself.
        y = ssm(
            x,
            dt if fast else dt.contiguous(),
            A,
            B,
            C,
            self.D,
            ssm_cache,
            plan.in_pages,
            plan.token_out_pages,
            dt_bias=self.dt_bias,
            time_step_limit=limit,
        )
        return y.reshape(t, p.intermediate_size)

    def _short_rows(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        plan: StatePlan,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The short-row path of a step: ``[T, intermediate]`` scan output (compute dtype).
        Both launches read the rows' input pages and write only output pages, which no row
        reads (docs/state-lifecycle.md), so they need no gather beforehand."""
        p = self.p
        t = xbc.shape[0]
        fast = plan.triton
        ssm = mamba_decode.ssm_update if fast else mamba_decode.ssm_update_reference
        x, B, C = self._packed_conv(xbc, plan, conv_cache, fast)
        # The projection's raw dt (discretised in float32 by the recurrence); as per row,
        # one-token continuation rows skip the clamp unless the model asks for it.
        y = ssm(
            x,
            dt if fast else dt.contiguous(),
            A,
            B,
            C,
            self.D,
            ssm_cache,
            plan.in_pages,
            plan.token_out_pages,
            plan.query_start,
            dt_bias=self.dt_bias,
            time_step_limit=p.time_step_limit,
            unclamped=None if p.clamp_dt_in_single_token_step else plan.unclamped,
            prefetch=plan.prefetch,
            chunk=plan.chunk,
        )
        return y.reshape(t, p.intermediate_size).to(A.dtype)

    def _packed_conv(
        self,
        xbc: torch.Tensor,
        plan: StatePlan,
        conv_cache: torch.Tensor,
        fast: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv of a packed step (the Triton kernel when ``fast``, else its twin), which
        also writes the window after every token with a page in ``plan.token_out_pages``:
        ``x [T, H, P]``, ``B, C [T, G, N]``."""
        p = self.p
        conv = conv_varlen if fast else conv_varlen_reference
        # Without the window-token list (a graph step, or the slab writer not taken) a
        # step that asks for no state asks for no window: the conv then skips the
        # full-grid writer. With it, an empty list launches no writer.
        windows = (plan.window_tokens is not None or plan.out_pages is None
                   or plan.out_pages.numel() > 0)
        xbc = conv(
            # The kernel takes rows at any stride (a column slice of the projection).
            xbc if fast else xbc.contiguous(),
            self.conv1d.weight[:, 0, :].contiguous(),
            self.conv1d.bias,
            conv_cache,
            plan.query_start,
            plan.in_pages,
            p.activation,
            plan.token_row,
            out_pages=plan.token_out_pages if windows else None,
            window_tokens=plan.window_tokens if windows else None,
        )
        return self._split_heads(xbc)

    def _prefill_rows(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        plan: StatePlan,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The packed path of any step: ``[T, intermediate]`` scan output (compute dtype)."""
        p = self.p
        t = xbc.shape[0]
        compute = A.dtype
        # The initial SSM states are gathered before the scan's states are written. The
        # conv writes its windows itself: no output page is an input page (the plan).
        initial = torch.zeros(
            len(plan.in_pages), *ssm_cache.shape[1:], dtype=compute, device=xbc.device
        )
        initial.index_copy_(
            0, plan.init_rows, ssm_cache.index_select(0, plan.init_pages).to(compute)
        )
        # Triton on CUDA (float32 accumulation); the torch twin elsewhere, and for float64.
        # The raw dt goes to the scan, which discretises it (a fused scan: in float32,
        # inside its kernel; a plain one: in the compute dtype before it) with the per-row
        # clamp exception of the per-row path.
        x, B, C = self._packed_conv(xbc, plan, conv_cache, plan.triton)
        direct = {}
        if ssd_varlen.is_fused(plan.scan) and ssm_cache.is_contiguous():
            direct = {"out_cache": ssm_cache, "out_pages": plan.out_pages}
        y, states = ssd_varlen.ssd_prefill(
            x,
            dt,
            A,
            B,
            C,
            self.D,
            initial,
            plan.segments,
            plan.scan,
            dt_bias=self.dt_bias,
            time_step_limit=p.time_step_limit,
            unclamped=None if p.clamp_dt_in_single_token_step else plan.unclamped,
            # A fused scan stores the states straight into their pages (no copy after).
            **direct,
        )
        if states is not None:
            ssm_cache[plan.out_pages] = states.to(ssm_cache.dtype)
        return y.reshape(t, p.intermediate_size)
