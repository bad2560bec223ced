"""The three features through a live server: cached_tokens in usage, n choices (streamed and
not), speculative decoding, and their counters on /metrics."""

from __future__ import annotations

import json

import pytest
from server_helpers import http, idle, m, wait_until

from kvserve.runtime.cli import build_parser
from kvserve.runtime.server.main import ServerThread, engine_kwargs

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread([str(tiny_llama), "--served-model-name", "tiny", "--num-kv-blocks", "256",
                        "--max-model-len", "512", "--block-size", "16", "--port", "0",
                        "--speculative-config", SPEC])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv.url
    assert srv.stop() == 0


def post(url, path, body):
    status, _, raw = http(url, "POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def sse(url, path, body):
    status, _, raw = http(url, "POST", path, body)
    assert status == 200, raw
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_flags_reach_the_engine():
    args = build_parser().parse_args(["serve", "/m", "--no-enable-prefix-caching", "--speculative-config", SPEC])
    kw = engine_kwargs(args)
    assert kw["enable_prefix_caching"] is False and json.loads(kw["speculative_config"])["method"] == "ngram"
    assert "enable_prefix_caching" not in engine_kwargs(build_parser().parse_args(["serve", "/m"]))


def test_cached_tokens_and_spec_counters(server):
    system = list(range(10, 20)) * 10  # 100 tokens that repeat: cacheable and n-gram friendly
    body = {"model": "tiny", "prompt": system + [7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    first = post(server, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = post(server, "/v1/completions", {**body, "prompt": system + [9]})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # six full blocks of 16
    salted = post(server, "/v1/completions", {**body, "prompt": system + [9], "cache_salt": "tenant-b"})
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another tenant's cache
    assert salted["choices"][0]["text"] == second["choices"][0]["text"]
    snap = idle(server)
    assert m(snap, "vllm:prefix_cache_hits_total") >= 96
    assert m(snap, "vllm:prefix_cache_queries_total") >= 2 * 101
    drafts = m(snap, "vllm:spec_decode_num_draft_tokens_total")
    assert m(snap, "vllm:spec_decode_num_drafts_total") > 0 and drafts > 0
    assert 0 <= m(snap, "vllm:spec_decode_num_accepted_tokens_total") <= drafts


def test_n_choices_non_streamed_and_streamed(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0}
    full = post(server, "/v1/completions", body)
    assert sorted(c["index"] for c in full["choices"]) == [0, 1, 2]
    assert len({c["text"] for c in full["choices"]}) > 1  # seed + index: distinct samples
    assert post(server, "/v1/completions", body)["choices"] == full["choices"]  # reproducible
    chunks = sse(server, "/v1/completions", {**body, "stream": True})
    streamed = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                for i in range(3)}
    assert streamed == {c["index"]: c["text"] for c in full["choices"]}

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 6, "n": 2,
            "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse(server, "/v1/chat/completions", chat)
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    snap = idle(server)
    assert m(snap, "vllm:kv_cache_usage_perc") == 0
