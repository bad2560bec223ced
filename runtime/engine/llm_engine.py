"""LLMEngine: requests in, one scheduled forward pass per step(), RequestOutputs out.

Single-threaded by design: the server calls add_request/abort_request/step from one thread
(through the engine client, runtime/engine/client.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine.core import EngineCore
from kvserve.runtime.engine.detokenizer import make_decode_fn
from kvserve.runtime.engine.input_processor import InputProcessor, Prompt
from kvserve.runtime.engine.output_processor import OutputProcessor
from kvserve.runtime.engine.scheduler import SchedulerConfig
from kvserve.runtime.executor import create_executor

# Defined on the executor's side now; importable from here for existing callers.
from kvserve.runtime.executor.base import hybrid_kv_groups, kv_release_window
from kvserve.runtime.executor.platform import resolve_device
from kvserve.runtime.kv_cache import kv_cache_torch_dtype
from kvserve.runtime.kv_events.publisher import attach_kv_events
from kvserve.runtime.lora.request import LoRARequest
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.stats import EngineStats, StatsCollector
from kvserve.runtime.structured_outputs.manager import StructuredOutputManager

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

__all__ = ["LLMEngine", "Prompt", "resolve_device", "resolve_dtype", "check_kv_cache_dtype_for_model",
           "kv_release_window", "hybrid_kv_groups"]


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _check_kv_cache_dtype(kv_dtype: torch.dtype, backend: str, device: torch.device) -> None:
    """Triton reads float8 e4m3 with the conversion GPUs have from sm_89 (Ada, Hopper) on; on an
    older GPU that kernel cannot compile, so say so before any weight is loaded."""
    if kv_dtype == torch.float8_e4m3fn and backend == "triton" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype: fp8 / fp8_e4m3 needs a GPU of compute capability 8.9 or "
                             f"newer with the triton attention backend (this one is {major}.{minor}); "
                             f"use fp8_e5m2, attention_backend='torch', or kv_cache_dtype='auto'")


def check_kv_cache_dtype_for_model(kv_cache_dtype: str, model_config) -> None:
    """The latent (MLA) cache has no float8 form yet. Pure: the CLI runs it before listening."""
    if kv_cache_dtype != "auto" and model_config.shape.mla is not None:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported for multi-head latent "
                         f"attention models ({model_config.architecture}) yet; use 'auto'")


class LLMEngine:
    """The four pieces put together: InputProcessor -> EngineCore (scheduler, executor) ->
    OutputProcessor. Single-threaded: add_request/abort_request/step come from one thread.
    Implements the server's EngineClient (runtime/engine/client.py)."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        """`tokenizer`: one this config's model loaded before (a live reshape's engine reuses a
        retired engine's: loading one holds the GIL for most of a second)."""
        from transformers import AutoTokenizer

        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.gguf import is_gguf_path
        from kvserve.runtime.gguf import load_tokenizer as load_gguf_tokenizer
        from kvserve.runtime.gguf.reader import resolve_model_path
        from kvserve.runtime.model_config import ModelConfig
        from kvserve.runtime.models.quantization import resolve_quantization

        config.model = resolve_model_path(config.model)  # a fetched GGUF directory -> its file
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.dtype, self.device)
        # Before the tokenizer and any worker: a format this checkpoint or device cannot take fails first.
        self.quant_config = resolve_quantization(config.quantization, self.model_config.hf_config)
        if self.quant_config is not None:
            self.quant_config.check_supported(self.device, self.dtype)
        self.quantization = self.quant_config.name if self.quant_config is not None else None
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        check_kv_cache_dtype_for_model(config.kv_cache_dtype, self.model_config)
        self.max_model_len = self.model_config.resolve_max_model_len(config.max_model_len)
        self.model_config = self.model_config.for_max_model_len(self.max_model_len)  # LongRoPE's factors
        if tokenizer is not None:
            self.tokenizer = tokenizer
        elif config.tokenizer is None and is_gguf_path(config.model):
            self.tokenizer = load_gguf_tokenizer(config.model)  # from the file's metadata
        else:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
            except (ValueError, OSError) as exc:  # transformers' message is long and names no file
                raise ValueError(f"model: no usable tokenizer in {str(config.tokenizer or config.model)!r} "
                                 f"(tokenizer.json, tokenizer.model, ...): {' '.join(str(exc).split())[:300]}") from None
        self._decode = make_decode_fn(self.tokenizer)
        self.vocab_size = self.model_config.vocab_size

        _check_kv_cache_dtype(self.kv_cache_dtype, get_attention_backend(config.attention_backend, self.device).name,
                              self.device)
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens(self.max_model_len)
        # Weights, KV pools, graphs, the sampler and speculative decoding, on every rank.
        self.executor = create_executor(config, self.model_config, device=self.device, dtype=self.dtype,
                                        max_model_len=self.max_model_len, quant_config=self.quant_config)
        ex = self.executor
        self.attention_backend = ex.attention_backend
        self.kv_groups = ex.kv_groups
        self.kv_group_blocks = ex.num_blocks_per_group
        self.num_kv_blocks = ex.num_blocks_per_group[0]
        self.model_weight_bytes = ex.model_weight_bytes
        self.lora = ex.lora_manager  # None without enable_lora
        if config.async_scheduling and not ex.supports_overlap:
            # Speculative steps: their drafts read the newest tokens.
            log.info("async_scheduling: not with speculative decoding; steps run synchronously")

        eos = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos |= {self.tokenizer.eos_token_id}
        self._stats = StatsCollector()
        self.core = EngineCore(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            max_loras=config.max_loras if config.enable_lora else 0),
            self.executor, enable_prefix_caching=config.enable_prefix_caching,
            async_scheduling=config.async_scheduling, stats=self._stats,
            attach_grammar=lambda head, compiled: self.input_processor.attach_grammar(head, compiled))
        self.scheduler = self.core.scheduler
        self.block_manager = self.core.block_manager
        self.kv_event_sink, self.kv_event_publisher = attach_kv_events(config.kv_events_config, self.block_manager)
        if self.kv_event_sink is not None and self.lora is not None:  # adapter blocks name their adapter
            self.kv_event_sink.lora_identity = self.lora.identity
        self.offload = None
        if ex.offloader is not None:
            self.offload = self._attach_offload(config, ex)
            self.offload.attach_events(self.kv_event_sink)  # tier stores and removals, medium CPU or DISK
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size, eos)
        self.input_processor = InputProcessor(self.tokenizer, self._decode, vocab_size=self.vocab_size,
                                              max_model_len=self.max_model_len, eos_token_ids=eos,
                                              check_fits=self.scheduler.check_fits,
                                              structured_outputs=self.structured_outputs, device=self.device)
        self.output_processor = OutputProcessor(self._decode, self._stats)
        self._pending: list[RequestOutput] = []  # aborted requests' final outputs, sent by step()
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens (%s), max_model_len %d, backend %s",
                 self.model_config.architecture, self.device, self.dtype, self.num_kv_blocks,
                 config.block_size, str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len,
                 self.attention_backend)
        if self.kv_groups is not None:
            log.info("KV cache groups: %s", ", ".join(
                f"{'full attention' if g.window is None else f'window {g.window}'}: {len(g.layers)} layers, {n} blocks"
                for g, n in zip(self.kv_groups, self.kv_group_blocks)))

    def _attach_offload(self, config: EngineConfig, ex):
        from kvserve.runtime.kv_offload.manager import OffloadManager
        from kvserve.runtime.kv_offload.offloader import TIER

        if config.kv_offload_bytes and not config.enable_prefix_caching:
            log.warning("kv_offload_bytes: the offload tier finds blocks by their prefix-cache keys, and "
                        "prefix caching is off: nothing will be stored")
        tier = ex.offloader.stores.get(TIER)
        offload = OffloadManager(apply=ex.kv_offload_apply, block_bytes=ex.offload_block_bytes,
                                 block_size=config.block_size, tier_bytes=config.kv_offload_bytes,
                                 swap_bytes=int(config.swap_space * 2**30),
                                 medium=getattr(tier, "medium", "CPU"), existing=ex.kv_offload_scan())
        offload.flush()  # forget what the warm index could not keep
        self.core.attach_offload(offload)
        log.info("kv offload: tier %s (%d bytes per rank%s), swap space %d bytes per rank",
                 getattr(tier, "medium", "off"), config.kv_offload_bytes,
                 f", {tier.dir}" if getattr(tier, "persistent", False) else "", int(config.swap_space * 2**30))
        return offload

    # Rank 0's parts, owned by the executor (None once closed).
    @property
    def model(self):
        return self.executor.model

    @property
    def kv_caches(self):
        return self.executor.kv_caches

    @property
    def runner(self):
        return self.executor.runner

    @property
    def spec_decoder(self):
        return self.executor.spec_decoder

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_args(**kwargs))

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | dict | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queues a request; raises ValueError naming the bad field (and queues nothing). A grammar
        still compiling is waited for, so a compile that fails raises here instead of ending a
        queued request with "abort" (all or nothing); callers that compile first and must not
        block (the server) use add_requests."""
        self.add_requests([(request_id, prompt, params)], arrival_time=arrival_time, lora_request=lora_request,
                          wait_for_grammars=True)

    def add_requests(self, requests: Iterable[tuple[str, Prompt, SamplingParams | dict | None]],
                     arrival_time: float | None = None, *, wait_for_grammars: bool = False,
                     lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> None:
        """Queues a batch (an HTTP request's prompts, an offline generate() call) all or nothing:
        the first bad request raises ValueError naming its field and none of them is queued.
        A grammar still compiling is waited for with `wait_for_grammars`; otherwise its request
        waits in the core (and ends with finish_reason "abort" if the compile fails).
        `lora_request`: one adapter for the whole batch, or one (or None) per request; an adapter
        not registered yet is loaded first (as add_lora)."""
        requests = list(requests)
        loras = self._lora_requests(lora_request, len(requests))
        heads = self.input_processor.process_batch(requests, self.core.requests.__contains__, arrival_time,
                                                   wait_for_grammars=wait_for_grammars, lora_requests=loras,
                                                   lora_cache_key=None if self.lora is None else self.lora.cache_key)
        self._stats.structured_output_requests_total += sum(
            1 for h in heads if h.params.structured_outputs is not None)
        self.core.add(heads)

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras / pin_lora) ------------------
    def _check_lora_enabled(self) -> None:
        if self.lora is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (start the engine with enable_lora=True, "
                             "or serve with --enable-lora)")

    def _lora_requests(self, lora_request, n: int) -> list | None:
        """One LoRARequest (or None) per request, each registered (loaded) before anything queues."""
        if lora_request is None:
            return None
        if isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        elif isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"lora_request: {len(loras)} given for {n} prompts")
        else:
            raise ValueError(f"lora_request: expected a LoRARequest or a list of them, got {type(lora_request).__name__}")
        if all(r is None for r in loras):
            return None
        self._check_lora_enabled()
        for r in loras:
            if r is not None and not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request: expected a LoRARequest, got {type(r).__name__}")
        for r in dict.fromkeys(r for r in loras if r is not None):
            self.lora.add(r)  # already registered: a no-op; a bad adapter raises here
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter and checks it against the model (ValueError naming the problem: rank
        above max_lora_rank, a target module the model lacks, another base model, missing files).
        False if this exact adapter is already loaded."""
        self._check_lora_enabled()
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter; False if none has that id. ValueError while requests use it."""
        self._check_lora_enabled()
        users = sum(1 for r in self.core.requests.values()
                    if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)
        if users:
            raise ValueError(f"lora_int_id: adapter {lora_int_id} is in use by {users} unfinished request(s)")
        return self.lora.remove(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keeps an adapter in the host cache whatever max_cpu_loras says; False if unknown."""
        self._check_lora_enabled()
        return self.lora.pin(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters (empty without LoRA)."""
        return set() if self.lora is None else self.lora.list()

    def get_lora(self, lora_int_id: int) -> LoRARequest | None:
        return None if self.lora is None else self.lora.get(lora_int_id)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def check_token_ids(self, ids: Iterable[Any], field: str) -> None:
        self.input_processor.check_token_ids(ids, field)

    def abort_request(self, request_id: str) -> None:
        """Ends a request at once and frees its KV blocks; unknown or finished ids are ignored.
        Its final output (finish_reason "abort") comes with the next step()."""
        head = self.core.abort(request_id)
        if head is not None:
            self._pending.append(self.output_processor.make_output(head, finished=True))

    def has_unfinished_requests(self) -> bool:
        return self.core.busy or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.core.requests)

    def check_health(self) -> None:
        """Raises if the engine can no longer step (a tensor-parallel worker died)."""
        self.executor.check_health()

    def close(self) -> None:
        """Stops and reaps the tensor-parallel workers, if any, and frees the weights and KV
        pools. Idempotent; no step() after it. A persistent offload tier first gets every cached
        block of the pool, so a restarted engine finds them."""
        self.persist_kv_offload()
        self.executor.shutdown()
        self.core.shutdown()
        self.kv_event_publisher.close()
        self.structured_outputs.close()

    def persist_kv_offload(self) -> None:
        """With a persistent offload tier: writes every cached pool block it lacks (before the
        pools go away: shutdown, or a reshape retiring this engine)."""
        offloader = self.executor.offloader
        if self.offload is None or offloader is None or not getattr(offloader.stores.get(0), "persistent", False) \
                or self.config.kv_offload_transient:  # a reshape's move tier: deleted, never kept
            return
        try:
            n = self.core.save_cached_blocks()
            log.info("kv offload: %d cached pool blocks written to the persistent tier", n)
        except Exception:  # shutting down anyway: the tier keeps what it has
            log.exception("kv offload: saving the pool's cached blocks failed")

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reshape (runtime/engine/data_parallel.py) ----------------------------------------------
    def detach_requests(self) -> tuple[list[RequestOutput], list]:
        """Stops this engine's work for a reshape: the outputs still owed (a step in flight, aborts,
        failures) and every unfinished request, ready for another engine's attach_requests."""
        outputs, self._pending = self._pending, []
        while (done := self.core.finish_inflight()) is not None:  # pipelined: several in flight
            outputs += self.output_processor.make_outputs(self.output_processor.process(done.update, done.now))
        outputs += self._failed_outputs()
        return outputs, self.core.detach_all()

    def attach_requests(self, heads: list) -> None:
        """Requests another engine detached: they resume by recomputing their tokens here."""
        self.core.attach(heads)

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        try:
            done = self.core.step()
        except BaseException:
            self._pending += self._failed_outputs()  # for the caller that goes on stepping
            raise
        finally:
            if self.kv_event_sink is not None:
                self.kv_event_publisher.publish(self.kv_event_sink.take())
        outputs += self._failed_outputs()
        if done is None:
            return outputs
        t_emit = time.perf_counter()
        changed = self.output_processor.process(done.update, done.now)
        outputs += self.output_processor.make_outputs(changed)
        self.core.record_phases(done.step, done.bookkeeping + time.perf_counter() - t_emit)
        return outputs

    def _failed_outputs(self) -> list[RequestOutput]:
        """Final outputs of the requests the core ended (a failed grammar or forward pass)."""
        failed, self.core.failed = self.core.failed, []
        return [self.output_processor.make_output(head, finished=True) for head in failed]

    # -- statistics ------------------------------------------------------------------------------
    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}

        def names(seqs) -> list[str]:
            ids = sorted({s.lora_int_id for s in seqs if s.lora_int_id})
            return [r.lora_name for r in map(self.lora.get, ids) if r is not None]

        return dict(running_lora_adapters=names(self.scheduler.running),
                    waiting_lora_adapters=names(self.scheduler.waiting), max_lora=self.config.max_loras)

    def _offload_stats(self) -> dict[str, Any]:
        offload, offloader = self.offload, self.executor.offloader
        if offload is None or offloader is None:
            return {}
        st = offload.stats
        store_s, load_s = offloader.drain_timings()
        tier, swap = offload.tier, offload.swap
        return dict(
            kv_offload_capacity_bytes=tier.capacity_bytes if tier else 0,
            kv_offload_used_bytes=tier.used_bytes if tier else 0,
            kv_offload_queries_tokens_total=st.queries_tokens, kv_offload_hit_tokens_total=st.hit_tokens,
            kv_offload_hit_blocks_total=st.hit_blocks, kv_offload_stored_blocks_total=st.stored_blocks,
            kv_offload_stored_bytes_total=offloader.stored_bytes,
            kv_offload_loaded_bytes_total=offloader.loaded_bytes,
            kv_offload_failed_loads_total=st.failed_loads,
            kv_offload_prefetched_blocks_total=offloader.prefetched_loads,
            kv_swap_capacity_bytes=swap.capacity_bytes if swap else 0, kv_swap_used_bytes=swap.used_bytes if swap else 0,
            kv_swap_outs_total=st.swap_outs, kv_swap_ins_total=st.swap_ins,
            num_swapped=sum(1 for s in self.scheduler.waiting if s.swapped is not None),
            kv_offload_store_seconds=store_s, kv_offload_load_seconds=load_s)

    def _kv_events_stats(self) -> dict[str, int]:
        if getattr(self, "kv_events_shared", False):  # engine 0's publisher, counted there only
            return {}
        publisher = self.kv_event_publisher
        return {"kv_events_published_total": publisher.published, "kv_events_dropped_total": publisher.dropped}

    def get_stats(self) -> EngineStats:
        """Gauges and counters now, plus latency observations made since the previous call."""
        now = StatsCollector.now()
        s = self._stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            max_num_seqs=self.config.max_num_seqs,
            tensor_parallel_size=self.config.tensor_parallel_size,
            pipeline_parallel_size=self.config.pipeline_parallel_size,
            pipeline_bubble_fraction=getattr(self.executor, "pipeline_bubble_fraction", 0.0),
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits,
            computed_tokens_total=s.computed_tokens_total,
            spec_decode_num_drafts_total=s.spec_num_drafts,
            spec_decode_num_draft_tokens_total=s.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens_total=s.spec_num_accepted_tokens,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            request_success_total=dict(s.request_success_total),
            generation_tokens_per_second=s.rate(now),
            structured_output_requests_total=s.structured_output_requests_total,
            model_weight_bytes=self.model_weight_bytes,
            cuda_graph_capture_failures_total=self.executor.graph_capture_failures,
            quantization=self.quantization or "none",
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(getattr(self.config, "kv_cache_dtype", "auto")),
            grammar_compile_times=self.structured_outputs.drain_compile_times(),
            **self._offload_stats(),
            **self._kv_events_stats(),
            timestamp=now,
            **self._lora_stats(),
            **s.drain(),
        )
