"""response_format, structured_outputs, tools and tool_choice through `kvserve serve`, with the
official openai client (sync and streaming) and LangChain, on a tiny random-weight model whose
chat template renders tools (Hermes / Qwen style)."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import Future

import jsonschema
import openai
import pytest
from server_helpers import http, idle, m, metrics, wait_until

from kvserve.runtime.server.main import ServerThread
from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

MODEL = "tiny-tools"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}

# A Hermes-style template (as Qwen 2.5 writes it, shortened): tools in the system turn, assistant
# tool calls as <tool_call> JSON, tool results in the user turn.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|user|><tool_response>{{ message.content }}</tool_response><|end|>"
    "{% else %}<|{{ message.role }}|>{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("llama")
    dst = tmp_path_factory.mktemp("tools_model") / "m"
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread([str(model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "160",
                        "--max-model-len", "1024", "--port", "0", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 300)
    kw.setdefault("temperature", 0.9)
    kw.setdefault("seed", 1)
    return client.chat.completions.create(**kw)


def test_response_format_json_schema_sync_and_stream(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2, 3):
        r = chat(client, response_format=rf, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        text = "".join(c.choices[0].delta.content or "" for c in chat(client, response_format=rf, seed=seed, stream=True))
        assert text == r.choices[0].message.content
    r = chat(client, response_format={"type": "json_object"}, extra_body={"structured_outputs": None}, max_tokens=40)
    assert r.choices[0].message.content.startswith("{")


def test_structured_outputs_extra_body_on_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=20, n=3, seed=4,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    chunks = list(client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, stream=True, seed=5,
                                            extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text) == 8 and text[3] == "-" and text[:3].isupper() and text[4:].isdigit()
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=300, seed=6, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = chat(client, extra_body={"structured_outputs": {"grammar": 'root ::= "ok" | "not ok"'}})
    assert r.choices[0].message.content in ("ok", "not ok")


def _args_valid(call) -> str:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return call.function.name


def test_tool_choice_required_and_named(client):
    for seed in (1, 2):
        r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        msg = r.choices[0]
        assert msg.finish_reason == "tool_calls" and msg.message.content is None
        assert len(msg.message.tool_calls) == 1 and msg.message.tool_calls[0].id.startswith("call_")
        _args_valid(msg.message.tool_calls[0])
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "stop" and _args_valid(call) == "get_time"  # OpenAI: forced -> stop


def test_required_with_parallel_calls_ends_with_tool_calls(client):
    # Seeds 4 and 5 made the random model write get_time four times and run into max_tokens when
    # the grammar let the array grow; it holds at most one call per tool now.
    for tools in (TOOLS, TOOLS[1:]):
        for seed in (4, 5):
            r = chat(client, tools=tools, tool_choice="required", seed=seed, max_tokens=200)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens < 200
            assert 1 <= len(choice.message.tool_calls) <= len(tools)
            for call in choice.message.tool_calls:
                _args_valid(call)


def test_streamed_tool_calls_reassemble_to_the_sync_answer(client):
    for kw in (dict(tool_choice="required", parallel_tool_calls=False),
               dict(tool_choice={"type": "function", "function": {"name": "get_weather"}})):
        sync = chat(client, tools=TOOLS, seed=7, **kw).choices[0]
        chunks = list(chat(client, tools=TOOLS, seed=7, stream=True, **kw))
        deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert deltas[0].function.name and deltas[0].id and all(d.function.name is None for d in deltas[1:])
        assert len(deltas) > 2  # arguments come in fragments
        assert "".join(d.function.arguments for d in deltas) == sync.message.tool_calls[0].function.arguments
        assert chunks[-1].choices[0].finish_reason == sync.finish_reason
        # The SDK's own accumulator gives the same message.
        with client.chat.completions.stream(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=300,
                                            temperature=0.9, seed=7, **kw) as s:
            final = s.get_final_completion().choices[0].message
        assert final.tool_calls[0].function.arguments == sync.message.tool_calls[0].function.arguments
        assert final.tool_calls[0].function.name == sync.message.tool_calls[0].function.name


def test_auto_tool_choice_parses_hermes_tool_calls(client):
    # The random model would rarely write a tool call by itself: a regex makes it write one, and
    # the hermes parser (auto) must turn that text into tool_calls, sync and streamed alike.
    forced = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", '
              r'"arguments": \{"city": "Paris", "unit": "C"\}\}\n</tool_call>')
    kw = dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": forced}})
    r = chat(client, **kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    chunks = list(chat(client, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check.\n" and "<tool_call>" not in content
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris", "unit": "C"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = chat(client, tools=TOOLS, tool_choice="auto", max_tokens=8, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_messages_go_through_the_template(server, client, model_dir):
    from transformers import AutoTokenizer

    conversation = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = chat(client, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf_messages = conversation[:1] + [dict(conversation[1], content="", tool_calls=[dict(
        conversation[1]["tool_calls"][0], function={"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}})]),
        conversation[2]]
    text = tok.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>sunny, 21 C</tool_response>" in text and '"name": "get_weather"' in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    status, _, body = http(server.url, "POST", "/tokenize", {"messages": conversation, "tools": TOOLS})
    assert status == 200 and json.loads(body)["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= "}}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{bad"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_requests_are_400s_naming_the_field(server, client, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, max_tokens=5, **kw)
    assert exc.value.body["param"] == param, exc.value.body
    assert exc.value.body["type"] == "invalid_request_error"
    assert http(server.url, "GET", "/health")[0] == 200
    idle(server.url)  # nothing running, no KV block held


def test_a_slow_compile_holds_neither_health_nor_other_requests(server, client):
    manager = server.server.state.engine.structured_outputs
    slow = StructuredOutputsParams(json={"type": "object", "properties": {"waits": {"type": "boolean"}},
                                         "required": ["waits"]})
    pending: Future = Future()
    manager._futures[slow.key()] = pending
    result = {}

    def run():
        result["r"] = chat(client, response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": slow.schema()}}, max_tokens=200)

    t = threading.Thread(target=run)
    t.start()
    try:
        for _ in range(3):
            assert http(server.url, "GET", "/health", timeout=5)[0] == 200
            assert chat(client, max_tokens=3).choices[0].finish_reason in ("stop", "length")
        assert t.is_alive()
    finally:
        pending.set_result(manager._compile(slow))
        t.join(60)
    assert json.loads(result["r"].choices[0].message.content) in ({"waits": True}, {"waits": False})


def test_metrics_count_structured_requests_and_compiles(server, client):
    chat(client, response_format={"type": "json_object"}, max_tokens=5)
    snap = metrics(server.url)
    assert m(snap, "kvserve:structured_output_requests_total") > 0
    assert m(snap, "kvserve:grammar_compile_seconds_count") > 0


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=99)

    @tool
    def get_time(tz: str) -> str:
        """The time in a timezone."""
        return "12:00"

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", max_tokens=300, temperature=0.9,
                     seed=3, max_retries=0)
    msg = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it?")
    assert msg.tool_calls[0]["name"] == "get_time" and isinstance(msg.tool_calls[0]["args"]["tz"], str)
    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)
