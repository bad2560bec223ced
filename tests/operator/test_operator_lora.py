"""spec.adapters (multi-LoRA) in the operator: the spec and the CRD's rules, the pure builders
(the adapter list travels in a ConfigMap, so the pod template does not change with it), the
status, and end to end against the emulator: the real operator and real agents load, report and
unload adapters on running pods without a restart, and a bad adapter is a condition and an Event."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from kvserve.operator import crd
from kvserve.operator import desired as D
from kvserve.operator import lora as L
from kvserve.operator import manifests as M
from kvserve.operator.handlers import OperatorConfig
from kvserve.operator.spec import SpecError, parse_spec
from kvserve.testing.e2e_harness import Api, Kubelet, Load, OperatorThread, condition, free_port_on_all, wait_for
from kvserve.testing.kube_emulator import EmulatorThread

OWNER = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "svc", "namespace": "default", "uid": "u1"}}
MODEL = {"uri": "hf://org/base", "servedName": "base"}


def spec(**extra):
    return parse_spec({"model": MODEL, "gpu": {"perShard": 0}, **extra})


def isvc(spec_fields: dict) -> dict:
    return {**copy.deepcopy(OWNER), "spec": {"model": MODEL, **spec_fields}}


@pytest.mark.parametrize("fields, field", [
    ({"adapters": [{"name": "base", "uri": "/a"}]}, "spec.adapters[0].name"),
    ({"adapters": [{"name": "../x", "uri": "/a"}]}, "spec.adapters[0].name"),
    ({"adapters": [{"name": "a", "uri": "pvc://claim"}]}, "spec.adapters[0].uri"),
    ({"adapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]}, "spec.adapters[1].name"),
    ({"adapters": [{"name": "a"}]}, "spec.adapters[0].uri"),
    ({"adapters": [{"name": "a", "uri": "/a"}], "lora": {"enabled": False}}, "spec.lora.enabled"),
    ({"lora": {"maxLoraRank": 12}}, "spec.lora.maxLoraRank"),
    ({"lora": {"maxLoras": 8, "maxCpuLoras": 4}}, "spec.lora.maxCpuLoras"),
    ({"adapters": [{"name": f"a{i}", "uri": "/a"} for i in range(3)], "lora": {"maxLoras": 1, "maxCpuLoras": 2}},
     "spec.adapters"),
])
def test_bad_adapter_specs_name_the_field(fields, field):
    with pytest.raises(SpecError) as info:
        spec(**fields)
    assert info.value.field == field


@pytest.mark.parametrize("fields, problem", [
    ({"adapters": [{"name": "base", "uri": "/a"}]}, "must differ from spec.model.servedName"),
    ({"adapters": [{"name": f"a{i}", "uri": "/a"} for i in range(17)]}, "more adapters than spec.lora.maxCpuLoras"),
    ({"lora": {"maxLoras": 8, "maxCpuLoras": 4}}, "at least spec.lora.maxLoras"),
    ({"lora": {"maxLoraRank": 12}}, "maxLoraRank"),
    ({"adapters": [{"name": "a", "uri": "pvc://claim"}]}, "uri"),
])
def test_the_crd_refuses_what_the_operator_refuses(fields, problem):
    errors = crd.validate(isvc(fields))
    assert any(problem in e for e in errors), errors


def test_no_adapters_keeps_the_base_objects():
    plain = spec()
    assert not plain.lora.enabled and L.runtime_args(plain) == []
    objects = D.owned_objects(OWNER, plain, replicas=1, tp=1)
    assert "ConfigMap" not in {o["kind"] for o in objects}
    text = json.dumps(M.build_deployment(OWNER, plain, replicas=1, tp=1))
    assert "lora" not in text and "adapter" not in text


def test_adding_or_removing_an_adapter_does_not_change_the_pod_template():
    one = spec(adapters=[{"name": "sql", "uri": "hf://org/sql-lora"}])
    two = spec(adapters=[{"name": "sql", "uri": "hf://org/sql-lora"}, {"name": "chat", "uri": "/adapters-src/chat"}])
    none_yet = spec(lora={"enabled": True})
    deployments = [M.build_deployment(OWNER, s, replicas=1, tp=1) for s in (one, two, none_yet)]
    assert len({M.template_hash(d) for d in deployments}) == 1  # no rollout, no restart
    cms = [L.build_configmap(OWNER, s) for s in (one, two, none_yet)]
    assert [json.loads(c["data"]["adapters.json"]) for c in cms] == [
        [{"name": "sql", "uri": "hf://org/sql-lora"}],
        [{"name": "sql", "uri": "hf://org/sql-lora"}, {"name": "chat", "uri": "/adapters-src/chat"}], []]
    assert cms[0]["metadata"]["name"] == "svc-adapters" and cms[0]["metadata"]["ownerReferences"][0]["uid"] == "u1"
    pod = deployments[0]["spec"]["template"]["spec"]
    runtime, agent = pod["containers"]
    cmd = runtime["command"]
    assert cmd[cmd.index("--enable-lora"):cmd.index("--enable-lora") + 7] == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--max-cpu-loras", "16"]
    assert "--lora-modules" not in cmd  # the agent loads them: a bad one is a condition, not a crash loop
    assert {"name": "adapters", "mountPath": L.ADAPTERS_DIR, "readOnly": True} in runtime["volumeMounts"]
    assert agent["command"][-4:] == ["--adapters-file", L.LIST_FILE, "--adapters-dir", L.ADAPTERS_DIR]
    # The agent downloads adapters: a writable hub cache (its models mount is read-only).
    assert {"name": "HF_HOME", "value": f"{L.ADAPTERS_DIR}/.hf-home"} in agent["env"]
    assert len({e["name"] for e in agent["env"]}) == len(agent["env"])  # server-side apply: no duplicates
    assert {"name": "adapter-list", "configMap": {"name": "svc-adapters"}} in pod["volumes"]
    # Changing a limit is a runtime flag: that one does roll the pods.
    ranked = spec(adapters=[{"name": "sql", "uri": "/a"}], lora={"maxLoraRank": 64})
    assert M.template_hash(M.build_deployment(OWNER, ranked, replicas=1, tp=1)) != M.template_hash(deployments[0])


def test_a_private_hub_token_reaches_the_agent_only_with_adapters():
    token = {"hfTokenSecret": {"name": "hf", "key": "HF_TOKEN"}}
    with_adapters = parse_spec({"model": {**MODEL, **token}, "adapters": [{"name": "sql", "uri": "hf://o/sql"}]})
    plain = parse_spec({"model": {**MODEL, **token}})
    agent_env = [M.build_deployment(OWNER, s, replicas=1, tp=1)["spec"]["template"]["spec"]["containers"][1]["env"]
                 for s in (with_adapters, plain)]
    assert any(e["name"] == "HF_TOKEN" for e in agent_env[0])
    assert not any(e["name"] == "HF_TOKEN" for e in agent_env[1])


def test_vllm_engine_gets_runtime_lora_updating():
    s = spec(adapters=[{"name": "sql", "uri": "/a"}], runtime={"engine": "vllm"})
    env = M.build_deployment(OWNER, s, replicas=1, tp=1)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in env


@pytest.mark.parametrize("engine, api_key, gets_key", [
    ("vllm", True, True),     # vLLM's LoRA routes want the user key: the agent gets it
    ("vllm", False, False),
    ("kvserve", True, False),  # kvserve's want the admin key, which the agent has
])
def test_the_agent_gets_vllms_api_key_from_its_secret(engine, api_key, gets_key):
    runtime = {"engine": engine, **({"apiKeySecret": {"name": "keys", "key": "user"}} if api_key else {})}
    s = spec(adapters=[{"name": "sql", "uri": "/a"}], runtime=runtime)
    containers = M.build_deployment(OWNER, s, replicas=1, tp=1)["spec"]["template"]["spec"]["containers"]
    env = [e for e in containers[1]["env"] if e["name"] == L.ENGINE_API_KEY_ENV]
    if gets_key:
        assert env == [{"name": L.ENGINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "keys", "key": "user"}}}]
    else:
        assert env == []
    assert all("value" not in e or e["name"] != L.ENGINE_API_KEY_ENV for c in containers for e in c.get("env", []))


def test_the_agent_loads_adapters_with_the_engine_key():
    """The agent's LoRA calls carry config.engine_api_key when set (vLLM), else the admin key. The
    engine here is a stand-in answering vLLM's rule (a Bearer user key on /v1 routes): vLLM itself
    cannot run in the tests."""
    from aiohttp import web

    from kvserve.runtime.agent.adapters import LoadRefused
    from kvserve.runtime.agent.app import Agent, AgentConfig, RuntimeAdmin

    seen = []

    async def load(request):
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer usr":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return web.Response(text="Success")

    async def main():
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            with_key = Agent(AgentConfig(engine_url=url, engine="vllm", admin_api_key="adm", engine_api_key="usr"))
            await RuntimeAdmin(with_key).load("sql", "/adapters/sql")
            await with_key.session.close()
            without = Agent(AgentConfig(engine_url=url, engine="vllm", admin_api_key="adm"))
            with pytest.raises(LoadRefused, match="401"):
                await RuntimeAdmin(without).load("sql", "/adapters/sql")
            await without.session.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert seen == ["Bearer usr", "Bearer adm"]


TWO = [{"name": "sql", "uri": "/a"}, {"name": "chat", "uri": "/b"}]


@pytest.mark.parametrize("adapters, reports, expected", [
    (TWO, {}, (False, "WaitingForPods")),
    (TWO, {"p1": {"loaded": ["sql"], "pending": ["chat"]}}, (False, "Loading")),
    (TWO, {"p1": {"loaded": ["sql", "chat"]}, "p2": {"loaded": ["sql"]}}, (False, "Loading")),
    (TWO, {"p1": {"loaded": ["sql"], "failed": {"chat": "rank 64 > 16"}}}, (False, "AdapterFailed")),
    (TWO, {"p1": {"loaded": ["sql", "chat"]}, "p2": {"loaded": ["chat", "sql"]}}, (True, "AllLoaded")),
    ([], {"p1": {}}, (True, "NoAdapters")),
])
def test_adapters_condition(adapters, reports, expected):
    s = spec(adapters=adapters, lora={"enabled": True})
    entries = L.adapters_status(reports)
    assert L.condition_fields(s, entries)[:2] == expected
    assert L.condition_fields(spec(), entries) is None


def test_status_entries_are_bounded_and_sorted():
    (entry,) = L.adapters_status({"p": {"loaded": ["b", "a", 3], "failed": {"x": "y" * 5000}, "pending": "junk"}})
    assert entry == {"pod": "p", "loaded": ["a", "b"], "pending": [], "failed": [{"name": "x", "message": "y" * 1024}]}


# --- end to end -------------------------------------------------------------------------------

def make_adapter(path, rank):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(rank, 8)},
              str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.mark.timeout(180)
def test_adapters_load_and_unload_on_running_pods_without_a_restart(tmp_path):
    emulator = EmulatorThread().start()
    ips = [f"127.0.0.{i}" for i in range(100, 110)]
    kubelet = Kubelet(emulator.url, free_port_on_all(ips), free_port_on_all(ips), Load())
    kubelet.ips = iter(ips)
    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    api = Api(emulator.url)
    import kopf

    op = OperatorThread(emulator.url, OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0,
                                                      agent_port=kubelet.agent_port, max_sample_age=3.0,
                                                      connection=kopf.ConnectionInfo(server=emulator.url))).start()
    sql, chat, big = make_adapter(tmp_path / "sql", 4), make_adapter(tmp_path / "chat", 8), make_adapter(
        tmp_path / "big", 64)
    try:
        obj = isvc({"gpu": {"perShard": 0}, "autoscaling": {"enabled": False}, "replicas": 1,
                    "adapters": [{"name": "sql", "uri": sql}, {"name": "big", "uri": big},
                                 {"name": "lost", "uri": str(tmp_path / "nowhere")}]})
        obj["metadata"] = {"name": "lora", "namespace": "default"}
        assert crd.validate(obj) == []
        api.apply_isvc(crd.apply_defaults(obj, crd.openapi_schema()))

        def adapters_status():
            o = api.get_isvc("lora") or {}
            return ((o.get("status") or {}).get("adapters") or [None])[0]

        entry = wait_for(lambda: (e := adapters_status()) and e["loaded"] == ["sql"] and len(e["failed"]) == 2 and e,
                         timeout=60, what="sql loaded, big and lost failed")
        failed = {f["name"]: f["message"] for f in entry["failed"]}
        assert "above --max-lora-rank 16" in failed["big"] and failed["lost"].startswith("fetch:")
        cond = condition(api.get_isvc("lora"), "AdaptersReady")
        assert cond["status"] == "False" and cond["reason"] == "AdapterFailed"
        wait_for(lambda: {e["message"].split(":")[0] for e in api.events()
                          if e["reason"] == "AdapterFailed"} >= {"adapter big", "adapter lost"}, timeout=60, what="Events")
        (pod,) = kubelet.pods.values()
        assert set(pod.lora.loaded) == {"sql"}
        hash_before, created_before = M.template_hash(api.get("Deployment", "lora")), list(kubelet.created)

        # Drop the bad ones, add chat: loaded and unloaded in place.
        api.patch_spec("lora", {"adapters": [{"name": "sql", "uri": sql}, {"name": "chat", "uri": chat}]})
        wait_for(lambda: condition(api.get_isvc("lora"), "AdaptersReady").get("reason") == "AllLoaded",
                 timeout=60, what="AllLoaded")
        assert set(pod.lora.loaded) == {"sql", "chat"}
        api.patch_spec("lora", {"adapters": [{"name": "chat", "uri": chat}]})
        wait_for(lambda: set(pod.lora.loaded) == {"chat"}, timeout=30, what="sql unloaded")
        wait_for(lambda: (adapters_status() or {}).get("loaded") == ["chat"], timeout=60, what="status follows")
        assert not (pod.lora.adapters_dir / "sql").exists()  # its files are gone with it
        assert M.template_hash(api.get("Deployment", "lora")) == hash_before
        assert kubelet.created == created_before  # no pod was replaced
        api.delete_isvc("lora")
        wait_for(lambda: api.get_isvc("lora") is None, timeout=60, what="deleted")
    finally:
        op.stop()
        kubelet.stopped = True
        task.result(30)
        emulator.stop()
    assert op.error is None
