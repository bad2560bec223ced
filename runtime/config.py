"""Engine options (the `LLM(...)` / `LLMEngine.from_args(...)` keyword arguments), validated once."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.capacity.dtypes import KV_CACHE_DTYPES
from kvserve.runtime.weight_formats import WEIGHT_FORMATS, format_name

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_BACKENDS = ("auto", "torch", "triton")


# vLLM's --lora-dtype values.
LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")

@dataclass
class EngineConfig:
    """Everything the engine needs to start. Bad values raise ValueError naming the field.

    KV pool size: ``num_kv_blocks`` if given, else ``kv_cache_memory_bytes``, else (CUDA) free GPU
    memory x ``gpu_memory_utilization``, else (CPU) ``DEFAULT_CPU_KV_BYTES``.
    ``max_model_len=None`` means the model's ``max_position_embeddings``.
    ``max_num_batched_tokens=None`` means 2048 with chunked prefill, else ``max_model_len``.
    With ``tensor_parallel_size`` N every rank (GPU) has its own pool: the byte budgets are per rank.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # Layers split into this many stages, one group of tensor_parallel_size ranks each
    # (runtime/executor/pipeline_worker.py); ranks = pipeline x tensor parallel.
    pipeline_parallel_size: int = 1
    # Micro-batches in flight at pipeline_parallel_size > 1 (None: one per stage, so the stages
    # overlap; 1: one step at a time, the pipeline bubble stays). Ignored at P = 1.
    max_concurrent_batches: int | None = None
    enable_prefix_caching: bool = True
    # {"method": "ngram" | "draft_model" | "medusa", "num_speculative_tokens": k, "model": DIR,
    #  "prompt_lookup_max": 4, "prompt_lookup_min": 1}, or that as a JSON string.
    speculative_config: Any = None
    # "auto" (the model dtype) or "fp8" / "fp8_e4m3" / "fp8_e5m2": K/V stored as float8 with
    # per-layer scales (1.0, or the checkpoint's k_scale / v_scale), read back dequantized.
    kv_cache_dtype: str = "auto"
    # Weight format (vLLM's names): None follows the checkpoint's quantization_config (full
    # precision if it has none); "int8"/"int4"/"fp8" quantize a full-precision checkpoint at load.
    quantization: str | None = None
    # CUDA graphs for decode steps are on by default on a GPU; True runs every step eagerly.
    enforce_eager: bool = False
    # {"level": 0 | 3, "cudagraph_capture_sizes": [1, 2, 4, ...], "max_capture_size": 512}, that
    # as a JSON string, or a bare level (kvserve.runtime.executor.cuda_graphs.CompilationConfig).
    compilation_config: Any = None
    # Overlap: run step N+1's forward pass while step N's tokens are detokenized and streamed.
    async_scheduling: bool = False
    # Models mixing local and global layers (Gemma 2/3) keep one block table per layer group, so
    # the local layers hold only their window; True keeps one table for all layers (every layer
    # then holds the whole context).
    disable_hybrid_kv_cache_manager: bool = False
    # LoRA adapters (runtime/lora/): off by default, and then the model runs exactly as without them.
    # max_loras: distinct adapters in one step (device slots); max_lora_rank: the largest rank
    # accepted (slots are sized for it); max_cpu_loras: adapters kept loaded in host memory
    # (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's lora_dtype: the adapters' slot dtype ("auto": the model's). bfloat16 under a float32
    # model halves the adapter bytes each decode step reads.
    lora_dtype: str = "auto"
    # vLLM's KVEventsConfig (runtime/kv_events/config.py), a dict or its JSON string: publish the
    # prefix cache's stored / removed blocks over ZMQ for a cache-aware router.
    kv_events_config: Any = None
    # The KV offload tier (kvserve.runtime.kv_offload): blocks leaving the pool are kept there, up
    # to this many bytes per rank, and found again by their prefix-cache hashes. 0: no tier.
    kv_offload_bytes: int = 0
    # A directory for the tier's files (local disk, a PVC): it survives restarts and is keyed by
    # model, revision, dtype, block size and TP layout. None: host memory (pinned on CUDA).
    kv_offload_dir: str | None = None
    # Set by a live layout change only (runtime/engine/reshape_kv.py): kv_offload_dir is that
    # reshape's private directory in RAM, read while the moved requests resume, then deleted (no
    # fsync, no copies of other layouts' files, evicted blocks not written).
    kv_offload_transient: bool = False
    # vLLM's name: GiB of CPU swap space per rank for the KV blocks of preempted requests, swapped
    # back in instead of recomputed when that is cheaper. 0: preemption always recomputes.
    swap_space: float = 0
    # vLLM's --kv-transfer-config for its OffloadingConnector (a dict or its JSON string), another
    # way to say kv_offload_bytes / kv_offload_dir (runtime/kv_offload/transfer_config.py).
    kv_transfer_config: Any = None

    DEFAULT_CPU_KV_BYTES = 1 << 30

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_args(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown engine option; known: {sorted(names)}")
        return cls(**kwargs)

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        def positive_int(name: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "must be an integer >= 1")

        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            fail("model", "must be a local model directory")
        self.model = str(self.model)
        if self.tokenizer is not None:
            self.tokenizer = str(self.tokenizer)
        if str(self.dtype).removeprefix("torch.") not in _DTYPES:
            fail("dtype", f"must be one of {list(_DTYPES)}")
        self.dtype = str(self.dtype).removeprefix("torch.")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            fail("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        positive_int("block_size")
        positive_int("num_kv_blocks", optional=True)
        positive_int("kv_cache_memory_bytes", optional=True)
        if isinstance(self.gpu_memory_utilization, bool) or not (
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1
        ):
            fail("gpu_memory_utilization", "must be in (0, 1]")
        positive_int("max_model_len", optional=True)
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens", optional=True)
        if not isinstance(self.enable_chunked_prefill, bool):
            fail("enable_chunked_prefill", "must be a boolean")
        if not isinstance(self.enable_prefix_caching, bool):
            fail("enable_prefix_caching", "must be a boolean")
        if self.speculative_config is not None:
            from kvserve.runtime.spec_decode.config import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.enforce_eager, bool):
            fail("enforce_eager", "must be a boolean")
        if not isinstance(self.async_scheduling, bool):
            fail("async_scheduling", "must be a boolean")
        if not isinstance(self.disable_hybrid_kv_cache_manager, bool):
            fail("disable_hybrid_kv_cache_manager", "must be a boolean")
        if not isinstance(self.enable_lora, bool):
            fail("enable_lora", "must be a boolean")
        positive_int("max_loras")
        positive_int("max_lora_rank")
        positive_int("max_cpu_loras", optional=True)
        if self.lora_dtype not in LORA_DTYPES:
            fail("lora_dtype", f"must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            fail("max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
        from kvserve.runtime.kv_events.config import KVEventsConfig

        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if self.kv_events_config is not None and self.kv_events_config.active and not self.enable_prefix_caching:
            fail("kv_events_config", "needs enable_prefix_caching (events name prefix-cache blocks)")
        if self.kv_transfer_config is not None:
            if self.kv_offload_bytes or self.kv_offload_dir is not None:
                fail("kv_transfer_config", "give either kv_transfer_config or kv_offload_bytes / kv_offload_dir")
            from kvserve.runtime.kv_offload.transfer_config import parse_kv_transfer_config

            tier = parse_kv_transfer_config(self.kv_transfer_config, block_size=self.block_size)
            self.kv_offload_bytes, self.kv_offload_dir = tier["kv_offload_bytes"], tier["kv_offload_dir"]
        if isinstance(self.kv_offload_bytes, bool) or not isinstance(self.kv_offload_bytes, int) \
                or self.kv_offload_bytes < 0:
            fail("kv_offload_bytes", "must be an integer >= 0 (0: no offload tier)")
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, (str, os.PathLike)) or not str(self.kv_offload_dir):
                fail("kv_offload_dir", "must be a directory path")
            self.kv_offload_dir = str(self.kv_offload_dir)
            if self.kv_offload_bytes == 0:
                fail("kv_offload_dir", "needs kv_offload_bytes > 0 (the tier's capacity)")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or not (0 <= self.swap_space < float("inf")):
            fail("swap_space", "must be a number of GiB >= 0 (0: preemption recomputes)")
        from kvserve.runtime.executor.cuda_graphs import CompilationConfig

        self.compilation_config = CompilationConfig.parse(self.compilation_config)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if self.attention_backend not in _BACKENDS:
            fail("attention_backend", f"must be one of {list(_BACKENDS)}")
        positive_int("tensor_parallel_size")  # checked against the model's heads by the engine
        positive_int("pipeline_parallel_size")  # checked against the model's layers by the engine
        positive_int("max_concurrent_batches", optional=True)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}")
        if self.quantization is not None:
            try:
                self.quantization = format_name(self.quantization)
            except ValueError:
                fail("quantization", f"must be one of {list(WEIGHT_FORMATS)} (or None: the checkpoint's own)")
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len):
            fail("max_num_batched_tokens",
                 f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is disabled")

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens: must be >= max_model_len ({max_model_len}) when "
                    f"chunked prefill is disabled, got {self.max_num_batched_tokens}")
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
