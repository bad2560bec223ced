"""The runtime's /metrics: vLLM's names (labelled model_name) plus `kvserve:` extras.

Gauges and counters are rendered from the engine's latest stats snapshot at scrape time (the
engine owns the totals, so they can never drift); histograms accumulate the latency observations
each snapshot hands over exactly once. prometheus_client appends `_total` to counters, as in vLLM.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM V1's bucket boundaries, so existing dashboards' quantiles line up.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

# Engine step phases: from 100 us (a schedule or output phase) to seconds (a long CPU prefill).
STEP_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0]
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")

FINISH_REASONS = ("stop", "length", "abort")

# Every series the runtime exports (sample names, as they appear in the exposition).
EXPORTED_NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:cache_config_info",
    "kvserve:kv_cache_capacity_tokens", "kvserve:max_num_seqs", "kvserve:tensor_parallel_size",
    "kvserve:pipeline_parallel_size", "kvserve:pipeline_bubble_fraction",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc",
    "kvserve:kv_offload_capacity_bytes", "kvserve:kv_offload_used_bytes", "kvserve:kv_offload_hits_total",
    "kvserve:kv_offload_stored_blocks_total", "kvserve:kv_offload_stored_bytes_total",
    "kvserve:kv_offload_loaded_bytes_total", "kvserve:kv_offload_failed_loads_total",
    "kvserve:kv_offload_prefetched_blocks_total",
    "kvserve:kv_swap_outs_total", "kvserve:kv_swap_ins_total",
    "kvserve:kv_events_published_total", "kvserve:kv_events_dropped_total",
    "kvserve:kv_offload_store_seconds", "kvserve:kv_offload_load_seconds",
    "kvserve:model_weight_bytes", "kvserve:model_info", "kvserve:cuda_graph_capture_failures_total",
    "kvserve:generation_tokens_per_second",
    "kvserve:structured_output_requests_total", "kvserve:grammar_compile_seconds",
    "kvserve:step_duration_seconds", "kvserve:data_parallel_size", "kvserve:reshape_seconds",
)
# With --enable-lora only.
LORA_EXPORTED_NAMES = ("vllm:lora_requests_info", "kvserve:lora_requests_total", "kvserve:lora_adapter_loaded")

# A live layout change: tens of milliseconds for a tiny model, seconds for a large one.
RESHAPE_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0]

# Grammar compilation: milliseconds for a small schema, seconds for a large one.
COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class _StatsCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        s = self.m.stats
        if s is None:
            return
        name = self.m.model_name
        L = ["model_name"]

        def gauge(metric: str, doc: str, value: float):
            g = GaugeMetricFamily(metric, doc, labels=L)
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float):
            c = CounterMetricFamily(metric, doc, labels=L)
            c.add_metric([name], value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.num_preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        reasons = dict.fromkeys(FINISH_REASONS, 0)
        reasons.update(s.request_success_total)
        for reason, count in sorted(reasons.items()):
            success.add_metric([name, reason], count)
        yield success
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits_total)
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                      getattr(s, "spec_decode_num_drafts_total", 0))
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      getattr(s, "spec_decode_num_draft_tokens_total", 0))
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      getattr(s, "spec_decode_num_accepted_tokens_total", 0))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["model_name", "block_size", "cache_dtype", "num_gpu_blocks"])
        info.add_metric([name, str(s.block_size), getattr(s, "kv_cache_dtype", "auto"), str(s.kv_blocks_total)], 1)
        yield info
        yield gauge("kvserve:kv_cache_capacity_tokens", "KV cache capacity of this replica in tokens.",
                    s.kv_cache_capacity_tokens)
        yield gauge("kvserve:max_num_seqs", "Most requests the engine runs at once.", s.max_num_seqs)
        yield gauge("kvserve:tensor_parallel_size", "Tensor-parallel degree of this replica.",
                    s.tensor_parallel_size)
        yield gauge("kvserve:pipeline_parallel_size", "Pipeline stages of this replica.",
                    getattr(s, "pipeline_parallel_size", 1))
        yield gauge("kvserve:pipeline_bubble_fraction", "Share of recent steps the first pipeline stage "
                    "waited for the others (moving average; 0 without pipeline parallelism).",
                    getattr(s, "pipeline_bubble_fraction", 0.0))
        # The KV offload tier and swap space (docs/kv-offload.md); zeros without them.
        yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries (the KV offload tier), "
                      "in terms of number of queried tokens.", getattr(s, "kv_offload_queries_tokens_total", 0))
        yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits (the KV offload tier), in "
                      "terms of number of cached tokens.", getattr(s, "kv_offload_hit_tokens_total", 0))
        yield gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", getattr(s, "num_swapped", 0))
        swap_total = getattr(s, "kv_swap_capacity_bytes", 0)
        yield gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage (the swap space). 1 means 100 percent usage.",
                    getattr(s, "kv_swap_used_bytes", 0) / swap_total if swap_total else 0.0)
        yield gauge("kvserve:kv_offload_capacity_bytes", "Bytes the KV offload tier may hold (per rank).",
                    getattr(s, "kv_offload_capacity_bytes", 0))
        yield gauge("kvserve:kv_offload_used_bytes", "Bytes the KV offload tier holds (per rank).",
                    getattr(s, "kv_offload_used_bytes", 0))
        yield counter("kvserve:kv_offload_hits", "KV blocks loaded back from the offload tier.",
                      getattr(s, "kv_offload_hit_blocks_total", 0))
        yield counter("kvserve:kv_offload_stored_blocks", "KV blocks copied into the offload tier.",
                      getattr(s, "kv_offload_stored_blocks_total", 0))
        yield counter("kvserve:kv_offload_stored_bytes", "Bytes copied out of the KV pool (tier and swap, rank 0).",
                      getattr(s, "kv_offload_stored_bytes_total", 0))
        yield counter("kvserve:kv_offload_loaded_bytes", "Bytes copied into the KV pool (tier and swap, rank 0).",
                      getattr(s, "kv_offload_loaded_bytes_total", 0))
        yield counter("kvserve:kv_offload_prefetched_blocks", "File-tier blocks a load found already read "
                      "ahead (while their request waited) instead of reading the file then (rank 0).",
                      getattr(s, "kv_offload_prefetched_blocks_total", 0))
        yield counter("kvserve:kv_offload_failed_loads", "Offloaded KV blocks that could not be read back "
                      "(missing, truncated or corrupt files): recomputed instead.",
                      getattr(s, "kv_offload_failed_loads_total", 0))
        yield counter("kvserve:kv_swap_outs", "Preempted requests swapped out instead of recomputed.",
                      getattr(s, "kv_swap_outs_total", 0))
        yield counter("kvserve:kv_swap_ins", "Swapped-out requests swapped back in.", getattr(s, "kv_swap_ins_total", 0))
        yield counter("kvserve:kv_events_published", "KV event batches published (--kv-events-config).",
                      getattr(s, "kv_events_published_total", 0))
        yield counter("kvserve:kv_events_dropped", "KV event batches dropped from the publisher's full queue "
                      "(subscribers replay them while the replay buffer has them).",
                      getattr(s, "kv_events_dropped_total", 0))
        yield gauge("kvserve:data_parallel_size", "Data-parallel engines of this replica (each of "
                    "kvserve:tensor_parallel_size ranks).", getattr(s, "data_parallel_size", 1))
        yield gauge("kvserve:model_weight_bytes", "Bytes of model weights on each tensor-parallel rank, "
                    "quantization scales and zeros included.", getattr(s, "model_weight_bytes", 0))
        yield counter("kvserve:cuda_graph_capture_failures", "CUDA graph captures that failed at startup "
                      "(decode then runs eagerly; the log has the traceback).",
                      getattr(s, "cuda_graph_capture_failures_total", 0))
        model_info = GaugeMetricFamily("kvserve:model_info", "What this replica runs (always 1).",
                                       labels=["model_name", "quantization", "dtype", "kv_cache_dtype"])
        model_info.add_metric([name, getattr(s, "quantization", "none"), getattr(s, "dtype", ""),
                               getattr(s, "kv_cache_dtype", "auto")], 1)
        yield model_info
        yield gauge("kvserve:generation_tokens_per_second", "Generated tokens per second over the last 10 s.",
                    s.generation_tokens_per_second)
        yield counter("kvserve:structured_output_requests",
                      "Requests with structured outputs (response_format, structured_outputs, forced tool calls).",
                      getattr(s, "structured_output_requests_total", 0))
        yield from self._lora(name, s)

    def _lora(self, name: str, s):
        """With --enable-lora: vLLM's lora_requests_info, and per adapter (at most --max-cpu-loras
        label values, each gone once its adapter is unloaded) loaded and request counts."""
        lora = self.m.lora
        if lora is None:
            return
        registry = lora()
        if registry is None:
            return
        running = getattr(s, "running_lora_adapters", None) or []
        waiting = getattr(s, "waiting_lora_adapters", None) or []
        max_lora = getattr(s, "max_lora", 0) or registry.max_loras
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        # vLLM's value: when the snapshot was taken; the labels carry the information.
        g.add_metric([",".join(sorted(running)), ",".join(sorted(waiting)), str(max_lora)], time.time())
        yield g
        loaded = GaugeMetricFamily("kvserve:lora_adapter_loaded", "1 for each LoRA adapter loaded on this replica.",
                                   labels=["model_name", "lora_name"])
        total = CounterMetricFamily("kvserve:lora_requests", "Requests per LoRA adapter.",
                                    labels=["model_name", "lora_name"])
        for adapter in registry.names():
            loaded.add_metric([name, adapter], 1)
            total.add_metric([name, adapter], registry.requests_total.get(adapter, 0))
        yield loaded
        yield total


class ServerMetrics:
    """One per server. `update(stats)` is called on the engine thread; `render()` on the loop."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats = None
        # With --enable-lora: () -> the server's LoRARegistry, read at scrape time.
        self.lora = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(self))
        self._lock = threading.Lock()

        def hist(metric: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(metric, doc, labelnames=["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.grammar_compile = hist("kvserve:grammar_compile_seconds",
                                    "Histogram of grammar compilation time (a cached grammar is not compiled again).",
                                    COMPILE_BUCKETS)
        self.offload_store = hist("kvserve:kv_offload_store_seconds",
                                  "Time to copy a batch of KV blocks out of the pool, and to write one block's "
                                  "file (the background writer).", STEP_BUCKETS)
        self.offload_load = hist("kvserve:kv_offload_load_seconds",
                                 "Time to load a batch of KV blocks from the offload tier or swap space into the pool.",
                                 STEP_BUCKETS)
        step = Histogram("kvserve:step_duration_seconds",
                         "Engine step time by phase: schedule, prepare (inputs), forward (model), sample, "
                         "output (detokenize, stop checks, outputs).",
                         labelnames=["model_name", "phase"], buckets=STEP_BUCKETS, registry=self.registry)
        self.step_phases = {phase: step.labels(model_name, phase) for phase in STEP_PHASES}
        self.reshape = hist("kvserve:reshape_seconds", "Histogram of live parallel-layout changes "
                            "(POST /admin/parallelism), from stopping the engines to serving on the new layout.",
                            RESHAPE_BUCKETS)

    def update(self, stats) -> None:
        for hist, values in ((self.ttft, stats.time_to_first_token), (self.itl, stats.inter_token_latencies),
                             (self.e2e, stats.e2e_latencies), (self.queue, stats.queue_times),
                             (self.grammar_compile, getattr(stats, "grammar_compile_times", ())),
                             (self.reshape, getattr(stats, "reshape_seconds", ())),
                             (self.offload_store, getattr(stats, "kv_offload_store_seconds", ())),
                             (self.offload_load, getattr(stats, "kv_offload_load_seconds", ()))):
            for v in values:
                hist.observe(v)
        for phase, values in getattr(stats, "step_phase_durations", {}).items():
            hist = self.step_phases.get(phase)
            if hist is not None:
                for v in values:
                    hist.observe(v)
        self.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
