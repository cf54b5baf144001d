"""Engine configuration: frozen dataclasses validated once, with errors that name the field.

The model's own configuration (parsed from a checkpoint's ``config.json``) lives in
:mod:`hybridserve.models.config` beside the code that interprets it; this module holds
what the engine decides: cache sizes, scheduling budgets, speculative decoding and which
kernels run (:class:`KernelPolicy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    # float64 is for reference computations in tests, not for serving.
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def resolve_dtype(value: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    """Map a user-facing dtype spelling to a torch dtype, or raise naming the field."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ValueError(f"{field_name}={value} is not supported; use float32, bfloat16 or float16")
    try:
        return _DTYPES[str(value).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"{field_name}={value!r} is not supported; use one of {sorted(set(_DTYPES))}"
        ) from None


CHECKPOINT_POLICIES = ("grid", "junction", "prompt_end", "finished")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and policies of the attention KV cache and the recurrent-state page pool.

    ``state_interval`` is the checkpoint grid (a multiple of ``kv_block_size``).
    ``checkpoint_policies`` selects which positions get a state checkpoint: ``grid``
    (every multiple of ``state_interval``), ``junction`` (where a new prompt leaves
    the cached path), ``prompt_end`` (each prompt's end, rounded down to a block) and
    ``finished`` (each finished sequence's end, rounded down to a block).
    ``max_checkpoint_pages`` caps the pages checkpoints may hold (None: a quarter of
    the pool); beyond it checkpoints are evicted by ``eviction_policy``: ``lru`` or
    ``flop_aware`` (recency plus ``eviction_alpha`` (default 2) times the prefill FLOPs a hit saves;
    see :mod:`hybridserve.cache.state_cache`).
    ``checkpoint_offload_gib`` (or, exactly, ``checkpoint_offload_pages``) sizes the host
    tier that evicted checkpoints move to instead of being dropped (0: no tier; see
    :mod:`hybridserve.cache.host_tier`).
    """

    kv_block_size: int = 16
    num_kv_blocks: int = 1024
    num_state_pages: int = 256
    enable_prefix_caching: bool = True
    state_interval: int = 64
    checkpoint_policies: tuple[str, ...] = CHECKPOINT_POLICIES
    max_checkpoint_pages: int | None = None
    ssm_state_dtype: torch.dtype = torch.float32
    eviction_policy: str = "lru"
    eviction_alpha: float = 2.0
    checkpoint_offload_gib: float = 0.0
    checkpoint_offload_pages: int | None = None

    def __post_init__(self) -> None:
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_state_pages < 2:
            raise ValueError(f"num_state_pages must be >= 2, got {self.num_state_pages}")
        if self.state_interval < 1 or self.state_interval % self.kv_block_size:
            raise ValueError(
                f"state_interval={self.state_interval} must be a positive multiple of "
                f"kv_block_size={self.kv_block_size} (checkpoints sit on KV block boundaries)"
            )
        if self.eviction_policy not in ("lru", "flop_aware"):
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r} is not supported; use 'lru' or 'flop_aware'"
            )
        bad = [p for p in self.checkpoint_policies if p not in CHECKPOINT_POLICIES]
        if bad:
            raise ValueError(
                f"checkpoint_policies has unknown entries {bad}; choose from {CHECKPOINT_POLICIES}"
            )
        if not self.checkpoint_offload_gib >= 0:
            raise ValueError(
                f"checkpoint_offload_gib must be >= 0, got {self.checkpoint_offload_gib}"
            )
        if self.checkpoint_offload_pages is not None:
            if self.checkpoint_offload_pages < 0:
                raise ValueError(
                    f"checkpoint_offload_pages must be >= 0, got {self.checkpoint_offload_pages}"
                )
            if self.checkpoint_offload_gib:
                raise ValueError("give checkpoint_offload_gib or checkpoint_offload_pages, not both")
        if self.max_checkpoint_pages is not None and not (
            0 <= self.max_checkpoint_pages < self.num_state_pages
        ):
            raise ValueError(
                f"max_checkpoint_pages={self.max_checkpoint_pages} must be in "
                f"[0, num_state_pages={self.num_state_pages})"
            )

    @property
    def checkpoint_budget(self) -> int:
        if self.max_checkpoint_pages is not None:
            return self.max_checkpoint_pages
        return self.num_state_pages // 4


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step budgets. ``max_num_batched_tokens`` bounds the tokens of one forward
    (prefill chunks are cut to fit); ``max_num_seqs`` bounds the rows of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


SPEC_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding, spelled as vLLM users write ``speculative_config``.

    ``method="ngram"``: prompt lookup; the last ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens are matched against earlier text and the tokens that
    followed the match are proposed, up to ``num_speculative_tokens`` of them.

    ``method="draft_model"``: a second, smaller checkpoint at ``model`` (any supported
    architecture with the target's vocabulary) proposes ``num_speculative_tokens``
    tokens autoregressively, with KV blocks and state pages of its own
    (:mod:`hybridserve.drafters.draft_model`).

    ``method="mtp"``: the target checkpoint's own multi-token-prediction head
    (``mtp.*`` weights, Qwen3.5 / Qwen3-Next) proposes them from the target's last
    hidden state.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} is not supported; use one of "
                f"{list(SPEC_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be in [1, 16], got "
                f"{self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                "speculative_config.model is required with method='draft_model' (the draft "
                "checkpoint's path)"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f"speculative_config.model is only used with method='draft_model', not "
                f"method={self.method!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SpecConfig | None:
        if d is None:
            return None
        if isinstance(d, SpecConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError("speculative_config must be a dict such as {'method': 'ngram', ...}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unsupported keys {unknown}; known: {sorted(known)}")
        if "model" in d and d["model"] is not None:
            d = {**d, "model": str(d["model"])}
        return cls(**d)


KERNEL_MODES = ("auto", "triton", "reference")
PATH_MODES = ("auto", "triton", "reference", "off")


def runs_triton(mode: str, device: torch.device | str) -> bool:
    """Whether an op in ``mode`` (a :class:`KernelPolicy` field) takes its Triton kernel on
    ``device``: ``"triton"`` everywhere (the CPU interpreter too), ``"auto"`` on CUDA."""
    return mode == "triton" or (mode == "auto" and torch.device(device).type == "cuda")


def runs_unchecked(mode: str, device: torch.device | str) -> bool:
    """Whether a path in ``mode`` (``"auto"`` / ``"on"`` / ``"off"``) whose kernels have
    not yet been compiled on a GPU is taken on ``device``: ``"on"`` everywhere, ``"off"``
    nowhere, ``"auto"`` everywhere but CUDA (the CPU tests run it under the interpreter,
    which accepts programs the compiler may not) until its ``gpu`` test has run there."""
    return mode == "on" or (mode == "auto" and torch.device(device).type != "cuda")


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    """Which implementation each op of a forward takes. One per engine: the model gets it
    at load (:func:`hybridserve.models.loader.load_model`) and its layers and step plans
    read nothing else; tests and benchmarks pick paths by constructing one.

    Kernel fields take ``"auto"`` (the Triton kernel on CUDA, the torch twin elsewhere),
    ``"triton"`` (the Triton kernel on any device: the CPU interpreter in tests) or
    ``"reference"`` (the torch twin everywhere). Path fields take those or ``"off"``
    (the path is never taken). A kernel the device cannot run still falls back to its
    twin under ``"auto"`` (float64, tensors a kernel cannot read).

    - ``uniform_decode`` (bool): steps whose rows all run the same few tokens (decode,
      uniform verify rows) take the batched decode ops of attention and the recurrent
      layers; False sends them to the general paths (a benchmark's comparison).
    - ``decode_attention``: the batched decode attention.
    - ``prefill_attention``: the attention of every other step (prefill, mixed).
    - ``short_rows`` (path): steps whose rows are all at most ``max_short_tokens``
      long run the recurrence token by token; ``"auto"`` takes it on CUDA for a float32
      scan only. A row of L tokens is L dependent steps of about a microsecond each on
      the GPU, against the chunked scan's fixed cost of about 2 ms of host work per
      Mamba layer: on an H200 at 8B shapes (the first token after 8,064 cached tokens,
      ``gpu_ttft_1ab47c5.json``) 28 ms against 50 ms for a 512-token tail, 53 against
      56 ms at 1,024 tokens, where the two meet; hence 512.
    - ``packed_prefill`` (path): every other step runs all rows through one
      variable-length conv and the segmented chunked scan; ``"auto"`` (= ``"triton"``)
      on CUDA with a float32 scan, through the two-pass Triton scan of
      :mod:`hybridserve.kernels.ssd_two_pass` (a state pass, then every chunk's outputs
      in parallel); ``"fused"`` through the one-launch scan of
      :mod:`hybridserve.kernels.ssd_chunked` (one program walks all chunks of its row);
      ``"chunk_states"`` through the three-launch scan of
      :mod:`hybridserve.kernels.ssd_chunk_states` (every chunk's local state in parallel,
      an elementwise state passing, the two-pass scan's output pass; opt-in until an H200
      run times it against the two-pass default);
      ``"reference"`` with their torch twin anywhere; ``"fla"`` on CUDA through
      fla-core's scan (groups expanded to heads, float32 copies of the inputs: the
      comparison point). Otherwise rows go one by one (the oracle).
    - ``norms``: the RMS norms.
    - ``activations``: the MLP layers' pointwise activation where a kernel fuses it
      (``relu2``: one in-place pass, :mod:`hybridserve.kernels.activations`; the torch
      twin takes two): ``"auto"`` (CUDA tensors; its `gpu` test gave the twin's bits on
      the H200, ``gpu_tests_6d5fa44.txt``), ``"triton"`` or ``"reference"``.
    - ``moe``: the routed experts of mixture-of-experts layers (grouped kernels or the
      per-expert loop).
    - ``gdn_rows``: Gated DeltaNet steps that are not uniform decode steps: ``"auto"``,
      ``"triton"``, ``"reference"``, ``"chunked"``, ``"fla"`` or ``"off"``
      (:func:`hybridserve.models.layers.gated_deltanet.packed_rows_mode`; ``"fla"``, fla-core's
      chunked rule for long rows, is faster and 1.8e-3 from the exact default);
      ``gdn_chunk`` the chunk length of its chunked form (fla-core's is 64).
    - ``short_graphs``: short-row steps (a cached prefix's tail) replayed from graphs
      beside the decode graphs (:meth:`hybridserve.runner.cuda_graph.DecodeGraphs.replay_short`):
      ``"on"`` (``"auto"``, the default, is the same) or ``"off"``. On the H200 the
      captured steps gave the eager step's tokens (``test_captured_short_steps_match_eager_on_cuda``)
      and the cached first token of the 8B shape 20.7x faster than cold (``gpu_bench.json``).
    - ``drafter_graphs``: a draft model's or MTP head's own steps replayed from graphs
      (:mod:`hybridserve.runner.draft_graphs`), and an MTP target's decode steps on its
      decode graphs (their hidden states handed to the head): ``"on"`` (``"auto"``, the
      default, is the same) or ``"off"`` (the drafter's steps and an MTP target's steps run
      eagerly). On the H200 the captured drafter steps gave the eager steps' tokens
      (``tests/drafters/test_draft_graphs.py``'s `gpu` test) and the shipped draft model
      drafted at 1,608 tok/s at batch 1 against 260 eagerly (``drafters_trained_h200.json``).
    - ``logq_graphs``: sampled verify steps whose drafts a drafter drew from its own
      distribution (draft model, MTP head) replayed from the target's graphs, with the
      drafter's ``log q`` in a static buffer
      (:meth:`hybridserve.runner.cuda_graph.DecodeGraphs.enable_draft_distributions`):
      ``"on"`` (``"auto"``, the default, is the same) or ``"off"`` (such steps run
      eagerly). On the H200 the captured steps drew the eager steps' tokens
      (``tests/drafters/test_logq_graphs.py``'s `gpu` test, ``gpu_tests_28159ac.txt``),
      and the shipped draft model, sampling at temperature 0.8, decoded at 685 / 4,912
      tok/s at batch 1 / 16 against 137 / 2,034 eagerly
      (``drafters_trained_h200_sampled_logq_on.json`` / ``..._off.json``).
    - ``fused_decode`` (bool): uniform Mamba2 steps on the Triton kernels run the conv and
      the recurrence in one launch (:func:`~hybridserve.kernels.mamba_decode.conv_ssm_update`:
      no round trip of the conv output through memory, one launch less per layer); False
      runs them as two (``conv_decode_update``, ``ssm_update``: the benchmarks' comparison).
      ``fused_decode_max_rows`` (8): the fused launch is taken for steps of at most this
      many rows; larger ones take the two launches either way. On the H200 (8B layer,
      ``decode_kernels.json``) the fused kernel took 64 / 49 us against 138 / 147 us for
      the two launches at 1 row (q = 1 / 4) and 149 against 204 us for 24 layers in one
      graph, but 184 / 580 against 157 / 411 us at 64 rows and 697 / 2,326 against
      599 / 1,619 us at 256 (every program of a group recomputes the group's B and C);
      rows between 1 and 64 were not measured.
    - ``attention_splits``: the decode attention splits a row's keys across programs
      where (row, KV head) programs are too few to fill the GPU
      (:func:`~hybridserve.kernels.paged_attention.decode_splits`): ``"auto"`` / ``"on"``
      or ``"off"``. On the H200 (8B decode, ``gpu_bench.json``) one row
      took 43-44 us against 485 us unsplit at 8,192 keys and 104-105 us against 1.92 ms
      at 32,768; eight rows 0.19 against 0.49 ms and 0.74-0.75 against 1.94 ms. The
      prefill attention of captured short-row steps (a cached prompt's tail) splits too
      (:func:`~hybridserve.kernels.paged_attention_prefill.prefill_splits`): its 4
      layers took 0.28 against 0.97 ms in the 8B shape's cached first token, 0.08
      against 0.47 ms at the ~1B shape (``gpu_bench_ttft_chunks_on.json`` against
      ``gpu_bench_ttft_splits_off.json``). Eager prefill steps split only under ``"on"``
      (an unexplained cost in the packed path: see
      :class:`~hybridserve.models.layers.attention.Attention`).
    - ``conv_window_slabs``: eager prefill steps write their conv windows with the
      writer over the window tokens only (:mod:`hybridserve.kernels.conv_varlen`'s slab
      writer): ``"on"`` (``"auto"`` is the same) or ``"off"`` (the full-grid writer,
      which CUDA-graph steps take either way). On the H200 (8 x 4,096 tokens of the 8B
      conv, ``prefill_kernels_quick.json``) the conv with its windows took 0.71 ms
      against 1.06 ms with the full-grid writer at a window every 64 tokens, and 0.71
      against 0.76 ms where the step asks for none.
    - ``sampler``: the sampled draws (:func:`hybridserve.runner.sampler.draw`, the
      drafter's :func:`~hybridserve.runner.sampler.draft_draw`, the residual sample of
      :func:`~hybridserve.runner.sampler.speculative_choices`) as one Triton pass over
      the vocabulary each (:mod:`hybridserve.kernels.sampling`: the counter-based
      uniforms hashed in registers, no ``[rows x vocab]`` uniform or key tables) or as
      their torch twins; the same tokens either way (``tests/kernels/test_sampling.py``,
      its `gpu` tests at vocabulary 131,072 too). On the H200 the draw took 17 / 105 /
      373 us against the twin's 181 / 1,748 / 6,349 us at batch 1 / 64 / 256, and the
      whole sampled step (temperature 0.8, top-p 0.95) 175 / 1,335 / 4,406 us against
      341 / 2,971 / 10,380 (``sampler.json``).
    - ``token_prefetch``: the token-serial recurrence kernels (Mamba2's short rows,
      :func:`~hybridserve.kernels.mamba_decode.ssm_update` over rows of any length, and
      Gated DeltaNet's :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update`, its
      prefill by default) load each token's operands one token ahead, so their memory
      latency overlaps the previous token's update (the same values bit for bit):
      ``"on"`` (``"auto"`` is the same) or ``"off"``. On the H200 (010469a, its `gpu`
      tests in ``gpu_tests_010469a.txt``) the Gated DeltaNet kernel took 4.13 against
      6.15 ms for a 4,096-token prefill of one Qwen3.6-27B layer and 16.4 against 22.6 ms
      for 8 x 4,096 (``gdn_prefill_h200.json``), and the Mamba2 one 205-206 against
      258-261 us on a 128-token tail beside decode rows at the 8B shape (``kernel_checks``
      of ``gpu_bench.json`` and ``gpu_bench_prefetch_on.json``).
    - ``short_row_chunks``: Mamba2's short rows walk their tokens in chunks of
      :data:`~hybridserve.kernels.ssm_chunks.SHORT_ROW_CHUNK` as matrix products
      (:mod:`hybridserve.kernels.ssm_chunks`), so a tail of T tokens costs T / 16
      dependent rounds instead of T (the token walk's values to float32 rounding):
      ``"on"`` (``"auto"`` is the same; its `gpu` test passed in the engine's form,
      ``gpu_tests_b632ad1.txt``) or ``"off"``. On the H200 (8B tail beside two decode
      rows, states on the 64-token grid, ``short_rows.json``) the chunks took 128 us
      against the prefetching token walk's 145 for a 128-token tail and 556 against
      1,100 us for 1,024 tokens, at a relative error against float64 of 2.3e-7 (the walk
      1.2e-7). The engine's cached first token over 8,064 cached tokens, chunks against
      the token walk in one process (``cached_by_tail``): at the 8B shape 9.5-12.1
      against 11.3-13.7 ms for a 128-token tail and 39-45 against 50-55 ms for 1,024, in
      four runs (three machine starts); at the ~1B shape 4.0-5.2 against 4.4-5.5 ms in three
      of those runs and 6.2 against 5.9 ms in the fourth (``gpu_bench_ttft_chunks.json``,
      ``gpu_bench.json``, ``gpu_bench_ttft_chunks_on.json``,
      ``gpu_bench_ttft_splits_off.json``).
    """

    uniform_decode: bool = True
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    short_rows: str = "auto"
    max_short_tokens: int = 512
    packed_prefill: str = "auto"
    norms: str = "auto"
    activations: str = "auto"
    moe: str = "auto"
    gdn_rows: str = "auto"
    gdn_chunk: int = 64
    short_graphs: str = "auto"
    fused_decode: bool = True
    fused_decode_max_rows: int = 8
    drafter_graphs: str = "auto"
    logq_graphs: str = "auto"
    sampler: str = "auto"
    attention_splits: str = "auto"
    conv_window_slabs: str = "auto"
    token_prefetch: str = "auto"
    short_row_chunks: str = "auto"

    def __post_init__(self) -> None:
        for name in ("short_graphs", "drafter_graphs", "logq_graphs", "attention_splits",
                     "conv_window_slabs", "token_prefetch", "short_row_chunks"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ValueError(
                    f"kernel_policy.{name}={getattr(self, name)!r}: choose from ('auto', 'on', 'off')"
                )
        for name in ("decode_attention", "prefill_attention", "norms", "activations", "moe",
                     "sampler"):
            value = getattr(self, name)
            if value not in KERNEL_MODES:
                raise ValueError(f"kernel_policy.{name}={value!r}: choose from {KERNEL_MODES}")
        for name, modes in (("short_rows", PATH_MODES),
                            ("packed_prefill", (*PATH_MODES, "fused", "chunk_states", "fla"))):
            value = getattr(self, name)
            if value not in modes:
                raise ValueError(f"kernel_policy.{name}={value!r}: choose from {modes}")
        gdn_modes = ("auto", "triton", "reference", "chunked", "fla", "off")
        if self.gdn_rows not in gdn_modes:
            raise ValueError(f"kernel_policy.gdn_rows={self.gdn_rows!r}: choose from {gdn_modes}")
        if self.gdn_chunk < 1 or self.gdn_chunk & (self.gdn_chunk - 1):
            raise ValueError(f"kernel_policy.gdn_chunk must be a power of two, got {self.gdn_chunk}")
        if not isinstance(self.uniform_decode, bool):
            raise ValueError(f"kernel_policy.uniform_decode must be a bool, got {self.uniform_decode!r}")
        if (not isinstance(self.fused_decode_max_rows, int)
                or isinstance(self.fused_decode_max_rows, bool)
                or self.fused_decode_max_rows < 0):
            raise ValueError("kernel_policy.fused_decode_max_rows must be an int >= 0, got "
                             f"{self.fused_decode_max_rows!r}")
        if not isinstance(self.fused_decode, bool):
            raise ValueError(f"kernel_policy.fused_decode must be a bool, got {self.fused_decode!r}")
        if not 1 <= self.max_short_tokens <= 1 << 20:
            raise ValueError(
                f"kernel_policy.max_short_tokens must be in [1, 2**20], got {self.max_short_tokens}"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine core needs besides the model."""

    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpecConfig | None = None
    kernels: KernelPolicy = field(default_factory=KernelPolicy)
