"""The OpenAI API against a live in-process `kvserve serve` on the tiny Llama."""

from __future__ import annotations

import json
import socket

import openai
import pytest
from server_helpers import http, idle, m, metrics, wait_until

from kvserve.runtime.server.main import ServerThread

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread([str(tiny_llama), "--served-model-name", MODEL, "other-name", "--api-key", KEY,
                        "--num-kv-blocks", "128", "--max-request-body-bytes", "65536", "--max-model-len", "256", "--port", "0"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv.url
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server, client):
    ids = [mm.id for mm in client.models.list().data]
    assert ids == [MODEL, "other-name"]
    assert http(server, "GET", "/health")[0] == 200
    assert http(server, "GET", "/ready")[0] == 200


def test_sync_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sync_chat_stream_equals_non_stream(client):
    kw = dict(model="other-name", messages=MSGS, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.model == MODEL
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


async def test_async_client(server):
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    full = await aclient.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5})
    stream = await aclient.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == full.choices[0].message.content and full.usage.completion_tokens == 6
    comp = await aclient.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert comp.usage.prompt_tokens == 3
    await aclient.close()


def test_extras_n_batch_seed_logprobs_echo(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "The weather"], n=2, max_tokens=5, temperature=1.0,
                                  seed=3, logprobs=2, echo=True,
                                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
                                              "ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello") and r.choices[2].text.startswith("The weather")
    assert r.usage.completion_tokens == 20
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) >= 1 for t in lp.top_logprobs)
    again = client.completions.create(model=MODEL, prompt=["Hello", "The weather"], n=2, max_tokens=5,
                                      temperature=1.0, seed=3, logprobs=2, echo=True,
                                      extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
                                                  "ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[5:7] if len(text) > 7 and text[5:7].strip() else None
    if stop:
        r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=20, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    tok = http(client.base_url.__str__().removesuffix("/v1/"), "POST", "/tokenize", {"prompt": text},
               AUTH)
    assert tok[0] == 200


def test_tokenize_detokenize_roundtrip(server):
    s, _, body = http(server, "POST", "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}, AUTH)
    toks = json.loads(body)
    assert s == 200 and toks["count"] == len(toks["tokens"]) > 0 and toks["max_model_len"] == 256
    s, _, body = http(server, "POST", "/detokenize", {"tokens": toks["tokens"]}, AUTH)
    assert s == 200 and json.loads(body)["prompt"] == "Hello world"
    s, _, body = http(server, "POST", "/tokenize", {"messages": MSGS}, AUTH)
    assert s == 200 and json.loads(body)["count"] > toks["count"]


def test_request_id_echoed(server):
    s, h, _ = http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, {
        **AUTH, "X-Request-Id": "abc-123"})
    assert s == 200 and h["x-request-id"] == "abc-123"
    s, h, _ = http(server, "POST", "/v1/completions", {"prompt": 5}, {**AUTH, "X-Request-Id": "e-1"})
    assert s == 400 and h["x-request-id"] == "e-1"
    s, h, body = http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                           "stream": True}, {**AUTH, "X-Request-Id": "s-1"})
    assert s == 200 and h["x-request-id"] == "s-1" and body.endswith(b"data: [DONE]\n\n")
    assert http(server, "GET", "/health")[1]["x-request-id"]


LONG = "hello " * 400
BAD = [
    # (name, method, path, body, headers, status, param)
    ("invalid json", "POST", "/v1/completions", "{not json", AUTH, 400, None),
    ("json array", "POST", "/v1/completions", "[1,2]", AUTH, 400, None),
    ("wrong type", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, AUTH, 400,
     "max_tokens"),
    ("negative max_tokens", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, AUTH, 400,
     "max_tokens"),
    ("huge max_tokens", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, AUTH, 400,
     "max_tokens"),
    ("prompt too long", "POST", "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 1}, AUTH, 400,
     "prompt"),
    ("token id out of vocab", "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, AUTH, 400, "prompt"),
    ("bad temperature", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -3}, AUTH, 400,
     "temperature"),
    ("stop id out of vocab", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10**6]},
     AUTH, 400, "stop_token_ids"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, AUTH, 404, "model"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, AUTH, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH, 400, "messages"),
    ("chat prompt too long", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, AUTH, 400, "prompt"),
    ("image part", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     AUTH, 400, "messages[0].content"),
    ("oversized body", "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 70000}, AUTH, 413, None),
    ("no api key", "POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, {}, 401, None),
    ("bad api key", "POST", "/v1/chat/completions", {"model": MODEL, "messages": MSGS},
     {"Authorization": "Bearer sk-wrong"}, 401, None),
    ("bad api key on models", "GET", "/v1/models", None, {"Authorization": "Basic x"}, 401, None),
    ("unknown route", "GET", "/v1/nope", None, AUTH, 404, None),
    ("wrong method", "GET", "/v1/completions", None, AUTH, 405, None),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [-1]}, AUTH, 400, "tokens"),
]


@pytest.mark.parametrize("name, method, path, body, headers, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, name, method, path, body, headers, status, param):
    s, h, raw = http(server, method, path, body, headers)
    assert s == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert h["content-type"].startswith("application/json")
    if status == 401:
        assert err["code"] == "invalid_api_key"
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"


def test_server_healthy_and_nothing_leaked_after_bad_inputs(server, client):
    snap = idle(server)
    assert m(snap, "vllm:kv_cache_usage_perc") == 0
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_blocks(server):
    before = idle(server)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(65536)
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    busy = metrics(server)
    assert m(busy, "vllm:kv_cache_usage_perc") > 0 or m(busy, "vllm:num_requests_running") >= 0
    sock.close()
    after = idle(server)
    assert m(after, "vllm:request_success_total", finished_reason="abort") == \
        m(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert m(after, "vllm:generation_tokens_total") - m(before, "vllm:generation_tokens_total") < 200


def test_metric_values_after_known_workload(server, client):
    before = idle(server)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    k, n_out = 3, 5
    for _ in range(k):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n_out, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n_out
    after = idle(server)

    def d(name, **labels):
        return m(after, name, **labels) - m(before, name, **labels)

    assert d("vllm:prompt_tokens_total") == k * len(prompt)
    assert d("vllm:generation_tokens_total") == k * n_out
    assert d("vllm:request_success_total", finished_reason="length") == k
    assert d("vllm:time_to_first_token_seconds_count") == k
    assert d("vllm:e2e_request_latency_seconds_count") == k
    assert d("vllm:request_queue_time_seconds_count") == k
    assert d("vllm:inter_token_latency_seconds_count") == k * (n_out - 1)
    assert d("vllm:e2e_request_latency_seconds_sum") > 0
    # One engine step per token (each request runs alone): every phase is observed once per step.
    for phase in ("schedule", "prepare", "forward", "sample", "output"):
        assert d("kvserve:step_duration_seconds_count", phase=phase) == k * n_out, phase
    assert d("kvserve:step_duration_seconds_sum", phase="forward") > 0
    assert m(after, "vllm:cache_config_info", block_size="16", cache_dtype="auto", num_gpu_blocks="128") == 1
    assert m(after, "kvserve:kv_cache_capacity_tokens") == 128 * 16
    assert m(after, "kvserve:max_num_seqs") == 256 and m(after, "kvserve:tensor_parallel_size") == 1
    assert m(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == m(
        after, "vllm:time_to_first_token_seconds_count")
    names = {name for name, _ in after}
    from kvserve.runtime.server.metrics import EXPORTED_NAMES
    for name in EXPORTED_NAMES:
        assert name in names or name + "_count" in names, name
