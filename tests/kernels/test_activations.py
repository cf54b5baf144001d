"""The in-place ``relu2`` kernel (:mod:`hybridserve.kernels.activations`) against its torch
twin: the twin's bits in float32 / bf16 / fp16 (negatives, zeros of both signs, NaN,
infinities, sizes that are not a multiple of the block), under the race checker and in
three program orders; the layers' dispatch; a tiny Nemotron-H with the kernel forced
through the interpreter against the torch path, token for token.

The GPU test needs compiled kernels:
``TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_activations.py``.
"""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from hybridserve.kernels import activations  # noqa: E402
from hybridserve.models.config import MLPParams  # noqa: E402
from hybridserve.models.layers.mlp import PlainMLP, activation_fn  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors run the kernel through TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _inputs(g, n, dtype):
    """Random values of mixed magnitude with the edge cases planted."""
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64) * 2)
    x = x.to(dtype)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-3, 3.0],
                           dtype=dtype)
    x[: special.numel()] = special
    return x


def _same_bits(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4095, 4096 * 2 + 17])
def test_relu_square_gives_the_twins_bits_in_place(dtype, n):
    g = torch.Generator().manual_seed(_seed())
    x = _inputs(g, n, dtype) if n >= 8 else torch.tensor([-2.0], dtype=dtype)
    want = activations.relu_square_reference(x)
    buf = x.clone()
    with racecheck.record_launches() as rec:
        got = activations.relu_square_(buf)
    assert got.data_ptr() == buf.data_ptr()  # over its input
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    assert got.dtype == dtype and _same_bits(got, want)


@interpreted
def test_relu_square_independent_of_program_order():
    g = torch.Generator().manual_seed(_seed())
    x = _inputs(g, 3 * activations.BLOCK + 5, torch.bfloat16).view(-1, 1)

    def make_args():
        return dict(x=x.clone())

    report = racecheck.run_launcher_in_orders(activations.relu_square_, make_args,
                                              seed=_seed() % 1000)
    assert report.consistent, report.differences


def test_relu_square_rejects_what_it_cannot_write():
    with pytest.raises(ValueError, match="contiguous"):
        activations.relu_square_(torch.ones(4, 6)[:, :3])
    with pytest.raises(ValueError, match="contiguous"):
        activations.relu_square_(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="activations mode"):
        activations.triton_enabled("fast", torch.ones(2))


def test_dispatch():
    x = torch.ones(3, 4)
    assert not activations.triton_enabled("reference", x)
    assert not activations.triton_enabled("auto", x)  # CPU tensors under "auto": the twin
    assert activations.triton_enabled("triton", x)
    assert not activations.triton_enabled("triton", x.t())  # not contiguous
    assert not activations.triton_enabled("triton", x.double())
    w = torch.ones(3, requires_grad=True)
    with torch.enable_grad():
        assert not activations.triton_enabled("triton", w)
    # The reference activation never writes its input.
    y = torch.tensor([-1.0, 2.0])
    activation_fn("relu2")(y)
    assert torch.equal(y, torch.tensor([-1.0, 2.0]))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_layer_with_the_kernel_matches_the_torch_path(dtype):
    g = torch.Generator().manual_seed(_seed())
    p = MLPParams(kind="plain", intermediate_size=96, activation="relu2", bias=False)
    torch_mlp = PlainMLP(32, p).to(dtype)
    fused = PlainMLP(32, p, kernels="triton").to(dtype)
    fused.load_state_dict(torch_mlp.state_dict())
    x = torch.randn(7, 32, generator=g).to(dtype)
    with torch.inference_mode():
        assert torch.equal(fused(x), torch_mlp(x))


@interpreted
def test_tiny_model_generates_the_same_tokens_with_the_kernel(tmp_path):
    """A tiny Nemotron-H (relu2 MLPs) through the engine: the kernel forced through the
    interpreter gives the torch path's tokens."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.config import KernelPolicy
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("nemotron_h", tmp_path, layers="M*-M-")
    prompts = [[5, 9, 2, 7, 11, 3], [4, 4, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for mode in ("reference", "triton"):
        llm = LLM(str(path), kernel_policy=KernelPolicy(activations=mode))
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    assert got["triton"] == got["reference"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_relu_square_gives_the_twins_bits(dtype):
    """The 8B shape's MLP activation of a 4,096-token prefill chunk, and the edge cases."""
    g = torch.Generator().manual_seed(0)
    x = _inputs(g, 4096 * 21504 + 3, dtype).cuda()
    want = activations.relu_square_reference(x)
    got = activations.relu_square_(x.clone())
    assert _same_bits(got, want)
