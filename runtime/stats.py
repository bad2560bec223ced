"""Engine statistics for the server's /metrics: gauges, counters and latency observations.

Gauges and counters are snapshots. The latency lists hold observations made since the previous
``LLMEngine.get_stats()`` call (each observation is returned exactly once), so a server feeds
them straight into its histograms.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    max_num_seqs: int
    tensor_parallel_size: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # finish reason ("stop" | "length" | "abort") -> requests finished so far
    request_success_total: dict[str, int]
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Tokens run through the model (prefill, decode and speculative positions).
    computed_tokens_total: int = 0
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    generation_tokens_per_second: float = 0.0
    # Requests that asked for structured outputs (a JSON schema, regex, choice, grammar, tools).
    structured_output_requests_total: int = 0
    # What this replica runs: weight bytes on one rank (values, scales and zeros of whatever
    # format) and the formats, for kvserve:model_weight_bytes and kvserve:model_info.
    model_weight_bytes: int = 0
    # CUDA graph captures that failed at startup (logged at ERROR; decode runs eagerly).
    cuda_graph_capture_failures_total: int = 0
    quantization: str = "none"
    dtype: str = ""
    kv_cache_dtype: str = "auto"
    pipeline_parallel_size: int = 1
    # Stage 0's idle share of recent steps (moving average), 0 without pipeline parallelism.
    pipeline_bubble_fraction: float = 0.0
    # The KV offload tier and swap space (runtime/kv_offload/; zeros without them). Tokens
    # looked up and found in the tier, blocks and bytes moved, on rank 0.
    kv_offload_capacity_bytes: int = 0
    kv_offload_used_bytes: int = 0
    kv_offload_queries_tokens_total: int = 0
    kv_offload_hit_tokens_total: int = 0
    kv_offload_hit_blocks_total: int = 0
    kv_offload_stored_blocks_total: int = 0
    kv_offload_stored_bytes_total: int = 0
    kv_offload_loaded_bytes_total: int = 0
    kv_offload_failed_loads_total: int = 0
    kv_offload_prefetched_blocks_total: int = 0  # tier blocks a load found read ahead
    kv_swap_capacity_bytes: int = 0
    kv_swap_used_bytes: int = 0
    kv_swap_outs_total: int = 0
    kv_swap_ins_total: int = 0
    num_swapped: int = 0
    # KV events (runtime/kv_events/): batches published, and dropped from a full hand-off queue.
    kv_events_published_total: int = 0
    kv_events_dropped_total: int = 0
    kv_offload_store_seconds: list[float] = field(default_factory=list)
    kv_offload_load_seconds: list[float] = field(default_factory=list)
    # Observations since the previous get_stats() (seconds).
    queue_times: list[float] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    grammar_compile_times: list[float] = field(default_factory=list)
    # Step phase ("schedule" | "prepare" | "forward" | "sample" | "output") -> durations of the
    # steps since the previous get_stats() (seconds), for kvserve:step_duration_seconds.
    step_phase_durations: dict[str, list[float]] = field(default_factory=dict)
    timestamp: float = 0.0
    # LoRA (vllm:lora_requests_info): names of the adapters of running / waiting requests, and
    # max_loras (0: LoRA off).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    # Data-parallel engines of this server (runtime/engine/data_parallel.py), and the durations of
    # live layout changes since the previous get_stats() (kvserve:reshape_seconds).
    data_parallel_size: int = 1
    reshape_seconds: list[float] = field(default_factory=list)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_cache_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.block_size


STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")


class StatsCollector:
    """Accumulates counters and drainable observations as the engine steps."""

    RATE_WINDOW_S = 10.0
    MAX_OBSERVATIONS = 100_000

    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total: Counter[str] = Counter()
        self.computed_tokens_total = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.structured_output_requests_total = 0
        self._reset_observations()
        self._recent: deque[tuple[float, int]] = deque()

    def on_tokens(self, now: float, num_prompt: int, num_generated: int) -> None:
        self.prompt_tokens_total += num_prompt
        self.generation_tokens_total += num_generated
        if num_generated:
            self._recent.append((now, num_generated))

    def rate(self, now: float) -> float:
        while self._recent and self._recent[0][0] < now - self.RATE_WINDOW_S:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        span = max(now - self._recent[0][0], 1.0)
        return sum(n for _, n in self._recent) / span

    def _reset_observations(self) -> None:
        # Bounded, so an engine whose stats nobody reads (offline use) does not grow forever.
        self.queue_times: deque[float] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.time_to_first_token: deque[float] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.inter_token_latencies: deque[float] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.e2e_latencies: deque[float] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.step_phases: dict[str, deque[float]] = {p: deque(maxlen=self.MAX_OBSERVATIONS) for p in STEP_PHASES}

    def on_step(self, schedule: float, prepare: float, forward: float, sample: float, output: float) -> None:
        phases = self.step_phases
        phases["schedule"].append(schedule)
        phases["prepare"].append(prepare)
        phases["forward"].append(forward)
        phases["sample"].append(sample)
        phases["output"].append(output)

    def drain(self) -> dict[str, list[float]]:
        out = dict(queue_times=list(self.queue_times),
                   time_to_first_token=list(self.time_to_first_token),
                   inter_token_latencies=list(self.inter_token_latencies),
                   e2e_latencies=list(self.e2e_latencies),
                   step_phase_durations={p: list(v) for p, v in self.step_phases.items()})
        self._reset_observations()
        return out

    @staticmethod
    def now() -> float:
        return time.monotonic()
