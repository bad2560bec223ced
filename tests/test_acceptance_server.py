"""Acceptance regressions for `kvserve serve`: bad inputs found in the pre-release pass get a 4xx
with OpenAI's error body and leave nothing behind."""

from __future__ import annotations

import json

import pytest
from server_helpers import http, idle, wait_until

from kvserve.runtime.server.main import ServerThread


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread([str(tiny_llama), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                        "--max-model-len", "256", "--max-num-seqs", "4", "--max-queue-len", "4", "--port", "0"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv.url
    assert srv.stop() == 0


def _error(status: int, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\uDFFF"}], "max_tokens": 2}'),
    ("/tokenize", '{"prompt": "x\\udc80"}'),
])
def test_lone_surrogate_escape_is_400_not_500(server, path, raw):
    status, _, body = http(server, "POST", path, raw)
    assert "Unicode" in _error(status, body)["message"]


def test_valid_surrogate_pair_escape_still_served(server):
    status, _, body = http(server, "POST", "/tokenize", '{"prompt": "smile \\ud83d\\ude00"}')
    assert status == 200 and json.loads(body)["count"] > 0


@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1])
def test_seed_outside_64_bits_is_400_naming_seed(server, seed):
    status, _, body = http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": seed})
    assert _error(status, body)["param"] == "seed"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_text_offset_counts_the_echoed_prompt(server, stream):
    body = {"prompt": "hello", "max_tokens": 3, "logprobs": 0, "echo": True, "stream": stream, "ignore_eos": True}
    status, _, raw = http(server, "POST", "/v1/completions", body)
    assert status == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    else:
        choice = json.loads(raw)["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text.startswith("hello") and len(offsets) == 3
    assert offsets[0] == len("hello")


def test_request_that_can_never_be_admitted_is_400_not_429(server):
    # 2 prompts x n=5 = 10 sequences > 4 running + 4 queued, even on an idle server.
    status, headers, body = http(server, "POST", "/v1/completions", {"prompt": ["hi", "ho"], "n": 5, "max_tokens": 1})
    err = _error(status, body)
    assert status == 400 and err["param"] == "n" and "10 sequences" in err["message"]
    assert "retry-after" not in headers


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_that_does_not_match_its_content_encoding_is_400(server, encoding):
    status, _, body = http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           headers={"Content-Encoding": encoding})
    assert "content-encoding" in _error(status, body)["message"].lower()


def test_gzip_body_still_served(server):
    import gzip

    raw = gzip.compress(json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    status, _, _ = http(server, "POST", "/v1/completions", raw, headers={"Content-Encoding": "gzip"})
    assert status == 200


@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"},
    {"tokenize": True}, {"messages": []}, {"add_generation_prompt": False},
])
def test_chat_template_kwargs_cannot_replace_the_template_or_rendering_args(server, kwargs):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": kwargs}
    status, _, raw = http(server, "POST", "/v1/chat/completions", body, timeout=10)
    err = _error(status, raw)
    assert err["param"] == "chat_template_kwargs" and next(iter(kwargs)) in err["message"]


def test_chat_template_kwargs_still_reach_the_template(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}}
    assert http(server, "POST", "/v1/chat/completions", body)[0] == 200


def test_tokenization_runs_off_the_event_loop(server, monkeypatch):
    import threading

    from kvserve.runtime.server import app as app_module

    # Record the thread each tokenization runs on: every prompt, short or long, is tokenized (and
    # templated) on the preprocessing pool, never on the loop that answers the probes.
    threads = []
    real = app_module._tokenize
    monkeypatch.setattr(app_module, "_tokenize", lambda *a: (threads.append(threading.current_thread().name), real(*a))[1])
    for body in ({"prompt": "hello " * 1000}, {"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi " * 2000}]}):
        status, _, _ = http(server, "POST", "/tokenize", body)
        assert status == 200 and threads[-1].startswith("kvserve-preprocess")
    assert http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200
    assert threads[-1].startswith("kvserve-preprocess")


@pytest.mark.parametrize("raw", ['{"prompt": ' + "[" * 100000 + "]" * 100000 + "}",
                                 '{"a":' * 50000 + "1" + "}" * 50000])
def test_deeply_nested_json_is_400(server, raw):
    status, _, body = http(server, "POST", "/v1/completions", raw)
    assert "nested too deeply" in _error(status, body)["message"]


def test_openai_client_models_retrieve(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("org/other")
    assert exc.value.body["code"] == "model_not_found"


def test_rejected_batch_is_not_counted_as_aborted(server):
    from server_helpers import m, metrics

    before = m(metrics(server), "vllm:request_success_total", finished_reason="abort")
    status, _, body = http(server, "POST", "/v1/completions", {"prompt": [[5] * 10, [5] * 250], "max_tokens": 10})
    assert _error(status, body)["param"] == "max_tokens"
    after = idle(server)
    assert m(after, "vllm:request_success_total", finished_reason="abort") == before


# Last: every bad request above must have left the engine idle with no KV block held.
def test_nothing_leaked_after_bad_inputs(server):
    idle(server)
