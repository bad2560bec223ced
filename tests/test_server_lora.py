"""LoRA adapters through the server, with the official `openai` client: the `model` field picks
the adapter, /v1/models lists adapters under their base model, the admin load/unload routes (bad
adapters, the --max-cpu-loras bound, credentials), the LoRA metrics, and the flags."""

from __future__ import annotations

import json

import pytest
from server_helpers import http, m, metrics

from kvserve.runtime.server.lora import LoRAModule, parse_lora_module

ADMIN = "admin-key-0123456789"
USER = "user-key-0123456789"


@pytest.mark.parametrize("text, expected", [
    ("sql=/adapters/sql", LoRAModule("sql", "/adapters/sql")),
    ("a=b=c", LoRAModule("a", "b=c")),
    ('{"name": "sql", "path": "/a", "base_model_name": "base"}', LoRAModule("sql", "/a", "base")),
    ('{"name": "sql", "path": "/a"}', LoRAModule("sql", "/a")),
])
def test_lora_modules_forms(text, expected):
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text, problem", [
    ("sql", "neither name=path"),
    ("=/a", "name"),
    ("sql=", "needs a path"),
    ('{"name": "sql"}', "needs a path"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "unknown key"),
    ("{not json", "not valid JSON"),
    ('{"name": "a b", "path": "/a"}', "visible ASCII"),
])
def test_lora_modules_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_lora_module(text)


def test_lora_flags_need_enable_lora():
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.server.main import engine_kwargs, lora_problem

    parse = build_parser().parse_args
    args = parse(["serve", "m", "--lora-modules", "a=/a", "--max-loras", "2"])
    assert lora_problem(args) == "--lora-modules needs --enable-lora"
    base = parse(["serve", "m"])
    assert lora_problem(base) is None and "enable_lora" not in engine_kwargs(base)  # the base path is unchanged
    on = parse(["serve", "m", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                "--lora-dtype", "bfloat16", "--lora-modules", "a=/a", '{"name": "b", "path": "/b"}'])
    assert lora_problem(on) is None
    keys = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")
    assert {k: engine_kwargs(on)[k] for k in keys} == {
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3, "lora_dtype": "bfloat16"}
    assert lora_problem(parse(["serve", "m", "--lora-dtype", "bfloat16"])) == "--lora-dtype needs --enable-lora"
    assert [x.name for x in on.lora_modules] == ["a", "b"]
    with pytest.raises(SystemExit):
        parse(["serve", "m", "--enable-lora", "--lora-modules", "broken"])


def make_adapter(base_dir, out, *, rank, seed, targets=("q_proj", "v_proj")):
    """A PEFT adapter of the tiny model with random (non-zero) B, so its outputs differ."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                  init_lora_weights=False))
    peft_model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    # The engine side (kvserve.runtime.lora) lands separately; until it does there is nothing to serve.
    pytest.importorskip("kvserve.runtime.lora")
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": make_adapter(tiny_llama, root / "sql", rank=4, seed=1),
            "chat": make_adapter(tiny_llama, root / "chat", rank=8, seed=2),
            "big": make_adapter(tiny_llama, root / "big", rank=32, seed=3)}


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    from kvserve.runtime.server.main import ServerThread

    s = ServerThread([str(tiny_llama), "--port", "0", "--served-model-name", "tiny", "--device", "cpu",
                      "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "16",
                      "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
                      "--lora-modules", f"sql={adapters['sql']}",
                      "--api-key", USER, "--admin-api-key", ADMIN]).start()
    from server_helpers import wait_until

    wait_until(lambda: http(s.url, "GET", "/ready")[0] == 200, timeout=120)
    yield s
    s.stop()


def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=USER, max_retries=0)


def admin(server, route, body, key=ADMIN):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, _, data = http(server.url, "POST", route, body, headers=headers)
    return status, data.decode()


def greedy(c, model, prompt="hello there", n=8):
    out = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return out.model, out.choices[0].text


def test_model_field_picks_the_adapter(server):
    import openai

    c = client(server)
    models = {m.id: m for m in c.models.list().data}
    assert set(models) == {"tiny", "sql"}
    assert models["sql"].parent == "tiny" and models["tiny"].parent is None
    assert c.models.retrieve("sql").parent == "tiny"
    base_model, base = greedy(c, "tiny")
    sql_model, sql = greedy(c, "sql")
    assert (base_model, sql_model) == ("tiny", "sql")
    assert sql != base  # the adapter changes the output
    assert greedy(c, "sql") == (sql_model, sql)  # and deterministically
    chat = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0)
    assert chat.model == "sql"
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "`nope` does not exist" in str(info.value)


def test_load_and_unload_adapters(server, adapters, tmp_path):
    import openai

    c = client(server)
    # The admin key only: no key, or the user key, is refused.
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}, key=None)[0] == 401
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}, key=USER)[0] == 403
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert status == 200 and "added successfully" in text
    assert "chat" in {m.id for m in c.models.list().data}
    _, chat = greedy(c, "chat")
    _, sql = greedy(c, "sql")
    assert chat != sql
    # Bad adapters: a 400 that says why, and nothing registered.
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert status == 400 and "already been loaded" in text
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert status == 400 and json.loads(text)["error"]["param"] in ("lora_name", "lora_path")
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": adapters["sql"]})
    assert status == 400 and "--max-cpu-loras 2" in text  # the bound: sql and chat are loaded
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": adapters["sql"]})
    assert status == 400 and "base model" in text
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_path": adapters["sql"]})
    assert status == 400 and "lora_name" in text
    # Unload: gone from /v1/models and from the model field; unknown names are a 404.
    status, text = admin(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and "removed successfully" in text
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})[0] == 404
    with pytest.raises(openai.NotFoundError):
        greedy(c, "chat")
    # A rank above --max-lora-rank 8 is the engine's refusal, said in the 400.
    status, text = admin(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["big"]})
    assert status == 400 and "rank" in text.lower()
    assert {m.id for m in c.models.list().data} == {"tiny", "sql"}


def test_lora_metrics(server):
    c = client(server)
    before = m(metrics(server.url), "kvserve:lora_requests_total", lora_name="sql")
    greedy(c, "sql", n=2)
    snap = metrics(server.url)
    assert m(snap, "kvserve:lora_requests_total", lora_name="sql") == before + 1
    assert m(snap, "kvserve:lora_adapter_loaded", lora_name="sql") == 1
    info = [labels for (name, labels) in snap if name == "vllm:lora_requests_info"]
    assert info and dict(info[0])["max_lora"] == "2"
    assert set(dict(info[0])) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}


def test_agent_keeps_the_runtime_adapters_equal_to_its_list(server, adapters, tmp_path):
    """The pod's agent (runtime/agent/adapters.py) against the real server: fetch, load with the
    admin key, report a refusal, unload when dropped from the list."""
    import asyncio

    from kvserve.runtime.agent.app import Agent, AgentConfig

    listing = tmp_path / "adapters.json"
    agent = Agent(AgentConfig(engine_url=server.url, engine="kvserve", admin_api_key=ADMIN,
                              adapters_file=str(listing), adapters_dir=str(tmp_path / "fetched")))
    sync = agent.adapters

    async def go():
        try:
            # big first: with sql and chat loaded the --max-cpu-loras bound would refuse it instead.
            listing.write_text(json.dumps([{"name": "big", "uri": adapters["big"]},
                                           {"name": "chat", "uri": adapters["chat"]}]))
            await sync.sync_once(0.0, engine_loaded=["sql"])
            report = sync.report()
            assert report["loaded"] == ["chat"] and "rank" in report["failed"]["big"].lower()
            assert (tmp_path / "fetched" / "chat" / "adapter_config.json").exists()
            assert "chat" in {m.id for m in client(server).models.list().data}
            listing.write_text("[]")
            sync._mtime = None
            await sync.sync_once(1.0, engine_loaded=["sql", "chat"])
            assert sync.report()["loaded"] == [] and not (tmp_path / "fetched" / "chat").exists()
            assert {m.id for m in client(server).models.list().data} == {"tiny", "sql"}
        finally:
            await agent.stop(None)

    asyncio.run(go())
