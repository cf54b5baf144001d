"""scripts/fast_mamba_train.py: the patched Mamba2 mixer computes transformers' function
(logits and gradients), and the reference scan is the SSD recurrence."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location(
        "fast_mamba_train", REPO / "scripts" / "fast_mamba_train.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fmt = _load_module()


def _naive_scan(q, k, v, g):
    """S_t = exp(g_t) S_{t-1} + v_t k_t^T, y_t = S_t q_t, one step at a time."""
    batch, length, heads, _ = q.shape
    state = q.new_zeros(batch, heads, v.shape[-1], q.shape[-1])
    ys = []
    for t in range(length):
        state = torch.exp(g[:, t])[..., None, None] * state + torch.einsum(
            "bhp,bhn->bhpn", v[:, t], k[:, t]
        )
        ys.append(torch.einsum("bhpn,bhn->bhp", state, q[:, t]))
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize("length,chunk", [(1, 16), (37, 16), (48, 16), (20, 64)])
def test_reference_scan_matches_naive_recurrence(length, chunk):
    gen = torch.Generator().manual_seed(length)
    batch, heads, d_state, head_dim = 2, 3, 5, 4
    q, k = (torch.randn(batch, length, heads, d_state, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, length, heads, head_dim, generator=gen, dtype=torch.float64)
    # Log decays as in Mamba2 (dt * A <= 0), some of them strong.
    g = -torch.rand(batch, length, heads, generator=gen, dtype=torch.float64) * 3
    y = fmt.reference_scan(q, k, v, g, chunk_size=chunk)
    assert y.dtype == torch.float64 and y.shape == v.shape
    torch.testing.assert_close(y, _naive_scan(q, k, v, g), rtol=1e-12, atol=1e-12)
    # float32 inputs: computed in float32, close to the float64 result.
    y32 = fmt.reference_scan(*(t.float() for t in (q, k, v, g)), chunk_size=chunk)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y, rtol=1e-4, atol=1e-4)


def test_reference_scan_gradients_match_naive():
    gen = torch.Generator().manual_seed(7)
    shape = (1, 21, 2, 3)
    inputs = [torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    inputs.append(-torch.rand(*shape[:3], generator=gen, dtype=torch.float64))
    leaves = [t.requires_grad_() for t in inputs]
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((fmt.reference_scan(*leaves, chunk_size=8) * w).sum(), leaves)
    naive = torch.autograd.grad((_naive_scan(*leaves) * w).sum(), leaves)
    for a, b in zip(grads, naive):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _tiny_model(groups: int, seed: int):
    from transformers import GraniteMoeHybridForCausalLM

    from hybridserve.testing.tiny_models import tiny_config

    # The tiny test config (non-trivial multipliers) with the patch's cases: 1 or 2
    # groups, a chunk that does not divide the sequence, no positional encoding.
    config = tiny_config(
        "granitemoehybrid", "MAM",
        vocab_size=97,
        mamba_n_groups=groups,
        mamba_chunk_size=16,
        position_embedding_type="nope",
        # Ten times the default init: with 0.02 the SSD term is so small next to the D skip
        # that a 1% error in the decays moves the logits by less than 1e-6.
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config).float()
    # Spread the per-head SSM scalars so every head decays differently.
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.5)
                layer.mamba.dt_bias.uniform_(-2.0, 1.0)
                layer.mamba.D.uniform_(0.5, 1.5)
    return model


def _logits_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


@pytest.mark.parametrize("groups", [1, 2])
def test_patched_mixer_matches_transformers(groups):
    model = _tiny_model(groups, seed=groups)
    model.train()  # the training path of transformers' mixer
    tokens = torch.randint(0, 97, (2, 38), generator=torch.Generator().manual_seed(3))  # 37 steps
    ref_logits, ref_grads = _logits_and_grads(model, tokens)

    assert fmt.patch_mamba_mixers(model, fmt.reference_scan) == 2
    logits, grads = _logits_and_grads(model, tokens)
    # 1e-5 of the logits' scale: float32 rounding (the two SSDs sum in different orders).
    scale = ref_logits.abs().max().item()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * scale)
    assert grads.keys() == ref_grads.keys()
    mixer_params = 0
    for name, ref in ref_grads.items():
        # Relative to each gradient's scale: float32 rounding of different summation orders.
        tol = 3e-5 * ref.abs().max().item() + 1e-8
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=tol, msg=name)
        mixer_params += ".mamba." in name and ref.abs().max().item() > 0
    assert mixer_params == 2 * 8  # every mixer parameter gets a (non-zero) gradient

    fmt.unpatch_mamba_mixers(model)
    torch.testing.assert_close(
        _logits_and_grads(model, tokens)[0], ref_logits, rtol=0, atol=0
    )


def test_patched_mixer_refuses_what_it_does_not_compute():
    model = _tiny_model(1, seed=0)
    fmt.patch_mamba_mixers(model, fmt.reference_scan)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cache"):
        model(input_ids=tokens)  # transformers creates a cache unless use_cache=False
    padded = torch.ones_like(tokens)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        model(input_ids=tokens, attention_mask=padded, use_cache=False)
    # An all-ones mask is no padding: the same logits as without one.
    with torch.no_grad():
        a = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
        b = model(input_ids=tokens, use_cache=False)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def _triton_version() -> tuple[int, ...]:
    import triton

    match = re.match(r"(\d+)\.(\d+)\.(\d+)", triton.__version__)
    return tuple(int(x) for x in match.groups()) if match else (0,)


def _fla_refuses_gated_backward() -> str | None:
    """Why fla-core 0.6.0 will not run ``chunk_simple_gla``'s backward here, or None: on
    Hopper (compute capability 9) with Triton >= 3.4.0 and < 3.7.1 its gated
    ``chunk_bwd_dqkwg`` raises rather than give wrong gradients, unless tilelang is
    installed (fla-core then takes tilelang's kernel). Checked before the call, as fla does."""
    if torch.cuda.get_device_capability()[0] != 9 or importlib.util.find_spec("tilelang"):
        return None
    if (3, 4, 0) <= _triton_version() < (3, 7, 1):
        import triton

        return (f"Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for "
                f"gated chunk_bwd_dqkwg (see #640); fla-core refuses it (Triton "
                f"{triton.__version__} here; Triton >= 3.7.1 or tilelang lifts it)")
    return None


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiles Triton kernels: TRITON_INTERPRET=0"
)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fla_scan_matches_reference():
    """The forward always; the gradients where fla-core runs its backward (the reason of
    :func:`_fla_refuses_gated_backward` skips them, checked before the call)."""
    pytest.importorskip("fla.ops.simple_gla")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, length, heads, d_state, head_dim = 2, 1000, 8, 64, 64
    q, k = (torch.randn(batch, length, heads, d_state, generator=gen, device="cuda") * 0.3 for _ in range(2))
    v = torch.randn(batch, length, heads, head_dim, generator=gen, device="cuda")
    g = -torch.rand(batch, length, heads, generator=gen, device="cuda") * 0.5
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    w = torch.randn(batch, length, heads, head_dim, generator=gen, device="cuda")
    y = fmt.fla_scan(*leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    y64 = fmt.reference_scan(*leaves64)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(y, y64) < 5e-3
    reason = _fla_refuses_gated_backward()
    if reason:
        pytest.skip(reason)
    grads = torch.autograd.grad((y * w).sum(), leaves)
    grads64 = torch.autograd.grad((y64 * w.double()).sum(), leaves64)
    for a, b in zip(grads, grads64):
        assert rel(a, b) < 5e-3
