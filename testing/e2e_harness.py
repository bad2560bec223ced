"""The parts of a cluster that kmock lacks, played by the test: kubelet, ReplicaSets, garbage collector.

`Kubelet` watches Deployments in the emulator and makes their pods real: each pod gets its own
loopback address (127.0.0.N), a stub engine serving kvserve-named `/metrics` (and a canned
completion) there, and the real `kvserve agent serve` process in front of it on the agent port.
A router Deployment's pods (spec.router) are the real `kvserve router` process, logging in to the
emulator with a kubeconfig as its service account would in a cluster. Rollouts follow the Deployment's
strategy (one surge pod, an old pod removed only once the new one is Ready). When a Deployment
disappears, its pods go too, as the garbage collector would do on a real cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import kopf
from aiohttp import web

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator.handlers import OperatorConfig, build_registry

KVSERVE = str(Path(sys.executable).parent / "kvserve")
NAMESPACE = "default"


def free_port_on_all(hosts: list[str]) -> int:
    """A port free on every given loopback address (pods share one agent port, as in a cluster)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


class Api:
    """A tiny synchronous client for the test thread (what kubectl would do)."""

    # What an unexpected HTTP status raises: a test's failure here; the demo script raises its own.
    error: type[Exception] = AssertionError

    def __init__(self, url: str):
        self.url = url

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise self.error(f"{method} {path}: {error.code} {error.read()[:300]!r}") from None

    def items(self, path: str) -> list[dict]:
        return (self.call("GET", path) or {}).get("items", [])

    def isvc_path(self, name: str = "") -> str:
        base = f"/apis/kvserve.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
        return f"{base}/{name}" if name else base

    def get_isvc(self, name: str) -> dict | None:
        return self.call("GET", self.isvc_path(name))

    def apply_isvc(self, obj: dict) -> dict:
        return self.call("POST", self.isvc_path(), obj)

    def patch_spec(self, name: str, spec_patch: dict) -> dict:
        return self.call("PATCH", self.isvc_path(name), {"spec": spec_patch}, "application/merge-patch+json")

    def delete_isvc(self, name: str) -> Any:
        return self.call("DELETE", self.isvc_path(name))

    def get(self, kind: str, name: str) -> dict | None:
        from kvserve.operator.kube import KubeClient

        return self.call("GET", KubeClient.path(kind, NAMESPACE, name))

    def list(self, kind: str) -> list[dict]:
        from kvserve.operator.kube import KubeClient

        return (self.call("GET", KubeClient.path(kind, NAMESPACE)) or {}).get("items", [])

    def events(self) -> list[dict]:
        return (self.call("GET", f"/api/v1/namespaces/{NAMESPACE}/events") or {}).get("items", [])


def wait_for(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.1):
    """The predicate's first truthy value; AssertionError naming `what` (and the last value) on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


class Load:
    """What every stub engine reports; the test turns it up and down."""

    def __init__(self):
        self.kv, self.queue, self.running = 0.3, 0, 2
        self.capacity_per_tp = 4096
        self.itl_sum, self.itl_count = 0.0, 0  # the engines' inter-token latency totals (TPOT)
        self.completions = 0  # requests the stub engines answered
        self.reshapes: list[tuple[str, int, int]] = []  # (pod, dp, tp) of every POST /admin/parallelism


# The admin key every stub pod's agent and engine check (spec.runtime.adminApiKeySecret's value).
ADMIN_KEY = "e2e-admin-key"


class StubLora:
    """A pod's LoRA side (spec.adapters): the adapter list as the kubelet projects the ConfigMap
    into the pod, the adapters volume, and what the stub engine has loaded. The stub refuses an
    adapter above the template's --max-lora-rank, as the runtime does."""

    def __init__(self, max_rank: int, max_loaded: int):
        self.root = Path(tempfile.mkdtemp(prefix="kvserve-pod-"))
        self.list_file = self.root / "list" / "adapters.json"
        self.list_file.parent.mkdir()
        self.adapters_dir = self.root / "adapters"
        self.max_rank, self.max_loaded = max_rank, max_loaded
        self.loaded: dict[str, str] = {}

    def project(self, text: str) -> None:
        if not self.list_file.exists() or self.list_file.read_text() != text:
            tmp = self.list_file.with_suffix(".tmp")  # the kubelet swaps the projection atomically
            tmp.write_text(text)
            os.replace(tmp, self.list_file)

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], Path(body["lora_path"])
        rank = json.loads((path / "adapter_config.json").read_text()).get("r", 0)
        if rank > self.max_rank:
            return _error(400, f"LoRA rank {rank} of {name!r} is above --max-lora-rank {self.max_rank}")
        if name in self.loaded:
            return _error(400, f"The lora adapter {name!r} has already been loaded.")
        if len(self.loaded) >= self.max_loaded:
            return _error(400, f"{self.max_loaded} adapters are loaded (--max-cpu-loras)")
        self.loaded[name] = str(path)
        return web.Response(text=f"Success: LoRA adapter {name!r} added successfully.")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.loaded.pop(name, None) is None:
            return _error(404, f"The lora adapter {name!r} cannot be found.")
        return web.Response(text=f"Success: LoRA adapter {name!r} removed successfully.")

    def metrics(self) -> list[str]:
        return ["# TYPE kvserve:lora_adapter_loaded gauge"] + [
            f'kvserve:lora_adapter_loaded{{model_name="tiny",lora_name="{n}"}} 1' for n in sorted(self.loaded)]

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                             status=status)


def _flag(command: list[str], flag: str, default: int) -> int:
    return int(command[command.index(flag) + 1]) if flag in command else default


class StubPod:
    def __init__(self, name: str, ip: str, tp: int, engine_port: int, agent_port: int, load: Load,
                 model_dir: str | None = None, dp: int = 1, lora: StubLora | None = None):
        self.name, self.ip, self.tp, self.model_dir = name, ip, tp, model_dir
        self.dp = dp
        self.engine_port, self.agent_port, self.load = engine_port, agent_port, load
        self.runner: web.AppRunner | None = None
        self.agent: subprocess.Popen | None = None
        self.lora = lora

    def metrics(self) -> str:
        load, label = self.load, '{model_name="tiny"}'
        # A pod at a higher TP holds more KV: the same load shows as lower utilization.
        kv = min(1.0, load.kv / self.tp)
        lines = []
        for name, value in [("vllm:kv_cache_usage_perc", kv), ("vllm:num_requests_waiting", load.queue),
                            ("vllm:num_requests_running", load.running),
                            ("kvserve:kv_cache_capacity_tokens", load.capacity_per_tp * self.tp),
                            ("kvserve:tensor_parallel_size", self.tp),
                            ("kvserve:data_parallel_size", self.dp)]:
            lines += [f"# TYPE {name} gauge", f"{name}{label} {value}"]
        if load.itl_count:
            name = "vllm:inter_token_latency_seconds"
            lines += [f"# TYPE {name} summary", f"{name}_sum{label} {load.itl_sum}",
                      f"{name}_count{label} {load.itl_count}"]
        if self.lora is not None:
            lines += self.lora.metrics()
        return "\n".join(lines) + "\n"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", lambda r: web.Response(text=self.metrics(), content_type="text/plain"))
        app.router.add_get("/ready", lambda r: web.Response(text="ok"))
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_post("/v1/completions", self.complete)
        lora_flags = []
        if self.lora is not None:
            app.router.add_post("/v1/load_lora_adapter", self.lora.load_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.lora.unload_adapter)
            lora_flags = ["--adapters-file", str(self.lora.list_file), "--adapters-dir", str(self.lora.adapters_dir)]
        app.router.add_post("/admin/parallelism", self.reshape)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.ip, self.engine_port).start()
        self.agent = subprocess.Popen(
            [KVSERVE, "agent", "serve", "--engine-url", f"http://{self.ip}:{self.engine_port}",
             "--host", self.ip, "--port", str(self.agent_port), "--engine", "kvserve",
             "--interval", "0.2", "--stale-after", "3",
             *(["--model-dir", self.model_dir] if self.model_dir else []), *lora_flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "KVSERVE_ADMIN_API_KEY": ADMIN_KEY})
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://{self.ip}:{self.agent_port}/v1/signals") as r:
                        if r.status == 200 and not (await r.json()).get("stale", True):
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"agent for {self.name} did not come up")

    async def reshape(self, request: web.Request) -> web.Response:
        """The runtime's live layout change, as the agent passes it on with the pod's admin key."""
        if request.headers.get("Authorization") != f"Bearer {ADMIN_KEY}":
            return web.json_response({"error": {"message": "bad admin key"}}, status=403)
        body = await request.json()
        before = (self.dp, self.tp)
        self.dp, self.tp = body["data_parallel"], body["tensor_parallel"]
        self.load.reshapes.append((self.name, self.dp, self.tp))
        return web.json_response({"data_parallel": self.dp, "tensor_parallel": self.tp, "changed": before != (self.dp, self.tp),
                                  "seconds": 0.05, "resumed_requests": self.load.running})

    async def complete(self, request: web.Request) -> web.Response:
        self.load.completions += 1
        return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": f" from {self.name}", "finish_reason": "length",
                                               "logprobs": None}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(5)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.lora is not None:
            self.lora.cleanup()


class RouterPod:
    """A router Deployment's pod: its container command, run for real on the pod's address."""

    def __init__(self, name: str, ip: str, command: list[str], *, port: int, engine_port: int, agent_port: int,
                 kubeconfig: str):
        self.name, self.ip, self.port = name, ip, port
        flags = {"--host": ip, "--port": str(port), "--runtime-port": str(engine_port),
                 "--agent-port": str(agent_port)}
        cmd = list(command)
        for flag, value in flags.items():  # the pod's network namespace, played by a loopback address
            cmd[cmd.index(flag) + 1] = value
        self.command = [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]]
        self.kubeconfig = kubeconfig
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": self.kubeconfig}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                try:
                    async with session.get(f"http://{self.ip}:{self.port}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"router {self.name} did not come up")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def pod_owner(pod: dict) -> str:
    """The Deployment a pod belongs to (runtime pods: the service's name; router pods: NAME-router)."""
    labels = pod["metadata"].get("labels") or {}
    if labels.get(M.ROUTER_LABEL):
        return labels[M.ROUTER_LABEL] + "-router"
    return labels.get(M.OWNER_LABEL, "")


class Kubelet:
    """Reconciles emulated Deployments into real processes; runs as a task on the emulator's loop."""

    def __init__(self, api_url: str, agent_port: int, engine_port: int, load: Load, *, router_port: int = 0,
                 kubeconfig: str = ""):
        self.api_url, self.agent_port, self.engine_port, self.load = api_url, agent_port, engine_port, load
        self.router_port, self.kubeconfig = router_port, kubeconfig
        self.pods: dict[str, StubPod | RouterPod] = {}
        self.ips = (f"127.0.0.{i}" for i in range(2, 255))
        self.counter = 0
        self.stopped = False
        self.created: list[str] = []
        # A model directory for the pods of each Deployment (name -> path): its agent reports it.
        self.model_dirs: dict[str, str] = {}

    async def _req(self, session, method, path, body=None):
        async with session.request(method, self.api_url + path, json=body) as r:
            return await r.json() if r.status < 400 else None

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while not self.stopped:
                try:
                    await self.step(session)
                except Exception as error:  # keep playing the kubelet; tests see the effect
                    print(f"kubelet: {type(error).__name__}: {error}", file=sys.stderr)
                await asyncio.sleep(0.1)
            for pod in list(self.pods.values()):
                await pod.stop()

    async def step(self, session) -> None:
        deps = (await self._req(session, "GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments") or {})
        deps = {d["metadata"]["name"]: d for d in deps.get("items", [])}
        pods = (await self._req(session, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods") or {}).get("items", [])
        by_owner: dict[str, list[dict]] = {}
        for pod in pods:
            by_owner.setdefault(pod_owner(pod), []).append(pod)
        for owner, owned in by_owner.items():
            if owner not in deps:  # garbage collection
                for pod in owned:
                    await self.delete_pod(session, pod)
        for name, dep in deps.items():
            await self.reconcile(session, dep, by_owner.get(name, []))
        await self.project_configmaps(session)

    async def project_configmaps(self, session) -> None:
        """What the kubelet does for a mounted ConfigMap: the pod's file follows the object."""
        for stub in list(self.pods.values()):
            lora = getattr(stub, "lora", None)
            if lora is None:
                continue
            owner = stub.name.rsplit("-", 1)[0]
            cm = await self._req(session, "GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{owner}-adapters")
            if cm is not None:
                lora.project((cm.get("data") or {}).get("adapters.json", "[]"))

    async def reconcile(self, session, dep: dict, pods: list[dict]) -> None:
        want = dep["spec"]["replicas"]
        template = dep["spec"]["template"]
        current = M.template_hash(dep)
        new = [p for p in pods if p["metadata"]["annotations"].get(M.HASH_ANNOTATION) == current]
        old = [p for p in pods if p not in new]
        if len(new) < want and len(pods) < want + 1:  # maxSurge 1
            await self.create_pod(session, dep, template)
        elif old and len(new) + len(old) > want:  # maxUnavailable 0: new ones are Ready when created
            await self.delete_pod(session, old[0])
        elif len(new) > want:
            await self.delete_pod(session, sorted(new, key=lambda p: p["metadata"]["name"])[-1])

    async def create_pod(self, session, dep: dict, template: dict) -> None:
        self.counter += 1
        name = f"{dep['metadata']['name']}-{self.counter}"
        if M.ROUTER_LABEL in (template["metadata"].get("labels") or {}):
            stub = RouterPod(name, next(self.ips), template["spec"]["containers"][0]["command"],
                             port=self.router_port, engine_port=self.engine_port, agent_port=self.agent_port,
                             kubeconfig=self.kubeconfig)
        else:
            tp = int(template["metadata"]["annotations"][M.TP_ANNOTATION])
            runtime = template["spec"]["containers"][0]["command"]
            dp = int(runtime[runtime.index("--data-parallel-size") + 1]) if "--data-parallel-size" in runtime else 1
            lora = (StubLora(_flag(runtime, "--max-lora-rank", 16), _flag(runtime, "--max-cpu-loras", 16))
                    if "--enable-lora" in runtime else None)
            if lora is not None:  # mounted before the containers start, as a kubelet does
                cm = await self._req(session, "GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/"
                                     f"{dep['metadata']['name']}-adapters")
                lora.project(((cm or {}).get("data") or {}).get("adapters.json", "[]"))
            stub = StubPod(name, next(self.ips), tp, self.engine_port, self.agent_port, self.load,
                           self.model_dirs.get(dep["metadata"]["name"]), dp=dp, lora=lora)
        await stub.start()
        self.pods[name] = stub
        self.created.append(name)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NAMESPACE, **template["metadata"]},
               "spec": template["spec"],
               "status": {"phase": "Running", "podIP": stub.ip, "conditions": [{"type": "Ready", "status": "True"}]}}
        await self._req(session, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    async def delete_pod(self, session, pod: dict) -> None:
        name = pod["metadata"]["name"]
        await self._req(session, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        stub = self.pods.pop(name, None)
        if stub is not None:
            await stub.stop()


class OperatorThread:
    """The real operator (kopf) in its own thread and event loop, as `kvserve-operator run` would run."""

    def __init__(self, api_url: str, config: OperatorConfig, *, peering: bool = False, priority: int = 0,
                 peering_name: str = "default"):
        self.api_url, self.config = api_url, config
        self.peering, self.priority, self.peering_name = peering, priority, peering_name
        if peering:  # as `kvserve-operator run` sets it when not --standalone
            config.peering_name, config.namespaces = peering_name, (NAMESPACE,)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kopf", daemon=True)
        self.error: BaseException | None = None
        self.reconciler = None  # its .metrics, for the tests

    def _run(self) -> None:
        registry, self.reconciler = build_registry(self.config)
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True  # kmock cannot list namespaces
        settings.watching.reconnect_backoff = 0.2
        settings.networking.request_timeout = 10
        settings.peering.name = self.peering_name
        try:
            asyncio.run(kopf.operator(registry=registry, settings=settings, standalone=not self.peering,
                                      priority=self.priority, peering_name=self.peering_name if self.peering else None,
                                      namespaces=[NAMESPACE], stop_flag=self.stop_flag,
                                      ready_flag=self.ready_flag))
        except BaseException as error:  # surfaced by the test
            self.error = error

    def start(self) -> OperatorThread:
        self.thread.start()
        if not self.ready_flag.wait(20):
            raise RuntimeError(f"operator did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "operator did not stop"


# The InferenceService the operator e2e tests and bench/operator_faults.py reconcile: a tiny model,
# autoscaling windows of seconds.
TINY_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
DOWN_WINDOW = 4.0
TP_DOWN_WINDOW = 8.0

TINY = {
    "apiVersion": "kvserve.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "tiny", "namespace": "default"},
    "spec": {
        "model": {"uri": "hf://kvserve/tiny", "servedName": "tiny", "config": TINY_CONFIG},
        "gpu": {"perShard": 0},
        "parallelism": {"tensor": {"min": 1, "max": 2, "initial": 1}},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targetKVCacheUtilization": 0.5,
                        "targetQueueDepth": 2, "scaleUpStabilizationSeconds": 1,
                        "scaleDownStabilizationSeconds": DOWN_WINDOW, "panicWindowSeconds": 1,
                        "tensorParallel": {"enabled": True, "scaleDownStabilizationSeconds": TP_DOWN_WINDOW}},
    },
}


def defaulted(obj: dict) -> dict:
    """What the API server would store: the CRD's defaults applied, and it must validate."""
    assert crd.validate(obj) == []
    return crd.apply_defaults(obj, crd.openapi_schema())
