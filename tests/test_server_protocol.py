"""Request validation tables: what vLLM's OpenAI server accepts, and 400s naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.runtime.server.errors import APIError, from_validation_error
from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi"},
        {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 5, "temperature": 0},
        {"prompt": [1, 2, 3], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
         "stop_token_ids": [2], "min_tokens": 1, "seed": 7, "max_tokens": 3},
        {"prompt": [[1, 2], [3]], "stop": ["\n", "."], "logprobs": 2, "echo": True},
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "unknown_future_field": {"a": 1}, "best_of": 1, "temperature": 1},
    ],
)
def test_completion_accepts(body):
    CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": "x", "model": 3}, "model"),
    ],
)
def test_completion_rejects_naming_the_field(body, param):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate(body)
    err = from_validation_error(exc.value)
    assert isinstance(err, APIError) and err.status == 400
    assert err.param == param, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert param in err.message


@pytest.mark.parametrize(
    "body",
    [
        {"messages": MSG},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]},
                      {"role": "assistant", "content": None}], "max_completion_tokens": 4, "logprobs": True,
         "top_logprobs": 2},
        {"messages": MSG, "response_format": {"type": "text"}, "tool_choice": "none", "stream": True,
         "stream_options": {"include_usage": False}},
    ],
)
def test_chat_accepts(body):
    req = ChatCompletionRequest.model_validate(body)
    assert req.template_messages()[0]["content"] in ("hi", "s")


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"messages": MSG, "structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]"),
        ({"messages": MSG, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_rejects_naming_the_field(body, param):
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(body)
    assert from_validation_error(exc.value).param == param


def test_chat_max_completion_tokens_is_max_tokens():
    assert ChatCompletionRequest.model_validate({"messages": MSG, "max_completion_tokens": 4}).max_tokens == 4


def test_prompts_normalization():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2]]).prompts() == [[1], [2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({})
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({"prompt": "a", "messages": MSG})
    TokenizeRequest.model_validate({"prompt": "a"})


# -- response shaping (pure: engine outputs in, OpenAI chunks out) ----------------------------------
from kvserve.runtime.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from kvserve.runtime.server import serving  # noqa: E402


def _out(rid, text, ids, finish=None, logprobs=None):
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(0, text, ids, finish, logprobs)], finished=finish is not None)


@pytest.mark.parametrize(
    "msg, param",
    [("max_tokens: prompt (7 tokens) + max_tokens (9) exceeds max_model_len 8", "max_tokens"),
     ("prompt_token_ids: 99999 is not a token id", "prompt"),
     ("something odd happened: x", None)],
)
def test_engine_error_names_the_field(msg, param):
    err = serving.engine_error(ValueError(msg))
    assert err.status == 400 and err.param == param and err.message == msg


def test_chat_stream_chunks_concatenate_and_finish():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "stream": True, "n": 2, "seed": 1,
                                                "stream_options": {"include_usage": True}})
    plan = serving.make_plan("chat", req, "m", [("<prompt>", [1, 2])])
    # One engine request whose two samples share the prompt; the engine seeds sample j with seed + j.
    assert [(p.n, p.seed) for _, _, p in plan.engine_requests] == [(2, 1)]
    assert [(c.index, c.sample) for c in plan.choices] == [(0, 0), (1, 1)]
    c0 = plan.choices[0]
    chunks = []
    for text, ids, fin in [("He", [5], None), ("He", [5, 6], None), ("Hello", [5, 6, 7], "stop")]:
        serving.apply_output(c0, _out(c0.request_id, text, ids, fin))
        chunks += serving.stream_chunks(plan, c0)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == plan.id for c in chunks)
    assert serving.usage_chunk(plan)["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_final_response_with_echo_and_logprobs():
    req = CompletionRequest.model_validate({"prompt": "Hi", "echo": True, "logprobs": 1})
    plan = serving.make_plan("completion", req, "m", [("Hi", [1, 2])])
    c = plan.choices[0]
    lps = [{5: Logprob(-0.1, 1, " a"), 9: Logprob(-2.0, 2, " b")}, {6: Logprob(-0.5, 1, " c")}]
    serving.apply_output(c, _out(c.request_id, " a c", [5, 6], "length", lps))
    body = serving.final_response(plan)
    choice = body["choices"][0]
    assert choice["text"] == "Hi a c" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [" a", " c"]
    assert choice["logprobs"]["token_logprobs"] == [-0.1, -0.5]
    assert choice["logprobs"]["top_logprobs"][0] == {" a": -0.1, " b": -2.0}
    assert body["usage"]["completion_tokens"] == 2 and plan.engine_requests[0][2].max_tokens == 16
