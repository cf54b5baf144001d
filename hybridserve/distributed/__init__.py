"""Tensor parallelism: one process per rank over ``torch.distributed`` (gloo on the CPU,
NCCL on CUDA), the engine on rank 0 broadcasting each step's plan.

- :mod:`~hybridserve.distributed.group`: the ranks' collectives;
- :mod:`~hybridserve.distributed.shard`: how each layer is cut, and loading one rank's cut;
- :mod:`~hybridserve.distributed.runner`: the step plan and rank 0's runner;
- :mod:`~hybridserve.distributed.worker`: starting the ranks, and the workers' loop.

``LLM(..., tensor_parallel_size=N)`` and ``hybridserve serve --tensor-parallel-size N``
use it; docs/scale-out.md describes what is sharded and what is refused.
"""
