"""The Mamba2 mixer computes ``A = -exp(A_log)`` once per weights, not once per step."""

from __future__ import annotations

import torch

from hybridserve.models.layers.mamba2 import Mamba2Mixer


def test_decay_rates_follow_the_weights():
    torch.manual_seed(0)
    mixer = Mamba2Mixer.__new__(Mamba2Mixer)
    torch.nn.Module.__init__(mixer)
    mixer.A_log = torch.nn.Parameter(torch.randn(6))
    a = mixer._decay_rates(torch.float32)
    torch.testing.assert_close(a, -torch.exp(mixer.A_log.detach()))
    assert mixer._decay_rates(torch.float32) is a  # cached
    with torch.no_grad():
        mixer.A_log.mul_(0.5)  # an in-place write, as loading weights does
    b = mixer._decay_rates(torch.float32)
    torch.testing.assert_close(b, -torch.exp(mixer.A_log.detach()))
    mixer.A_log = torch.nn.Parameter(torch.randn(6))  # a new tensor (assign=True loading)
    torch.testing.assert_close(mixer._decay_rates(torch.float32), -torch.exp(mixer.A_log.detach()))
    assert mixer._decay_rates(torch.float64).dtype == torch.float64
