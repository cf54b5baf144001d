"""Shared setup for the model-layer tests."""

import torch

# Tiny tensors: thread start-up and contention cost more than the math (one matmul of a
# few KB took milliseconds with two threads on a busy two-core machine, microseconds with one).
torch.set_num_threads(1)
