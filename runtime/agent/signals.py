"""Turns one engine's Prometheus exposition into the engine-independent signal set.

Pure: text in, `EngineSample` out. kvserve exports vLLM's names plus `kvserve:*` extras, so the
vLLM table covers it; SGLang has its own names. Each standardized field lists its sources in
order of preference, and the first name present in the exposition wins, so vLLM's older
`gpu_cache_usage_perc` still works.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

ENGINES = ("kvserve", "vllm", "sglang")


@dataclass(frozen=True)
class EngineSample:
    """One scrape, standardized. A field is None when the engine does not export it."""

    engine: str
    model_name: str | None = None
    kv_cache_utilization: float | None = None
    queue_depth: float | None = None
    requests_running: float | None = None
    kv_cache_capacity_tokens: float | None = None
    tensor_parallel_size: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    # LoRA adapters the engine has loaded (kvserve:lora_adapter_loaded), sorted; None when the
    # engine does not say (vLLM's lora_requests_info names only running and waiting ones).
    lora_adapters: tuple[str, ...] | None = None
    data_parallel_size: float | None = None  # kvserve's engines per pod (a live layout, issue 22)
    # The inter-token latency (TPOT) histogram's totals: the operator's layout policy takes their
    # differences between decisions for the TPOT of an interval.
    inter_token_latency_seconds_sum: float | None = None
    inter_token_latency_seconds_count: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


Series = list[tuple[dict[str, str], float]]


def _sum(series: Series) -> float:
    return sum(v for _, v in series)


def _mean(series: Series) -> float:
    # Data-parallel vLLM exports one series per engine; the pod's utilization is their mean.
    return sum(v for _, v in series) / len(series)


def _max(series: Series) -> float:
    return max(v for _, v in series)


def _capacity_from_cache_info(series: Series) -> float | None:
    total = 0.0
    for labels, _ in series:
        try:
            # Newer vLLM states the token capacity itself (hybrid models have several block
            # sizes); older ones only give blocks and block size.
            if labels.get("kv_cache_size_tokens", "None") != "None":
                total += int(labels["kv_cache_size_tokens"])
            else:
                total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None  # num_gpu_blocks="None" before the profiler has run
    return total


Reducer = Callable[[Series], float | None]

# field -> [(sample name, reducer)], first present wins.
SOURCES: dict[str, list[tuple[str, Reducer]]] = {
    "kv_cache_utilization": [
        ("vllm:kv_cache_usage_perc", _mean),
        ("vllm:gpu_cache_usage_perc", _mean),
        ("sglang:token_usage", _mean),
    ],
    "queue_depth": [
        ("vllm:num_requests_waiting", _sum),
        ("sglang:num_queue_reqs", _sum),
    ],
    "requests_running": [
        ("vllm:num_requests_running", _sum),
        ("sglang:num_running_reqs", _sum),
    ],
    "kv_cache_capacity_tokens": [
        ("kvserve:kv_cache_capacity_tokens", _sum),
        ("vllm:cache_config_info", _capacity_from_cache_info),
        ("sglang:max_total_num_tokens", _sum),
    ],
    "tensor_parallel_size": [
        ("kvserve:tensor_parallel_size", _max),
    ],
    "data_parallel_size": [
        ("kvserve:data_parallel_size", _max),
    ],
    "inter_token_latency_seconds_sum": [
        ("vllm:inter_token_latency_seconds_sum", _sum),
        ("vllm:time_per_output_token_seconds_sum", _sum),  # vLLM before the rename
        ("sglang:inter_token_latency_seconds_sum", _sum),
    ],
    "inter_token_latency_seconds_count": [
        ("vllm:inter_token_latency_seconds_count", _sum),
        ("vllm:time_per_output_token_seconds_count", _sum),
        ("sglang:inter_token_latency_seconds_count", _sum),
    ],
    "prompt_tokens_total": [
        ("vllm:prompt_tokens_total", _sum),
        ("sglang:prompt_tokens_total", _sum),
    ],
    "generation_tokens_total": [
        ("vllm:generation_tokens_total", _sum),
        ("sglang:generation_tokens_total", _sum),
    ],
}


def index_samples(text: str) -> dict[str, Series]:
    """Sample name -> [(labels, value)]. Raises ValueError on text that is not an exposition."""
    by_name: dict[str, Series] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name[sample.name].append((dict(sample.labels), float(sample.value)))
    except Exception as exc:  # the parser raises bare ValueError/IndexError/TypeError on junk
        raise ValueError(f"engine /metrics: not a Prometheus text exposition ({exc})") from None
    return dict(by_name)


def detect_engine(names: Iterable[str]) -> str | None:
    prefixes = {name.split(":", 1)[0] for name in names if ":" in name}
    for engine in ENGINES:  # kvserve first: it also exports vllm:* names
        if engine in prefixes:
            return engine
    return None


def _model_name(samples: dict[str, Series]) -> str | None:
    for series in samples.values():
        for labels, _ in series:
            if "model_name" in labels:
                return labels["model_name"]
    return None


def standardize(text: str, engine_hint: str = "auto") -> EngineSample:
    """Parses an exposition and maps it onto the standardized fields.

    `engine_hint` ("auto", "kvserve", "vllm", "sglang") names the engine in the output; with
    "auto" the text decides. The mapping is chosen by the names actually present either way.
    """
    if engine_hint not in ("auto", *ENGINES):
        raise ValueError(f"engine: unsupported value {engine_hint!r}; supported: auto, {', '.join(ENGINES)}")
    samples = index_samples(text)
    engine = engine_hint if engine_hint != "auto" else detect_engine(samples)
    if engine is None:
        raise ValueError("engine /metrics: no kvserve:, vllm: or sglang: metrics found")
    fields: dict[str, float | None] = {}
    for field, sources in SOURCES.items():
        value = None
        for name, reduce in sources:
            series = samples.get(name)
            if series:
                value = reduce(series)
                if value is not None:
                    break
        fields[field] = value
    return EngineSample(engine=engine, model_name=_model_name(samples), lora_adapters=_lora_adapters(samples),
                        **fields)


# The runtime exports one series per loaded adapter, at most --max-cpu-loras of them; an
# exposition with more is not one to trust with the agent's (and the router's) memory.
MAX_LORA_ADAPTERS = 1024


def _lora_adapters(samples: dict[str, Series]) -> tuple[str, ...] | None:
    series = samples.get("kvserve:lora_adapter_loaded")
    if series is None:
        return None
    names = {labels.get("lora_name", "") for labels, value in series[:MAX_LORA_ADAPTERS] if value > 0}
    return tuple(sorted(n for n in names if n))
