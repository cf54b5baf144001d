"""The Gated DeltaNet token-by-token kernel compiled on a GPU (``pytest -m gpu``, with
``TRITON_INTERPRET=0``): against its torch twin at Qwen3.6-27B's layer shape, and its
prefetching loop (``KernelPolicy.token_prefetch``) bit for bit against the plain one.
``tests/kernels/test_gdn_varlen.py`` holds the same kernel to the twin and the race
checker under the interpreter."""

import os

import pytest
import torch

from hybridserve.kernels.gdn import l2_normalize
from hybridserve.kernels.gdn_varlen import gdn_varlen_update, gdn_varlen_update_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiles the kernel: run with TRITON_INTERPRET=0"),
]


def test_prefetch_matches_the_plain_loop_and_the_twin(record_property):
    """A cached prompt's 128-token tail, a fresh 300-token prompt, decode rows and an
    empty row, 16 key / 48 value heads of 128: both loops give the same bits, and both
    the twin's values to float32 rounding."""
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lengths, hk, hv, d = [128, 300, 1, 1, 0], 16, 48, 128
    t, rows = sum(lengths), len(lengths)
    q = l2_normalize(torch.randn(t, hk, d, device="cuda", generator=g)) * d**-0.5
    k = l2_normalize(torch.randn(t, hk, d, device="cuda", generator=g))
    v = torch.randn(t, hv, d, device="cuda", generator=g)
    a = torch.randn(t, hv, device="cuda", generator=g)
    b = torch.randn(t, hv, device="cuda", generator=g)
    kw = dict(A_log=torch.randn(hv, device="cuda", generator=g) * 0.5,
              dt_bias=torch.randn(hv, device="cuda", generator=g) * 0.5)
    pages = rows + t + 1
    cache = torch.randn(pages, hv, d, d, device="cuda", generator=g)
    in_pages = torch.tensor([3, -1, 5, 7, -1], dtype=torch.int32, device="cuda")
    out = torch.full((t,), -1, dtype=torch.int32, device="cuda")
    ends = torch.tensor(lengths).cumsum(0)
    for i, e in enumerate(ends.tolist()):
        if lengths[i]:
            out[e - 1] = rows + 2 + i  # every row's last state, as the engine writes it
    out[63] = rows + 10  # a checkpoint inside the tail
    qs = torch.tensor([0, *ends.tolist()], dtype=torch.int32, device="cuda")
    want_cache = cache.clone()
    want = gdn_varlen_update_reference(q, k, v, a, b, want_cache, qs, in_pages, out, **kw)
    got = []
    for prefetch in (False, True):
        c = cache.clone()
        got.append((gdn_varlen_update(q, k, v, a, b, c, qs, in_pages, out, **kw,
                                      prefetch=prefetch), c))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    written = out[out >= 0].long()
    rel = ((got[1][0] - want).norm() / want.norm()).item()
    rel_state = ((got[1][1][written] - want_cache[written]).norm()
                 / want_cache[written].norm()).item()
    record_property("gdn_varlen_rel_err", rel)
    assert rel < 1e-5 and rel_state < 1e-5, (rel, rel_state)
