"""Structured outputs and forced tool calls on the real SmolLM2-135M-Instruct (its chat template
knows no tools: the grammar carries the format), through `kvserve serve`, the openai client and
LangChain. Every structured answer parses and validates, whatever the model wants to say."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import http, idle, wait_until

from kvserve.runtime.server.main import ServerThread

pytestmark = pytest.mark.slow

MODEL = "smollm2"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "country": {"type": "string", "maxLength": 40},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
        "required": ["city", "country", "population"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                       "required": ["timezone"]}}}]


@pytest.fixture(scope="module")
def server(smollm2):
    srv = ServerThread([str(smollm2.hf_dir), "--served-model-name", MODEL, "--max-model-len", "2048",
                        "--num-kv-blocks", "256", "--port", "0"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=300)
    yield srv.url
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


def test_json_schema_answer_sync_and_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
              max_tokens=60, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    r = client.chat.completions.create(**kw)
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, CITY)
    assert answer["city"] == "Paris"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == r.choices[0].message.content


def test_required_tool_call_is_valid_and_sensible(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.function.name == "get_weather" and "Paris" in call.function.arguments


def test_required_tool_call_ends_once_its_calls_are_written(client):
    # With parallel calls allowed and one tool, SmolLM2 wrote this call twice (75 tokens) when the
    # grammar let the array grow: at max_tokens 60 the answer ended "length" with one call done.
    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and state, e.g. San Francisco, CA", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"]}}}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=weather, tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens < 60
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), weather[0]["function"]["parameters"])


def test_auto_without_the_flags_is_a_400_and_the_server_stays_healthy(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert exc.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in exc.value.body["message"]
    assert http(server, "GET", "/health")[0] == 200
    idle(server)


def test_langchain_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=40)
        country: str = Field(max_length=40)

    llm = ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key="x", temperature=0, max_tokens=60, max_retries=0)
    answer = llm.with_structured_output(City).invoke("What is the capital of Germany?")
    assert isinstance(answer, City) and answer.city == "Berlin"
