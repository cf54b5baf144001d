"""A faster training forward for the Mamba2 mixers of transformers' Granite 4.0-H model.

Without ``mamba_ssm`` / ``causal_conv1d``, transformers runs the Mamba2 mixer of
``GraniteMoeHybridForCausalLM`` through its PyTorch fallback, whose chunked SSD builds
several ``[batch, heads, chunks, chunk, chunk]`` tensors per layer and dominates the step
time of ``scripts/train_default_model.py``. :func:`patch_mamba_mixers` swaps every mixer's
forward for one that computes the same function for training (no cache, full-length
sequences, no padding) but hands the SSD to a pluggable differentiable *scan*::

    scan(q, k, v, g) -> y

in fla-core's layout: ``q, k [B, T, H, N]``, ``v [B, T, H, P]``, ``g [B, T, H]`` (the log
decay of each step, per head), ``y [B, T, H, P]`` in ``promote(v.dtype, float32)``. It
computes, per sequence and head, with ``S_0 = 0`` (a ``[P, N]`` state)::

    S_t = exp(g_t) * S_{t-1} + v_t k_t^T,        y_t = S_t q_t

The Mamba2 SSD is that recurrence with ``q = C``, ``k = B`` (groups repeated to heads),
``v = x * dt`` and ``g = dt * A`` (the mapping of :mod:`hybridserve.kernels.ssd_varlen`);
the ``D`` skip is added outside the scan. Two scans:

- :func:`fla_scan`: fla-core's ``chunk_simple_gla`` (Triton, CUDA only; imported on first
  use). It has its own backward, so it trains.
- :func:`reference_scan`: plain torch, chunked, float32 (or float64 for float64 inputs),
  any length; the CPU path and the oracle of the tests.

Everything around the scan (projections, conv, dt, gated norm) stays plain torch, so
``torch.compile`` fuses it as before; fla's entry point is excluded from compilation by fla
itself, which costs one graph break per Mamba layer.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ScanFn", "fla_scan", "patch_mamba_mixers", "reference_scan", "unpatch_mamba_mixers"]

ScanFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Keyword arguments the decoder layer forwards to its mixer that do not change what a
# cache-free mixer computes. Any other one that is set (packed-sequence indices such as
# ``seq_idx`` or ``cu_seq_lens_*``, for instance) is refused.
_IGNORED_KWARGS = frozenset(
    {"output_router_logits", "output_attentions", "output_hidden_states", "return_dict", "use_cache"}
)


# --------------------------------------------------------------------------------------
# Scans
# --------------------------------------------------------------------------------------


def _check_scan_shapes(q, k, v, g) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, N], got {tuple(q.shape)}, {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, P] matching q {tuple(q.shape)}, got {tuple(v.shape)}")
    if g.shape != q.shape[:3]:
        raise ValueError(f"g must be [B, T, H] matching q {tuple(q.shape)}, got {tuple(g.shape)}")


def reference_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64
) -> torch.Tensor:
    """The scan in plain differentiable torch (module docstring for the contract).

    Chunked: within a chunk of ``chunk_size`` steps the output is a causally masked,
    decay-weighted ``q k^T`` product applied to ``v`` (quadratic in the chunk only); across
    chunks a ``[B, H, P, N]`` state is carried by a loop over the chunks. It computes in
    ``promote(dtype, float32)`` with autocast off, so under bf16 autocast it stays the
    float32 oracle. Any ``T`` (the tail chunk is zero-padded; padding comes after every
    real step, so it cannot reach their outputs).
    """
    _check_scan_shapes(q, k, v, g)
    batch, length, heads, d_state = q.shape
    head_dim = v.shape[-1]
    compute = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g = (t.to(compute) for t in (q, k, v, g))
        if length == 0:
            return v.new_zeros(batch, 0, heads, head_dim)
        c = min(chunk_size, length)
        chunks = -(-length // c)
        pad = chunks * c - length
        # [B, T, ...] -> [B, chunks, c, ...]; zero padding means k = v = 0 and no decay.
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).view(batch, chunks, c, heads, -1) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad)).view(batch, chunks, c, heads)
        # Log decay from the chunk start through each step (inclusive).
        cum = g.cumsum(dim=2)  # [B, n, c, H]

        # Within a chunk: y_l = sum_{s <= l} exp(cum_l - cum_s) (q_l . k_s) v_s. The
        # exponent is masked to -inf above the diagonal *before* exp, because there
        # cum_l - cum_s is a growth that can overflow (and inf * 0 would poison gradients).
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B, n, l, s, H]
        decay = torch.exp(diff.masked_fill(~causal[None, None, :, :, None], float("-inf")))
        scores = torch.einsum("bclhn,bcshn->bclsh", q, k) * decay
        y = torch.einsum("bclsh,bcshp->bclhp", scores, v)

        # Each chunk's own contribution to the state at its end, decayed to that end.
        to_end = torch.exp(cum[:, :, -1:, :] - cum)  # [B, n, c, H]
        local = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, v, k)  # [B, n, H, P, N]
        chunk_decay = torch.exp(cum[:, :, -1, :])  # [B, n, H]: decay across a whole chunk

        # Carry the state across chunks; chunk j's tokens read the state before it, decayed
        # from the chunk start to themselves.
        state = v.new_zeros(batch, heads, head_dim, d_state)
        carried = []
        for j in range(chunks):
            carried.append(state)
            state = chunk_decay[:, j, :, None, None] * state + local[:, j]
        before = torch.stack(carried, dim=1)  # [B, n, H, P, N]
        y = y + torch.einsum("bclhn,bchpn->bclhp", q, before) * torch.exp(cum)[..., None]
        return y.reshape(batch, chunks * c, heads, head_dim)[:, :length]


def fla_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The scan through fla-core's ``chunk_simple_gla`` (CUDA; differentiable).

    ``chunk_simple_gla(q, k, v, g=g, scale=1.0)`` with fla's ``[B, T, H, K]`` layout
    (``K = N``, ``V = P``), no initial state and no final state. fla computes in the input
    dtype (float32 here: the mixer passes float32, as transformers' SSD does; Triton's
    float32 dots run in TF32 on recent GPUs, well inside bf16 training's noise); its output
    comes back in ``q.dtype``.
    """
    _check_scan_shapes(q, k, v, g)
    if q.device.type != "cuda":
        raise RuntimeError(f"fla_scan needs CUDA tensors (got {q.device}); use reference_scan")
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        raise RuntimeError(
            "fla_scan needs fla-core (pip install fla-core==0.6.0 einops, or the wheel in .whl/)"
        ) from exc
    # scale=1: the SSD has no 1/sqrt(N) factor (fla's default scale). No final state is
    # requested, so fla returns None for it.
    y, _ = chunk_simple_gla(q, k, v, g=g, scale=1.0)
    return y


# --------------------------------------------------------------------------------------
# The patched mixer forward
# --------------------------------------------------------------------------------------


def _mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Cache-free Mamba2 mixer forward with the SSD through ``self._fast_scan``.

    The same function as transformers' own (PyTorch fallback) forward of
    ``GraniteMoeHybridMambaLayer`` for full, unpadded sequences without a cache, with the
    same dtypes at each step (so the same numbers up to rounding, under autocast too).
    Refuses a cache object, a padding mask and packed-sequence keyword arguments.
    """
    if cache_params is not None:
        raise ValueError(
            "patched Mamba mixer: got a cache object; this forward is for cache-free training. "
            "Call the model with use_cache=False (or unpatch it for generation)."
        )
    if attention_mask is not None:
        # transformers hands the mixer a 2-D mask only when it may contain padding (and, under
        # torch.compile, whenever one was given, since it cannot look at the values then).
        if torch.compiler.is_compiling():
            raise ValueError(
                "patched Mamba mixer: got an attention mask under torch.compile; it supports "
                "unpadded sequences only, so pass no attention_mask"
            )
        if not bool((attention_mask == 1).all()):
            raise ValueError(
                "patched Mamba mixer: the attention mask has padding, which this forward does "
                "not support (it computes full, unpadded sequences only)"
            )
    unsupported = sorted(n for n, v in kwargs.items() if v is not None and n not in _IGNORED_KWARGS)
    if unsupported:
        raise ValueError(f"patched Mamba mixer: unsupported arguments {unsupported}")

    batch, length, _ = hidden_states.shape
    in_dtype = hidden_states.dtype
    heads, head_dim = self.num_heads, self.head_dim
    groups, d_state = self.n_groups, self.ssm_state_size

    projected = self.in_proj(hidden_states)
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, heads], dim=-1)

    # Depthwise causal conv: pad K - 1 on both sides (the Conv1d's own padding) and keep
    # the first T outputs, i.e. only the past and present feed each step.
    weight = self.conv1d.weight
    xbc = F.conv1d(
        xbc.transpose(1, 2).to(weight.dtype),
        weight,
        self.conv1d.bias,
        padding=self.conv_kernel_size - 1,
        groups=self.conv_dim,
    )[..., :length]
    xbc = self.act(xbc).to(projected.dtype).transpose(1, 2)
    x, B, C = xbc.split([self.intermediate_size, groups * d_state, groups * d_state], dim=-1)

    # dt: bias, softplus, clamp to the configured limits, in the projection's dtype, as
    # transformers does (under autocast softplus itself runs in float32).
    dt = dt + self.dt_bias.to(dt.dtype)
    dt = F.softplus(dt)
    dt = torch.clamp(dt, min=self.time_step_limit[0], max=self.time_step_limit[1]).float()
    A = -torch.exp(self.A_log.float())

    # The SSD in float32 (transformers casts its inputs to float32 too).
    x = x.reshape(batch, length, heads, head_dim).float()
    rep = heads // groups
    # Group j serves heads j * rep .. (j + 1) * rep - 1 (repeat_interleave, not tile).
    k = B.reshape(batch, length, groups, d_state).float().repeat_interleave(rep, dim=2)
    q = C.reshape(batch, length, groups, d_state).float().repeat_interleave(rep, dim=2)
    y = self._fast_scan(q, k, x * dt[..., None], dt * A)
    y = y.float() + x * self.D.float()[:, None]  # the D skip, on the undiscretised x

    y = self.norm(y.reshape(batch, length, heads * head_dim), gate)
    return self.out_proj(y.to(in_dtype))


def _mamba_mixers(model) -> list:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"expected a GraniteMoeHybridForCausalLM, got {type(model).__name__}")
    return [layer.mamba for layer in layers if getattr(layer, "mamba", None) is not None]


def patch_mamba_mixers(model, scan: ScanFn) -> int:
    """Route every Mamba2 mixer of ``model`` through ``scan`` for training.

    ``model`` is a transformers ``GraniteMoeHybridForCausalLM`` (weights untouched, nothing
    else changed; the config and the saved checkpoint are the same). Each mixer's forward
    becomes :func:`_mixer_forward`: the same function as transformers' PyTorch path on
    full, unpadded sequences without a cache, which is all it accepts. Call the model with
    ``use_cache=False`` (transformers otherwise creates a cache, and the patched mixer
    raises). Patch before ``torch.compile``. Returns the number of mixers patched;
    :func:`unpatch_mamba_mixers` restores transformers' forward.
    """
    mixers = _mamba_mixers(model)
    if not mixers:
        raise ValueError("the model has no Mamba layers to patch")
    for mixer in mixers:
        if mixer.num_heads % mixer.n_groups:
            raise ValueError(f"{mixer.n_groups} groups do not divide {mixer.num_heads} heads")
        mixer._fast_scan = scan
        # An instance attribute shadows the class's forward; nn.Module.__call__ (and so
        # the hooks, e.g. the training script's dropout) goes through it.
        mixer.forward = types.MethodType(_mixer_forward, mixer)
    return len(mixers)


def unpatch_mamba_mixers(model) -> None:
    """Undo :func:`patch_mamba_mixers` (a no-op on mixers that are not patched)."""
    for mixer in _mamba_mixers(model):
        if "forward" in mixer.__dict__:
            del mixer.forward
            del mixer._fast_scan
