"""Gated DeltaNet mixer (Qwen3.5 / Qwen3.6 / Qwen3-Next ``linear_attn``) against
:class:`~hybridserve.models.batch.ForwardBatch`.

Per token: projections -> ``qkv`` (q, k, v concatenated: the conv's channels), the output
gate ``z [Hv, Dv]``, ``b`` and ``a [Hv]`` -> causal depthwise conv with SiLU over ``qkv``
(no bias) -> q and k L2-normalised per head (q also scaled by ``Dk ** -0.5``) ->
``beta = sigmoid(b)``, log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (both in
float32 at least, :func:`~hybridserve.kernels.gdn.gdn_gates`; the decode and packed-rows
kernels compute them from the raw ``a, b`` themselves) -> the gated delta rule (:mod:`hybridserve.kernels.gdn`; value head ``h`` reads key head
``h // (Hv // Hk)``) -> per-value-head RMSNorm times ``silu(z)`` -> ``out_proj``.

State contract (the same as Mamba2's, :mod:`hybridserve.models.batch`): every GDN layer
owns ``conv_state [num_state_pages, conv_dim, d_conv - 1]`` (the last ``d_conv - 1`` conv
*inputs*, oldest first, in the model dtype; ``conv_dim = 2 * Hk * Dk + Hv * Dv``) and
``ssm_state [num_state_pages, Hv, Dk, Dv]`` (the recurrent state, in ``ssm_state_dtype``,
float32 by default), in the same page ids as every other recurrent layer. Row ``i`` starts
from page ``state_in_page[i]`` (-1: zeros) and writes the conv window and the state after
each requested offset to its page. The recurrent state is rounded to the page dtype after
every token (see :mod:`hybridserve.kernels.gdn`), so a state read from any page equals the
state an uninterrupted run carries at that position: prefix-cache checkpoints, verify
rows' per-position pages and preemption compose exactly, in bfloat16 pages too.

All initial states are gathered before any page is written, so row order cannot matter
even for a caller that breaks the "never write a page you read" rule.

Decode fast path: when every row of the step runs the same few tokens from a stored state
(plain decode, uniform verify rows: the step plan's ``DECODE`` kind),
all rows go through one batched conv update (Mamba2's) and one paged delta-rule update
(:mod:`hybridserve.kernels.gdn_decode`) that read the rows' pages and write each requested
position's state to its own page: Triton kernels on CUDA, their torch twins elsewhere.
Packed-rows path: every other step on CUDA (float32 compute) runs all rows in two launches
per layer, the variable-length conv that writes the requested windows
(:func:`~hybridserve.kernels.conv_varlen.conv_varlen`) and the token-by-token delta rule
over rows of any length that writes the requested states
(:mod:`hybridserve.kernels.gdn_varlen`). ``KernelPolicy.gdn_rows`` selects it (:func:`packed_rows_mode`); ``"reference"``
runs the same orchestration with the torch twins on any device (how the CPU tests cover
it). The per-row path above stays the default elsewhere: it is the oracle.

Weight names follow each architecture's checkpoints: Qwen3.5 has ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next fuses them into ``in_proj_qkvz``
and ``in_proj_ba``, laid out per key head (``[q_j, k_j, v_j, z_j]`` of the ``r`` value
heads of key head ``j``, and ``[b_j, a_j]``); both have ``conv1d``, ``dt_bias``,
``A_log``, ``norm`` and ``out_proj``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.config import KernelPolicy
from hybridserve.kernels import gdn_chunked, gdn_decode, gdn_varlen, mamba_decode
from hybridserve.kernels.conv1d import causal_conv1d_reference
from hybridserve.kernels.conv_varlen import conv_varlen, conv_varlen_reference
from hybridserve.kernels.gdn import gated_delta_rule_reference, gdn_gates, l2_normalize
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.config import GDNParams
from hybridserve.models.layers.recurrent import RecurrentLayer, StateTensor
from hybridserve.models.step_plan import StatePlan, StepKind

# Rows up to this many tokens are launch-bound: the token-by-token kernel serves them
# (as Mamba2's short rows do).
FLA_MIN_TOKENS = 512


def packed_rows_mode(
    mode: str, device: torch.device, compute: torch.dtype
) -> str | None:
    """``"kernel"``, ``"fla"``, ``"twin"``, ``"chunked"`` or None (the per-row path) here,
    for ``KernelPolicy.gdn_rows`` = ``mode``: the path of a step that is not a uniform
    decode step. ``"auto"``: the packed-rows kernels (:mod:`hybridserve.kernels.gdn_varlen`)
    on CUDA when the compute dtype is float32, the per-row path otherwise; ``"reference"``:
    the packed-rows orchestration with the torch twins, on any device (tests);
    ``"triton"``: the packed-rows kernels on any device (the CPU interpreter in tests);
    ``"chunked"``: the same with the chunked form and its chunk states
    (:mod:`hybridserve.kernels.gdn_chunked`, the twin of the fla-core prefill; bfloat16
    state pages keep the token-by-token twin); ``"fla"``: on CUDA, steps with a row longer
    than :data:`FLA_MIN_TOKENS` take fla-core's chunked delta rule, the others the
    packed-rows kernels; ``"off"``: the per-row path everywhere.

    fla-core's rule stays opt-in: on the H200 it was 2.2x (8 x 4,096 tokens) to 4.4x
    (1 x 4,096) faster a Qwen3.6-27B layer than the token kernel, but 1.8e-3 from it with
    float32 inputs (its dots run in TF32), so its checkpoints are not the states a cold
    run of the token kernel reaches (``benchmarks/results/gdn_kernels.json``)."""
    if mode == "reference":
        return "twin"
    if mode == "triton":
        return "kernel"
    if mode == "chunked":
        return "chunked"
    if mode == "fla" and device.type == "cuda" and compute == torch.float32:
        return "fla" if gdn_chunked.fla_chunk_scan_available() else "kernel"
    if mode in ("auto", "fla"):
        return "kernel" if device.type == "cuda" and compute == torch.float32 else None
    if mode != "off":
        raise ValueError(
            f"kernel_policy.gdn_rows must be 'auto', 'triton', 'reference', 'chunked', 'fla' "
            f"or 'off', got {mode!r}"
        )
    return None


def short_rows_on_device(
    policy, device: torch.device, compute: torch.dtype, tokens: int
) -> bool:
    """Whether a ``SHORT`` step whose rows are at most ``tokens`` long runs this family's
    packed-rows path from device values only (the step's :class:`~hybridserve.kernels.
    gdn_varlen.VarlenPlan` without host pages), so a CUDA graph can replay it: the
    token-by-token kernels or their twins do; the chunked prefill (``"chunked"``, and
    ``"fla"`` past :data:`FLA_MIN_TOKENS`) plans from host pages, and the per-row path
    (``"off"``, or ``"auto"`` off CUDA) reads the batch's host lists."""
    mode = packed_rows_mode(policy.gdn_rows, device, compute)
    return mode in ("kernel", "twin") or (mode == "fla" and tokens <= FLA_MIN_TOKENS)


class GatedHeadRMSNorm(nn.Module):
    """GDN output norm: ``weight * rms_norm(x)`` per value head, then times ``silu(gate)``.

    The norm runs *before* the gate (unlike Mamba2's :class:`GatedRMSNorm
    <hybridserve.models.layers.norm.GatedRMSNorm>`); the weight (plain, not zero-centred)
    multiplies the normalised value cast back to the input dtype.
    """

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x, gate [..., head_dim]`` -> ``x``'s dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(RecurrentLayer):
    """The Gated DeltaNet family (:class:`~hybridserve.models.layers.recurrent.RecurrentLayer`;
    see the module docstring). Parameter names and shapes match the checkpoints."""

    family = "gated_deltanet"

    def __init__(
        self, hidden_size: int, p: GDNParams, policy: KernelPolicy | None = None
    ) -> None:
        super().__init__()
        self.p = p
        self.policy = policy or KernelPolicy()
        hv = p.num_value_heads
        if p.fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * p.key_dim + 2 * p.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, p.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, p.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, hv, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, hv, bias=False)
        self.conv1d = nn.Conv1d(
            p.conv_dim, p.conv_dim, p.d_conv, groups=p.conv_dim, bias=False, padding=p.d_conv - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedHeadRMSNorm(p.value_head_dim, p.norm_eps)
        self.out_proj = nn.Linear(p.value_dim, hidden_size, bias=False)

    def project(
        self, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [T, hidden]`` -> ``qkv [T, conv_dim]``, ``z [T, Hv, Dv]``, ``b, a [T, Hv]``."""
        p = self.p
        t = h.shape[0]
        hk, hv, dk, dv = p.num_key_heads, p.num_value_heads, p.key_head_dim, p.value_head_dim
        if not p.fused_projections:
            z = self.in_proj_z(h).view(t, hv, dv)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        r = hv // hk
        qkvz = self.in_proj_qkvz(h).view(t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(h).view(t, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, hv, dv), b.reshape(t, hv), a.reshape(t, hv)

    def gates(
        self, b: torch.Tensor, a: torch.Tensor, compute: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(beta, g)`` in ``compute``: ``sigmoid(b)`` and ``-exp(A_log) * softplus(a +
        dt_bias)``, both computed in ``compute`` (float32 for a bfloat16 model, where the
        reference takes the sigmoid in bfloat16: the kernels' arithmetic, on every path)."""
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias, compute)
        return beta, g

    def split_qkv(
        self, qkv: torch.Tensor, compute: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[T, conv_dim]`` -> ``q, k [T, Hk, Dk]`` (normalised, q scaled) and
        ``v [T, Hv, Dv]``, in ``compute``."""
        p = self.p
        t = qkv.shape[0]
        q, k, v = qkv.split([p.key_dim, p.key_dim, p.value_dim], dim=-1)
        q = l2_normalize(q.reshape(t, p.num_key_heads, p.key_head_dim).to(compute))
        k = l2_normalize(k.reshape(t, p.num_key_heads, p.key_head_dim).to(compute))
        q = q * p.key_head_dim**-0.5
        return q, k, v.reshape(t, p.num_value_heads, p.value_head_dim).to(compute)

    def state_tensors(self) -> tuple[StateTensor, ...]:
        """One page: the conv window (model dtype) and the delta-rule state (state dtype)."""
        p = self.p
        return (
            StateTensor("conv", (p.conv_dim, p.d_conv - 1), "model"),
            StateTensor("ssm", (p.num_value_heads, p.key_head_dim, p.value_head_dim), "state"),
        )

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> ``[T, hidden]``; writes the requested states to their pages
        of ``states["conv"]`` and ``states["ssm"]``."""
        conv_cache, ssm_cache = states["conv"], states["ssm"]
        p = self.p
        qkv, z, b, a = self.project(h)
        compute = torch.promote_types(h.dtype, torch.float32)
        weight = self.conv1d.weight[:, 0, :]
        # Rounding to the page dtype after every token is a no-op when it is the compute dtype.
        state_dtype = None if ssm_cache.dtype == compute else ssm_cache.dtype
        plan = batch.states
        if plan is None:
            raise ValueError("a Gated DeltaNet layer needs a planned batch (model.plan_step)")
        if plan.kind is StepKind.DECODE:
            core = self._decode_rows(qkv, a, b, plan, conv_cache, ssm_cache, compute,
                                     state_dtype is not None)
            y = self.norm(core.to(h.dtype), z)
            return self.out_proj(y.reshape(h.shape[0], p.value_dim))
        mode = packed_rows_mode(self.policy.gdn_rows, h.device, compute)
        packed = plan.varlen if mode else None
        if packed is not None:
            core = self._packed_rows(qkv, a, b, packed, conv_cache, ssm_cache, compute,
                                     state_dtype is not None, mode)
            y = self.norm(core.to(h.dtype), z)
            return self.out_proj(y.reshape(h.shape[0], p.value_dim))
        beta, g = self.gates(b, a, compute)
        initial = [
            (conv_cache[page], ssm_cache[page]) if page >= 0 else (None, None)
            for page in batch.state_in_page
        ]
        writes: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        core = torch.empty(h.shape[0], p.num_value_heads, p.value_head_dim, dtype=compute,
                           device=h.device)
        for i in range(batch.num_rows):
            s, e = batch.query_start[i], batch.query_start[i + 1]
            if e == s:
                continue
            outputs = batch.state_outputs_of(i)
            offsets = [off for off, _ in outputs]
            conv_in, ssm_in = initial[i]
            x, windows = causal_conv1d_reference(
                qkv[s:e], weight, None, conv_in, p.activation, offsets
            )
            q, k, v = self.split_qkv(x, compute)
            core[s:e], states = gated_delta_rule_reference(
                q, k, v, g[s:e], beta[s:e], ssm_in, offsets, state_dtype
            )
            for (_, page), window, state in zip(outputs, windows, states):
                writes.append((page, window, state))
        for page, window, state in writes:
            conv_cache[page] = window.to(conv_cache.dtype)
            ssm_cache[page] = state.to(ssm_cache.dtype)
        y = self.norm(core.to(h.dtype), z)
        return self.out_proj(y.reshape(h.shape[0], p.value_dim))

    def _decode_rows(
        self,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        plan: StatePlan,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        compute: torch.dtype,
        round_state: bool,
    ) -> torch.Tensor:
        """The fast path of a uniform step: ``[T, Hv, Dv]`` delta-rule output (compute
        dtype). Both launches read the rows' input pages and write only output pages; the
        recurrence takes the raw gate inputs ``a, b``."""
        # Triton on CUDA (float32 recurrence); the torch twins elsewhere, and for float64.
        fast = qkv.is_cuda and compute == torch.float32
        conv = mamba_decode.conv_decode_update if fast else mamba_decode.conv_decode_update_reference
        rule = gdn_decode.gdn_decode_update if fast else gdn_decode.gdn_decode_update_reference
        x = conv(
            qkv if fast else qkv.contiguous(),
            self.conv1d.weight[:, 0, :].contiguous(),
            None,
            conv_cache,
            plan.in_pages,
            plan.decode_out_pages,
            self.p.activation,
        )
        q, k, v = self.split_qkv(x, compute)
        out = rule(q, k, v, a, b, ssm_cache, plan.in_pages, plan.decode_out_pages, round_state,
                   A_log=self.A_log, dt_bias=self.dt_bias)
        return out.to(compute)

    def _packed_rows(
        self,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        plan: gdn_varlen.VarlenPlan,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        compute: torch.dtype,
        round_state: bool,
        mode: str,
    ) -> torch.Tensor:
        """Any step through the packed-rows kernels (``mode`` ``"kernel"``; the twins for
        ``"twin"``, the chunked twin for ``"chunked"``): ``[T, Hv, Dv]`` (compute dtype).
        The conv writes its windows itself and the recurrence its states: no output page
        is an input page (the plan)."""
        fast = mode in ("kernel", "fla")
        conv = conv_varlen if fast else conv_varlen_reference
        rule = functools.partial(
            gdn_varlen.gdn_varlen_update if fast else gdn_varlen.gdn_varlen_update_reference,
            prefetch=self.policy.token_prefetch != "off")
        x = conv(
            qkv if fast else qkv.contiguous(),
            self.conv1d.weight[:, 0, :].contiguous(),
            None,
            conv_cache,
            plan.query_start,
            plan.in_pages,
            self.p.activation,
            plan.token_row,
            out_pages=plan.token_out_pages,
            window_tokens=plan.window_tokens,
        )
        q, k, v = self.split_qkv(x, compute)
        # The host row starts (a graph step's are its padded shape's): no device read.
        starts = plan.query_start_host
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        gate_params = dict(A_log=self.A_log, dt_bias=self.dt_bias)
        if mode == "chunked" and not round_state:
            return gdn_chunked.gdn_prefill(
                q, k, v, a, b, ssm_cache, plan, chunk=self.policy.gdn_chunk, **gate_params
            )
        if mode == "fla" and not round_state and longest > FLA_MIN_TOKENS:
            return gdn_chunked.gdn_prefill(
                q, k, v, a, b, ssm_cache, plan, gdn_chunked.chunk_scan_fla, rule,
                chunk=self.policy.gdn_chunk, **gate_params,
            ).to(compute)
        out = rule(q, k, v, a, b, ssm_cache, plan.query_start, plan.in_pages,
                   plan.token_out_pages, round_state, **gate_params)
        return out.to(compute)
