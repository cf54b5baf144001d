"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, in vLLM's shape."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridserve import default_model
from hybridserve.config import (
    CHECKPOINT_POLICIES,
    CacheConfig,
    EngineConfig,
    KernelPolicy,
    SchedulerConfig,
    SpecConfig,
    resolve_dtype,
)
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import RequestOutput, SamplingParams
from hybridserve.generation_config import load_generation_config
from hybridserve.hub import resolve_model
from hybridserve.models.base import CacheSpec
from hybridserve.tokenizer import Tokenizer

DEFAULT_MODEL = default_model.PATH

log = logging.getLogger("hybridserve")

PromptType = str | list[int] | dict[str, Any]

NUM_THREADS_ENV = "HYBRIDSERVE_NUM_THREADS"


def resolve_num_threads(num_threads: int | None) -> int | None:
    """The torch CPU thread count an :class:`LLM` sets, or None to leave torch's as is.

    ``num_threads`` when given, else ``$HYBRIDSERVE_NUM_THREADS``, else None when
    ``$OMP_NUM_THREADS`` is set (torch already follows it), else 1. Why 1: the engine's
    CPU ops are small (rows run one at a time), so extra threads gain little, and on a
    machine whose cores are busy with other work OpenMP threads that wait for each other
    made generation an order of magnitude slower (benchmarks/results/cpu_threads.json).
    """
    source = "num_threads"
    if num_threads is None:
        env = os.environ.get(NUM_THREADS_ENV, "").strip()
        if not env:
            return None if os.environ.get("OMP_NUM_THREADS", "").strip() else 1
        source = f"${NUM_THREADS_ENV}"
        try:
            num_threads = int(env)
        except ValueError:
            raise ValueError(f"{source} must be an integer >= 1, got {env!r}") from None
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{source} must be an integer >= 1, got {num_threads!r}")
    return num_threads


def check_cache_fits(
    cache_spec: CacheSpec, cache: CacheConfig, dtype: torch.dtype, free_bytes: int
) -> int:
    """Bytes the caches of ``cache`` take; raises ValueError naming the knobs to lower
    when that exceeds 95% of ``free_bytes`` (better than failing inside an allocation)."""
    kv = cache_spec.kv_block_bytes(cache.kv_block_size, dtype) * cache.num_kv_blocks
    state = cache_spec.state_page_bytes(dtype, cache.ssm_state_dtype) * cache.num_state_pages
    if kv + state > 0.95 * free_bytes:
        raise ValueError(
            f"the caches need {(kv + state) / 2**30:.1f} GiB (KV {kv / 2**30:.1f} GiB in "
            f"{cache.num_kv_blocks} blocks, recurrent state {state / 2**30:.1f} GiB in "
            f"{cache.num_state_pages} pages) but {free_bytes / 2**30:.1f} GiB are free: "
            "lower num_state_pages (or max_num_seqs), num_kv_blocks or max_model_len"
        )
    return kv + state


def _check_tensor_parallel_options(enforce_eager, async_scheduling, speculative_config) -> None:
    """Refuse, naming the knob, what tensor parallelism does not run yet."""
    if enforce_eager is False:
        raise ValueError("enforce_eager=False (decode graphs) does not run under "
                         "tensor_parallel_size > 1 yet; leave it unset")
    if async_scheduling:
        raise ValueError("async_scheduling needs decode graphs, which do not run under "
                         "tensor_parallel_size > 1 yet")
    method = (speculative_config or {}).get("method")
    if method not in (None, "ngram"):
        raise ValueError(
            f"speculative_config method {method!r} runs a drafter model on one rank; under "
            "tensor_parallel_size > 1 only 'ngram' speculation is supported"
        )


class LLM:
    """An engine over one model, for batch generation in-process.

    Args mirror vLLM's where they exist. Cache sizes: ``num_kv_blocks`` attention blocks
    of ``kv_block_size`` tokens, ``num_state_pages`` recurrent-state pages (each holds
    every Mamba layer's conv window and SSM state); by default sized so that
    ``max_num_seqs`` requests of ``max_model_len`` tokens fit, plus room for
    checkpoints. ``max_model_len`` defaults to the model's ``max_position_embeddings``,
    capped at 4096. With ``gpu_memory_utilization`` set, the caches take that share of the
    device's memory instead (:mod:`hybridserve.engine.sizing` states the split) and
    ``max_model_len`` defaults to the model's own, uncapped; explicit sizes still win.
    ``kernel_policy`` picks which implementation each op of the forward takes
    (:class:`~hybridserve.config.KernelPolicy`; the defaults suit serving).

    ``tensor_parallel_size``: ranks the model is split over, one process each (this one
    is rank 0 and runs the engine; the others are spawned and load their shards; see
    :mod:`hybridserve.distributed`). On ``cuda[:k]`` rank ``r`` uses ``cuda:k+r``
    (NCCL); on ``cpu`` every rank computes on the CPU (gloo). Call :meth:`shutdown`
    to stop the other ranks before the process ends (they also end with it).

    ``num_threads``: torch's CPU thread count, a process-wide setting that the
    constructor applies (see :func:`resolve_num_threads` for the default, 1).
    ``model``: a checkpoint directory, a Hugging Face hub id (``org/name``, see
    :mod:`hybridserve.hub`), or None for the embedded default model.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_block_size: int = 16,
        num_kv_blocks: int | None = None,
        num_state_pages: int | None = None,
        enable_prefix_caching: bool = True,
        state_interval: int = 64,
        checkpoint_policies: Sequence[str] = CHECKPOINT_POLICIES,
        max_checkpoint_pages: int | None = None,
        ssm_state_dtype: str | torch.dtype = "float32",
        eviction_policy: str = "lru",
        checkpoint_offload_gib: float = 0.0,
        checkpoint_offload_pages: int | None = None,
        gpu_memory_utilization: float | None = None,
        checkpoint_memory_fraction: float = 0.2,
        enforce_eager: bool | None = None,
        speculative_config: dict[str, Any] | None = None,
        async_scheduling: bool | None = None,
        num_threads: int | None = None,
        kernel_policy: KernelPolicy | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        from hybridserve.models.loader import load_model

        tp = tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1:
            _check_tensor_parallel_options(enforce_eager, async_scheduling, speculative_config)
            enforce_eager = True
        self.tensor_parallel_size = tp
        self._tensor = None

        kernel_policy = kernel_policy or KernelPolicy()
        threads = resolve_num_threads(num_threads)
        if threads is not None:
            torch.set_num_threads(threads)

        if model is None:
            path = DEFAULT_MODEL
            name = str(path)
        else:
            path = resolve_model(model)
            # A hub id keeps its name (the server's default model name); a path stays a path.
            name = str(path) if path == Path(model).expanduser() else str(model)
        self.model_path = path
        torch_dtype = resolve_dtype(dtype)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} was asked for but this machine has no CUDA device")
        if gpu_memory_utilization is not None:
            from hybridserve.engine import sizing

            # As vLLM does: the share is of the whole device, so memory other processes
            # hold must leave it free at start, or the caches would be sized past it.
            sizing.check_free_memory(device, gpu_memory_utilization)
        if tp == 1:
            self.model = load_model(path, dtype=torch_dtype, device=device, policy=kernel_policy)
        else:
            from hybridserve.distributed.worker import start_tensor_parallel

            self.model, group, workers = start_tensor_parallel(dict(
                path=str(path), world_size=tp, dtype=torch_dtype, device=device,
                policy=kernel_policy, num_threads=threads,
            ))
            self._tensor = (group, workers)
        try:
            # Every option by name: the engine is built in its own method so that a
            # failure there can stop the other ranks first.
            self._build_engine(
                name=name, path=path, torch_dtype=torch_dtype, device=device,
                seed=seed, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
                num_state_pages=num_state_pages,
                enable_prefix_caching=enable_prefix_caching,
                state_interval=state_interval,
                checkpoint_policies=checkpoint_policies,
                max_checkpoint_pages=max_checkpoint_pages,
                ssm_state_dtype=ssm_state_dtype, eviction_policy=eviction_policy,
                checkpoint_offload_gib=checkpoint_offload_gib,
                checkpoint_offload_pages=checkpoint_offload_pages,
                gpu_memory_utilization=gpu_memory_utilization,
                checkpoint_memory_fraction=checkpoint_memory_fraction,
                enforce_eager=enforce_eager, speculative_config=speculative_config,
                async_scheduling=async_scheduling, kernel_policy=kernel_policy,
            )
        except BaseException:
            self._stop_workers()
            raise

    def _build_engine(
        self, *, name, path, torch_dtype, device, seed, max_num_seqs, max_model_len,
        max_num_batched_tokens, kv_block_size, num_kv_blocks, num_state_pages,
        enable_prefix_caching, state_interval, checkpoint_policies, max_checkpoint_pages,
        ssm_state_dtype, eviction_policy, checkpoint_offload_gib, checkpoint_offload_pages,
        gpu_memory_utilization, checkpoint_memory_fraction, enforce_eager, speculative_config,
        async_scheduling, kernel_policy,
    ) -> None:
        # A rank's model is built from its share of the heads: the model's own config is
        # the full one.
        mcfg = self.model.config if self._tensor is None else self.model.shard_layout.config
        self.model_config = mcfg
        self.tokenizer = Tokenizer.maybe_load(path)
        self.generation_config = load_generation_config(path)
        speculative = SpecConfig.from_dict(speculative_config)
        if max_model_len is None:
            # Sized from the device, a model gets its own length; otherwise the caches
            # are sized from max_model_len, so it is capped.
            max_model_len = mcfg.max_position_embeddings
            if gpu_memory_utilization is None:
                max_model_len = min(max_model_len, 4096)
        if max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{mcfg.max_position_embeddings}"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs)
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        d = speculative.num_speculative_tokens if speculative else 0
        plan = None
        if gpu_memory_utilization is not None:
            from hybridserve.engine import sizing

            ssm_dtype = resolve_dtype(ssm_state_dtype, "ssm_state_dtype")
            plan = sizing.plan_memory(
                capacity_bytes=sizing.device_capacity_bytes(device),
                gpu_memory_utilization=gpu_memory_utilization,
                weights_bytes=sizing.weights_bytes(self.model),
                activation_peak_bytes=self._activation_peak(
                    max_num_batched_tokens, kv_block_size, torch_dtype, ssm_dtype, device
                ),
                kv_block_bytes=self.model.cache_spec.kv_block_bytes(kv_block_size, torch_dtype),
                kv_block_size=kv_block_size,
                state_page_bytes=self.model.cache_spec.state_page_bytes(torch_dtype, ssm_dtype),
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                pages_per_seq=d + 4,
                checkpoint_memory_fraction=checkpoint_memory_fraction,
                checkpoint_pages=max_checkpoint_pages,
            )
            log.info("%s", plan.log_line())
            num_kv_blocks = plan.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
            num_state_pages = plan.num_state_pages if num_state_pages is None else num_state_pages
            if max_checkpoint_pages is None:
                max_checkpoint_pages = plan.max_checkpoint_pages
        self.memory_plan = plan
        blocks_per_seq = -(-max_model_len // kv_block_size)
        if num_kv_blocks is None:
            num_kv_blocks = max(blocks_per_seq * min(max_num_seqs, 8), 256)
        if num_kv_blocks < blocks_per_seq:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks} cannot hold one sequence of max_model_len="
                f"{max_model_len} ({blocks_per_seq} blocks of {kv_block_size} tokens)"
            )
        checkpoint_pages = 64 if max_checkpoint_pages is None else max_checkpoint_pages
        if num_state_pages is None:
            # Per running request: its state, its kept block-boundary state, and the
            # 1 + d pages a step writes (plus prefill checkpoints inside one chunk).
            num_state_pages = max_num_seqs * (d + 4) + checkpoint_pages + 8
        cache = CacheConfig(
            kv_block_size=kv_block_size,
            num_kv_blocks=num_kv_blocks,
            num_state_pages=num_state_pages,
            enable_prefix_caching=enable_prefix_caching,
            state_interval=state_interval,
            checkpoint_policies=tuple(checkpoint_policies),
            max_checkpoint_pages=min(checkpoint_pages, num_state_pages - 1),
            ssm_state_dtype=resolve_dtype(ssm_state_dtype, "ssm_state_dtype"),
            eviction_policy=eviction_policy,
            checkpoint_offload_gib=checkpoint_offload_gib,
            checkpoint_offload_pages=checkpoint_offload_pages,
        )
        cache_spec = self.model.cache_spec
        page_bytes = cache_spec.state_page_bytes(torch_dtype, cache.ssm_state_dtype)
        log.info(
            "state page: %d bytes (%.1f MiB) for %d recurrent layers (conv windows in %s, "
            "recurrent states in %s); %d pages: %.2f GiB",
            page_bytes, page_bytes / 2**20, len(cache_spec.recurrent_layers),
            str(torch_dtype).removeprefix("torch."),
            str(cache.ssm_state_dtype).removeprefix("torch."),
            cache.num_state_pages, page_bytes * cache.num_state_pages / 2**30,
        )
        if device.startswith("cuda") and plan is None:
            check_cache_fits(
                self.model.cache_spec, cache, torch_dtype,
                free_bytes=torch.cuda.mem_get_info(torch.device(device))[0],
            )
        self.config = EngineConfig(
            model=name, dtype=torch_dtype, device=device, seed=seed,
            cache=cache, scheduler=sched, speculative=speculative,
            kernels=kernel_policy,
        )
        eos = tuple(mcfg.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        # generation_config.json may name more (a chat model's end-of-turn token).
        eos += tuple(e for e in self.generation_config.eos_token_ids if e not in eos)
        # enforce_eager: None replays uniform greedy decode steps from CUDA graphs on
        # CUDA and runs eagerly elsewhere; True always runs eagerly (as vLLM's flag).
        # async_scheduling: None pipelines plain decode steps wherever graphs run and
        # speculative decoding is off.
        group, workers = self._tensor or (None, ())
        self.engine = EngineCore(
            self.config, self.model, self.tokenizer, mcfg.vocab_size, eos,
            enforce_eager=enforce_eager, async_scheduling=async_scheduling,
            tensor_group=group, tensor_workers=workers,
        )
        self._next_id = 0
        self._warned_capped = False

    def _activation_peak(self, num_tokens, kv_block_size, dtype, ssm_dtype, device) -> int:
        """The profiling forward's peak (:func:`~hybridserve.engine.sizing.profile_activation_peak`);
        under tensor parallelism every rank runs it (its collectives pair up) and the
        largest rank's peak counts."""
        from hybridserve.engine import sizing

        args = (num_tokens, kv_block_size, dtype, ssm_dtype)
        if self._tensor is None:
            return sizing.profile_activation_peak(self.model, *args, device)
        group, _ = self._tensor
        group.broadcast_object(("profile", args))
        peak = sizing.profile_activation_peak(self.model, *args, device)
        return max(group.all_gather_object(peak))

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank). The
        engine cannot run steps afterwards."""
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._tensor is None:
            return
        group, workers = self._tensor
        self._tensor = None
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.runner.close()
            return
        # The engine was never built: the workers wait for their cache sizes.
        try:
            group.broadcast_object(("stop", None))
        finally:
            group.close()
            for proc in workers:
                proc.join(30)
                if proc.is_alive():
                    proc.terminate()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model ships no tokenizer.json: pass prompts as token ids")
            if not prompt:
                raise ValueError("prompt is empty: give non-empty text or token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in order.

        Every prompt is validated before any is queued, so a bad prompt raises
        ValueError and leaves the engine as it was. As vLLM's: a prompt of
        ``max_model_len`` tokens or more is refused; a ``max_tokens`` that does not fit
        in the context after the prompt is capped there (the output ends with
        ``finish_reason == "length"``), with a warning the first time it happens. A
        prompt whose generation fails inside the engine comes back with finish reason
        ``"error"`` and :attr:`RequestOutput.error` set; the other prompts are unaffected.
        """
        # Only finished outputs are collected: per-step outputs are not built.
        ids_order = self._add(self._prepare(prompts, sampling_params), final_only=True)
        return self._run(ids_order, use_tqdm)

    def _prepare(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[tuple[str | None, list[int], SamplingParams]]:
        """Validate and encode every prompt (text, token ids, params), queueing nothing."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        encoded = [self._to_token_ids(p) for p in prompts]
        max_len = self.config.scheduler.max_model_len
        for i, (_, ids) in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= max_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but max_model_len is {max_len}: "
                    "shorten it or raise max_model_len"
                )
        for i, ((_, ids), params) in enumerate(zip(encoded, params_list)):
            room = max_len - len(ids)
            if params.max_tokens is not None and params.max_tokens > room and not self._warned_capped:
                self._warned_capped = True
                warnings.warn(
                    f"prompt {i} has {len(ids)} tokens, so max_tokens={params.max_tokens} does not "
                    f"fit in max_model_len={max_len}: its output is capped at {room} tokens "
                    "(finish_reason 'length'); raise max_model_len for longer outputs. "
                    "(Shown once per LLM.)",
                    stacklevel=3,
                )
        return [(text, ids, params) for (text, ids), params in zip(encoded, params_list)]

    def _add(
        self, prepared: list[tuple[str | None, list[int], SamplingParams]], final_only: bool
    ) -> list[str]:
        ids_order = []
        for text, ids, params in prepared:
            rid = f"gen-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, params, prompt=text, final_only=final_only)
            ids_order.append(rid)
        return ids_order

    def _stream(
        self, prepared: list[tuple[str | None, list[int], SamplingParams]]
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Queue :meth:`_prepare`'s requests and yield ``(prompt index, cumulative
        output)`` after every step that advanced one, until all are finished (the
        command line prints text as it comes). Closing the generator early aborts
        what is left."""
        ids_order = self._add(prepared, final_only=False)
        index = {rid: i for i, rid in enumerate(ids_order)}
        left = set(ids_order)
        try:
            while left and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in left:
                        if out.finished:
                            left.discard(out.request_id)
                        yield index[out.request_id], out
        finally:
            for rid in left:
                self.engine.abort_request(rid)

    def _run(self, ids_order: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids_order), desc="Generating", unit="req", dynamic_ncols=True)
        done: dict[str, RequestOutput] = {}
        wanted = set(ids_order)
        try:
            while self.engine.has_unfinished_requests() and len(done) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids_order:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids_order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``
        messages) or to a list of them, rendered with the checkpoint's chat template
        (or ``chat_template``). Raises ValueError when the model has no template."""
        from hybridserve.chat_template import compile_chat_template, pick_template, render_chat

        if self.tokenizer is None:
            raise ValueError("this model ships no tokenizer.json, so it cannot chat")
        source = chat_template or pick_template(self.tokenizer.chat_template)
        if source is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json 'chat_template'); "
                "pass chat_template=..."
            )
        template = compile_chat_template(source)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {
                "prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
            }
            for text in (
                render_chat(
                    template, conv, add_generation_prompt=add_generation_prompt,
                    bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token,
                )
                for conv in conversations
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> dict[str, float | int]:
        """Engine counters (prefix-cache hits, checkpoints, speculative acceptance...)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Drop every checkpoint and forget cached KV blocks."""
        self.engine.scheduler.clear_prefix_cache()
