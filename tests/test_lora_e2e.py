"""From the CRD to a real runtime: an InferenceService's spec.adapters rendered by the operator's
builders into the adapters ConfigMap, that file read by a real agent, which fetches the real PEFT
adapter and loads it into a real `kvserve serve` (tiny model) through the admin route with the
pod's admin key; then the official openai client asks for model=<adapter> and gets the adapter's
answer (not the base model's)."""

from __future__ import annotations

import asyncio
import time

from server_helpers import http, wait_until

from kvserve.operator import lora as L
from kvserve.operator import manifests as M
from kvserve.operator.spec import parse_spec
from kvserve.testing.adapters import build_lora_adapter

ADMIN = "admin-key-0123456789"
OWNER = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "svc", "namespace": "default", "uid": "u1"}}


def test_adapter_from_the_crd_answers_through_a_real_agent_and_runtime(tiny_llama, tmp_path):
    import openai

    from kvserve.runtime.agent.app import Agent, AgentConfig
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.server.main import ServerThread

    source = build_lora_adapter(tiny_llama, tmp_path / "src" / "sql", r=8, seed=5, std=0.3)
    spec = parse_spec({"model": {"uri": str(tiny_llama), "servedName": "tiny"}, "gpu": {"perShard": 0},
                       "adapters": [{"name": "sql", "uri": str(source)}]})
    # What the operator renders: the ConfigMap the kubelet mounts, and the agent's flags.
    configmap = L.build_configmap(OWNER, spec)
    containers = M.build_deployment(OWNER, spec, replicas=1, tp=1)["spec"]["template"]["spec"]["containers"]
    agent_cmd = containers[1]["command"]
    runtime_args = L.runtime_args(spec)  # --enable-lora and the limits, as the runtime container gets them
    assert agent_cmd[agent_cmd.index("--adapters-file") + 1] == L.LIST_FILE
    mounted = tmp_path / "etc-adapters"
    mounted.mkdir()
    (mounted / L.LIST_KEY).write_text(configmap["data"][L.LIST_KEY])
    adapters_dir = tmp_path / "adapters"
    adapters_dir.mkdir()

    server = ServerThread([str(tiny_llama), "--port", "0", "--served-model-name", "tiny", "--device", "cpu",
                           "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "16",
                           *runtime_args, "--admin-api-key", ADMIN]).start()
    try:
        wait_until(lambda: http(server.url, "GET", "/ready")[0] == 200, timeout=60)
        # The agent as the pod runs it: its flags parsed by the real CLI, the file and folder
        # where this test mounted them.
        args = build_parser().parse_args(["agent", *agent_cmd[2:]])
        config = AgentConfig(engine_url=server.url, engine=args.engine, admin_api_key=ADMIN,
                             adapters_file=str(mounted / L.LIST_KEY), adapters_dir=str(adapters_dir))
        agent = Agent(config)

        async def sync():
            try:
                await agent.adapters.sync_once(time.monotonic())
            finally:
                await agent.session.close()

        asyncio.run(sync())
        assert agent.adapters.report()["loaded"] == ["sql"], agent.adapters.report()
        assert (adapters_dir / "sql" / "adapter_config.json").exists()

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"tiny", "sql"}

        def ask(model):
            out = client.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0)
            return out.model, out.choices[0].text

        sql_model, sql = ask("sql")
        assert sql_model == "sql" and sql
        assert ask("tiny")[1] != sql  # the adapter, not the base model, answered
    finally:
        server.stop()
