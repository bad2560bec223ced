"""The agent's pure mapping from engine expositions to the standardized signal set."""

from __future__ import annotations

import pathlib

import pytest

from kvserve.runtime.agent.app import AgentConfig, ScrapeState, signals_json
from kvserve.runtime.agent.signals import EngineSample, detect_engine, standardize

VLLM_TEXT = (pathlib.Path(__file__).parent / "fixtures" / "vllm_metrics.txt").read_text()


def test_recorded_vllm_exposition():
    s = standardize(VLLM_TEXT)
    assert s == EngineSample(
        engine="vllm",
        model_name="meta-llama/Llama-3.1-8B-Instruct",
        kv_cache_utilization=0.73,
        queue_depth=5,
        requests_running=12,
        kv_cache_capacity_tokens=5120 * 16,
        tensor_parallel_size=None,
        prompt_tokens_total=123456,
        generation_tokens_total=65432,
        inter_token_latency_seconds_sum=42.502818602531875,  # TPOT totals, for the layout policy
        inter_token_latency_seconds_count=2000,
    )
    assert standardize(VLLM_TEXT, "vllm") == s


def test_kvserve_names_take_precedence():
    text = VLLM_TEXT + (
        "# TYPE kvserve:kv_cache_capacity_tokens gauge\n"
        'kvserve:kv_cache_capacity_tokens{model_name="m"} 4096.0\n'
        "# TYPE kvserve:tensor_parallel_size gauge\n"
        'kvserve:tensor_parallel_size{model_name="m"} 2.0\n'
    )
    s = standardize(text)
    assert (s.engine, s.kv_cache_capacity_tokens, s.tensor_parallel_size) == ("kvserve", 4096, 2)


def test_data_parallel_engines_and_legacy_names():
    text = "\n".join(
        [
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2',
            'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.6',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 10',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 5',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1',
        ]
    )
    s = standardize(text)
    assert s.kv_cache_utilization == pytest.approx(0.4)
    assert (s.queue_depth, s.prompt_tokens_total) == (3, 15)
    assert s.kv_cache_capacity_tokens is None  # profiler not run yet: unknown, not zero
    assert s.requests_running is None


def test_cache_info_token_capacity_label_wins():
    text = 'vllm:cache_config_info{block_size="4",kv_cache_size_tokens="1021696",num_gpu_blocks="3991"} 1\n'
    assert standardize(text).kv_cache_capacity_tokens == 1021696


def test_sglang_names():
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="q"} 7.0\n'
        'sglang:num_queue_reqs{model_name="q"} 3.0\n'
        'sglang:token_usage{model_name="q"} 0.25\n'
        'sglang:max_total_num_tokens{model_name="q"} 200000.0\n'
        "# TYPE sglang:prompt_tokens_total counter\n"
        'sglang:prompt_tokens_total{model_name="q"} 900.0\n'
        'sglang:generation_tokens_total{model_name="q"} 300.0\n'
    )
    s = standardize(text)
    assert s == EngineSample("sglang", "q", 0.25, 3, 7, 200000, None, 900, 300)


@pytest.mark.parametrize("junk", ["", "hello world\n", "<html>502 Bad Gateway</html>", 'process_cpu_seconds_total 3\n'])
def test_not_an_engine_exposition(junk):
    with pytest.raises(ValueError, match="engine /metrics"):
        standardize(junk)


def test_bad_engine_hint():
    with pytest.raises(ValueError, match="engine"):
        standardize(VLLM_TEXT, "tgi")


def test_detect_engine():
    assert detect_engine(["vllm:x", "kvserve:y"]) == "kvserve"
    assert detect_engine(["python_info"]) is None


def test_signals_before_first_sample_are_unknown_not_zero():
    cfg = AgentConfig(engine="vllm")
    j = signals_json(ScrapeState(started_at=100.0), cfg, now=107.5)
    assert j["stale"] is True and j["ready"] is False and j["sample_age_seconds"] == 7.5
    assert j["kv_cache_utilization"] is None and j["queue_depth"] is None
    assert j["engine"] == "vllm"


def test_signals_keep_last_values_with_growing_age():
    cfg = AgentConfig(tensor_parallel_size=4, stale_after_s=5)
    st = ScrapeState(started_at=0.0, sample=standardize(VLLM_TEXT), sampled_at=10.0, up=True, ready=True)
    fresh = signals_json(st, cfg, now=10.4)
    assert fresh["stale"] is False and fresh["ready"] is True
    assert fresh["tensor_parallel_size"] == 4  # vLLM does not export it: the flag fills in
    assert fresh["kv_cache_capacity_tokens"] == 81920 and fresh["queue_depth"] == 5
    st.up = False
    dead = signals_json(st, cfg, now=30.0)
    assert dead["stale"] is True and dead["ready"] is False and dead["sample_age_seconds"] == 20.0
    assert {k: dead[k] for k in ("kv_cache_utilization", "requests_running")} == {
        "kv_cache_utilization": 0.73, "requests_running": 12}
