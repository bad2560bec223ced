"""`make demo`: the whole kvserve loop on one machine, no cluster and no GPU.

What is real: the runtime (`kvserve serve`) and the agent (`kvserve agent serve`) as local
processes, started with the exact container commands of the pod template the operator built;
the operator (kvserve's kopf handlers, autoscaler, status, Events) reconciling
manifests/examples/inferenceservices/tiny-cpu.yaml; streaming OpenAI requests over HTTP.

What is emulated: the Kubernetes API (kmock's KubernetesEmulator with the project's test-side
fixes, tests/operator/kube_emulator.py), and what a cluster's controllers would do: this script
plays the kubelet (a Deployment's pods become runtime + agent processes, or the `kvserve router`
process for the router's Deployment, each pod on its own loopback address 127.77.x.N) and the
Service (requests go to a ready router pod). The model is a tiny random-weight Llama built here:
its text is noise, its serving is real.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from kvserve.testing.e2e_harness import Api

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # sibling scripts (rbac_audit)

BIN = Path(sys.executable).parent
WORK = ROOT / "build" / "demo"
EXAMPLE = ROOT / "manifests" / "examples" / "inferenceservices" / "tiny-cpu.yaml"
RUNTIME_PORT, AGENT_PORT = 8000, 8081

# The demo's changes to the example, printed before they are applied: a local model, a KV pool
# small enough for a burst to fill, stabilization windows of seconds instead of minutes, no
# CPU/memory requests (they are for a cluster's scheduler; there is none here), and the router
# in front with scale to zero after 15 idle seconds.
DEMO_SPEC = {
    "runtime": {"maxModelLen": 1024, "maxNumSeqs": 4, "args": ["--num-kv-blocks", "96"],
                "resources": None, "adminApiKeySecret": {"name": "tiny-cpu-admin", "key": "key"}},
    # Two devices per pod (two CPU ranks here), as 2 x TP1 or 1 x TP2, changed in place (docs/reshape.md).
    "parallelism": {"devicesPerPod": 2, "tensor": {"min": 1, "max": 2, "initial": 1}},
    "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "targetKVCacheUtilization": 0.6,
                    "targetQueueDepth": 2, "scaleUpStabilizationSeconds": 2,
                    "scaleDownStabilizationSeconds": 20, "panicWindowSeconds": 10,
                    "scaleToZeroAfterSeconds": 15,
                    "layout": {"stabilizationSeconds": 1, "reshapeCostMultiple": 2, "highLoadRequests": 3,
                               "lowLoadRequests": 1}},
    # kvEvents off: here every pod shares this machine's network, and the KV events port binds on
    # every interface, so only one pod could publish (in a cluster each pod has its own).
    "router": {"enabled": True, "holdTimeoutSeconds": 180, "kvEvents": False},
}
# The admin key the demo stores in the Secret spec.runtime.adminApiKeySecret names: the operator
# reads it to change the pods' layout, the pods get it as KVSERVE_ADMIN_API_KEY (secretKeyRef).
DEMO_SECRETS = {("tiny-cpu-admin", "key"): "demo-admin-" + os.urandom(8).hex()}
MODEL_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def header(step: str, title: str) -> None:
    say(f"\n\033[1m[{step}] {title}\033[0m")


# --- the model ---------------------------------------------------------------------------

def demo_model() -> Path:
    import hashlib

    key = hashlib.sha1(json.dumps(MODEL_CONFIG, sort_keys=True).encode()).hexdigest()[:8]
    path = WORK / f"model-{key}"
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        say(f"    cached: {path}")
        return path
    from kvserve.testing.tinymodels import build_tiny_model

    shutil.rmtree(path, ignore_errors=True)
    build_tiny_model(path, "llama", **MODEL_CONFIG)
    say(f"    built {path} (Llama, {MODEL_CONFIG['num_hidden_layers']} layers, hidden "
        f"{MODEL_CONFIG['hidden_size']}, random weights, BPE tokenizer trained on the spot)")
    return path


# --- the emulated cluster --------------------------------------------------------------------

def emulator_api(url: str):
    """What kubectl would do, against the emulator; an unexpected status is the demo's RuntimeError."""
    from kvserve.testing.e2e_harness import Api

    class DemoApi(Api):
        error = RuntimeError

    return DemoApi(url)


@dataclass
class Pod:
    name: str
    ip: str
    template_hash: str
    deployment: str = ""
    template: dict = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)   # container -> command
    env: dict[str, dict[str, str]] = field(default_factory=dict)   # container -> its environment
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ready: bool = False
    failures: dict[str, int] = field(default_factory=dict)
    probed_at: dict[str, float] = field(default_factory=dict)


# The pod's own in-memory volumes under /var/run/kvserve (the per-pod admin token) become a
# directory of the pod's own on this machine.
POD_RUN_DIR = "/var/run/kvserve/"


def _local_path(arg: str, run_dir: Path | None) -> str:
    if run_dir is not None and arg.startswith(POD_RUN_DIR):
        return str(run_dir / arg.removeprefix(POD_RUN_DIR))
    return arg


def _local(cmd: list[str], ip: str, model: Path, run_dir: Path | None = None) -> list[str]:
    """A container command made to run on this machine: the model directory the fetch step would
    fill is the demo model, the pod's /var/run/kvserve volumes are `run_dir`, and
    0.0.0.0/127.0.0.1 become the pod's own address (in a cluster each pod has its own network
    namespace)."""
    out = []
    for arg in cmd:
        if arg.startswith("/models/"):
            arg = str(model)
        out.append(_local_path(arg, run_dir).replace("0.0.0.0", ip).replace("127.0.0.1", ip))
    out[0] = str(BIN / out[0])
    return out


def pod_env(container: dict, base: dict[str, str], run_dir: Path) -> dict[str, str]:
    """`base` plus the container's own kvserve settings (KVSERVE_*, plain values): the admin key
    file that the runtime, the agent and the preStop hook read. Secrets and the cache paths of the
    read-only root filesystem are not played here."""
    env = dict(base)
    for var in container.get("env") or []:
        if var["name"].startswith("KVSERVE_") and "value" in var:
            env[var["name"]] = _local_path(var["value"], run_dir)
        ref = (var.get("valueFrom") or {}).get("secretKeyRef") or {}
        if var["name"].startswith("KVSERVE_ADMIN") and (ref.get("name"), ref.get("key")) in DEMO_SECRETS:
            env[var["name"]] = DEMO_SECRETS[(ref["name"], ref["key"])]  # the demo's own Secret
    return env


def run_init_steps(template: dict, ip: str, model: Path, run_dir: Path, env: dict[str, str]) -> None:
    """The pod's init containers that matter on this machine: `kvserve agent admin-token` writes the
    pod's admin token (the fetch step's work is the demo model, already there)."""
    for init in template["spec"].get("initContainers") or []:
        if init["command"][1:3] == ["agent", "admin-token"]:
            subprocess.run(_local(init["command"], ip, model, run_dir), env=env, check=True,
                           stdout=subprocess.DEVNULL, timeout=60)


def is_router(template: dict) -> bool:
    from kvserve.operator import manifests as M

    return M.ROUTER_LABEL in (template["metadata"].get("labels") or {})


def pod_owner(obj: dict) -> str | None:
    """The Deployment a pod object belongs to (router pods: `<name>-router`)."""
    from kvserve.operator import manifests as M

    labels = obj["metadata"].get("labels") or {}
    if labels.get(M.ROUTER_LABEL):
        return labels[M.ROUTER_LABEL] + "-router"
    return labels.get(M.OWNER_LABEL)


def router_command(template: dict, ip: str, model: Path) -> list[str]:
    """The router pod's command (it logs in with the KUBECONFIG the demo points at the emulator,
    as its service account would in a cluster)."""
    return _local(template["spec"]["containers"][0]["command"], ip, model)


def pod_commands(template: dict, ip: str, model: Path, run_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """The runtime and agent commands of the pod template, made to run on this machine."""
    containers = {c["name"]: c for c in template["spec"]["containers"]}

    def local(cmd: list[str]) -> list[str]:
        return _local(cmd, ip, model, run_dir)

    runtime = local(containers["runtime"]["command"])
    agent = local(containers["agent"]["command"])
    if "--host" not in agent:
        agent += ["--host", ip]
    return runtime, agent + ["--interval", "0.5"]


def ports_free(ip: str, ports: list[int]) -> bool:
    import socket

    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind((ip, port))
            except OSError:
                return False
    return True


def probe_ok(ip: str, container: dict, kind: str = "readinessProbe") -> bool:
    """One of the container's probes (httpGet or tcpSocket, named or numbered port), as kubelet
    runs it; a container without that probe passes."""
    import socket

    probe = container.get(kind) or {}
    check = probe.get("httpGet") or probe.get("tcpSocket")
    if check is None:
        return True
    port = check["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    try:
        if "httpGet" in probe:
            with urllib.request.urlopen(f"http://{ip}:{port}{check.get('path', '/')}",
                                        timeout=probe.get("timeoutSeconds", 2)) as r:
                return 200 <= r.status < 400
        with socket.create_connection((ip, port), timeout=probe.get("timeoutSeconds", 2)):
            return True
    except (OSError, ValueError):
        return False


class Kubelet:
    """Plays kubelet + ReplicaSet controller for the demo namespace: Deployment replicas become
    pods made of real processes (a rollout surges one pod and removes an old one only when the
    new one is Ready); a pod object is created Ready once every container's readiness probe
    passes; a container that exits or fails its liveness probe is restarted and the pod is
    unready until its probes pass again; removed pods are drained first, as preStop would."""

    def __init__(self, api: Api, namespace: str, model: Path, logs: Path, kubeconfig: Path | None = None):
        self.api, self.ns, self.model, self.logs = api, namespace, model, logs
        self.kubeconfig = kubeconfig
        self.pods: dict[str, Pod] = {}
        self.starting: dict[str, Pod] = {}
        subnet = random.randint(1, 250)  # a fresh subnet per run: no clash with leftovers
        self.free_ips = [f"127.77.{subnet}.{i}" for i in range(2, 250)]
        self.all_procs: list[subprocess.Popen] = []
        self.terminating: list[threading.Thread] = []
        self.counter = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        self.errors: list[str] = []
        self.notices: list[str] = []
        # Each pod gets one CPU's worth of threads, as its resources.requests.cpu would give it
        # in a cluster; without this, three pods' torch thread pools fight over the same cores.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.router_env = {**self.env, "KUBECONFIG": str(kubeconfig or "")}
        self.prefix = PrefixMeter()

    def start(self) -> Kubelet:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
                self.check_liveness()
            except Exception as e:  # keep playing; the demo shows the effect
                self.errors.append(f"{type(e).__name__}: {e}")
            self.stop.wait(0.3)

    def step(self) -> None:
        from kvserve.operator import manifests as M

        deps = {d["metadata"]["name"]: d
                for d in self.api.items(f"/apis/apps/v1/namespaces/{self.ns}/deployments")}
        objs = self.api.items(f"/api/v1/namespaces/{self.ns}/pods")
        for obj in objs:  # garbage collection of pods whose Deployment is gone
            if pod_owner(obj) not in deps:
                self.delete(obj["metadata"]["name"])
        for name, dep in deps.items():
            want = int(dep["spec"].get("replicas") or 0)
            current = M.template_hash(dep)
            with self.lock:
                mine = [p for p in list(self.pods.values()) + list(self.starting.values())
                        if p.deployment == name]
                starting = bool(self.starting)
            new = [p for p in mine if p.template_hash == current]
            old = [p for p in mine if p.template_hash != current]
            if len(new) < want and len(mine) < want + 1:        # maxSurge 1
                self.create(name, dep["spec"]["template"], current)
            elif old and len(mine) > want and not starting:     # maxUnavailable 0
                self.delete(old[0].name)
            elif len(new) > want and not starting:
                self.delete(sorted(new, key=lambda p: p.name)[-1].name)

    def _spawn(self, pod: Pod, container: str, mode: str = "w") -> None:
        log = open(self.logs / f"{pod.name}-{container}.log", mode)
        proc = subprocess.Popen(pod.commands[container], stdout=log, stderr=subprocess.STDOUT,
                                env=self.router_env if container == "router" else pod.env[container])
        pod.procs[container] = proc
        self.all_procs.append(proc)

    def create(self, dep_name: str, template: dict, template_hash: str) -> None:
        self.counter += 1
        name = f"{dep_name}-{self.counter:02d}"
        ip = self.free_ips.pop(0)
        while not ports_free(ip, [RUNTIME_PORT, AGENT_PORT]):
            ip = self.free_ips.pop(0)
        env: dict[str, dict[str, str]] = {}
        if is_router(template):
            commands = {"router": router_command(template, ip, self.model)}
        else:
            run_dir = self.logs / "pods" / name
            run_init_steps(template, ip, self.model, run_dir, self.env)
            runtime, agent = pod_commands(template, ip, self.model, run_dir)
            commands = {"runtime": runtime, "agent": agent}
            env = {c["name"]: pod_env(c, self.env, run_dir) for c in template["spec"]["containers"]}
        pod = Pod(name, ip, template_hash, dep_name, template, commands, env)
        for container in pod.commands:
            self._spawn(pod, container)
        with self.lock:
            self.starting[name] = pod
        threading.Thread(target=self._become_ready, args=(pod,), daemon=True).start()

    def _probes_pass(self, pod: Pod) -> bool:
        return all(probe_ok(pod.ip, c) for c in pod.template["spec"]["containers"])

    def _become_ready(self, pod: Pod) -> None:
        deadline = time.monotonic() + 180
        try:
            while time.monotonic() < deadline and not self.stop.is_set():
                if any(p.poll() is not None for p in pod.procs.values()):
                    self.errors.append(f"{pod.name}: a container exited while starting; see {self.logs}")
                    break
                if self._probes_pass(pod):
                    obj = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": pod.name, "namespace": self.ns,
                                        **copy.deepcopy(pod.template["metadata"])},
                           "spec": pod.template["spec"],
                           "status": {"phase": "Running", "podIP": pod.ip,
                                      "conditions": [{"type": "Ready", "status": "True"}]}}
                    self.api.call("POST", f"/api/v1/namespaces/{self.ns}/pods", obj)
                    with self.lock:
                        if self.starting.pop(pod.name, None) is not None:
                            pod.ready = True
                            self.pods[pod.name] = pod
                            return
                    break  # deleted while starting
                time.sleep(0.3)
        except Exception as e:  # never leave a pod half-started
            self.errors.append(f"{pod.name}: {type(e).__name__}: {e}")
        with self.lock:
            self.starting.pop(pod.name, None)
        self._kill(pod)

    def _set_ready(self, pod: Pod, ready: bool) -> None:
        pod.ready = ready
        self.api.call("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{pod.name}/status",
                      {"status": {"conditions": [{"type": "Ready", "status": str(ready)}]}},
                      "application/merge-patch+json")

    def check_liveness(self) -> None:
        """Exited containers restart at once; a failing liveness probe restarts after
        failureThreshold consecutive failures, one probe per periodSeconds."""
        now = time.monotonic()
        with self.lock:
            pods = list(self.pods.values())
        for pod in pods:
            for c in pod.template["spec"]["containers"]:
                name, probe = c["name"], c.get("livenessProbe") or {}
                exited = pod.procs[name].poll() is not None
                if not exited:
                    if not probe or now - pod.probed_at.get(name, 0.0) < probe.get("periodSeconds", 10):
                        continue
                    pod.probed_at[name] = now
                    alive = probe_ok(pod.ip, c, "livenessProbe")
                    pod.failures[name] = 0 if alive else pod.failures.get(name, 0) + 1
                    if pod.failures[name] < probe.get("failureThreshold", 3):
                        continue
                self.restart(pod, name, "exited" if exited else "failed its liveness probe")

    def restart(self, pod: Pod, container: str, why: str) -> None:
        self.notices.append(f"{time.strftime('%H:%M:%S')} pod {pod.name}: container {container} "
                            f"{why}; restarted (see {pod.name}-{container}.log)")
        if pod.ready:
            self._set_ready(pod, False)
        proc = pod.procs[container]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pod.failures[container] = 0
        self._spawn(pod, container, mode="a")

        def ready_again():
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not self.stop.is_set() and pod.name in self.pods:
                if self._probes_pass(pod):
                    try:
                        self._set_ready(pod, True)
                    except RuntimeError as e:
                        self.errors.append(f"{pod.name}: {e}")
                    return
                time.sleep(0.5)

        threading.Thread(target=ready_again, daemon=True).start()

    def delete(self, name: str) -> None:
        self.api.call("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}")
        with self.lock:
            pod = self.pods.pop(name, None) or self.starting.pop(name, None)
        if pod is not None:
            pod.ready = False
            t = threading.Thread(target=self._terminate, args=(pod,), daemon=True)
            t.start()
            self.terminating.append(t)

    def _terminate(self, pod: Pod) -> None:
        # preStop: the agent drains the engine (in-flight requests finish), then SIGTERM.
        if "agent" in pod.commands:
            self.prefix.sample(pod)  # its prefix-cache counters, before they go with it
            try:
                # In the agent container: its environment carries the pod's admin key file.
                done = subprocess.run([str(BIN / "kvserve"), "agent", "drain", "--agent-url",
                                       f"http://{pod.ip}:{AGENT_PORT}", "--timeout", "20"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=30,
                                      env=pod.env.get("agent", self.env))
                if done.returncode != 0:  # SIGTERM still drains; say why preStop did not
                    self.notices.append(f"{time.strftime('%H:%M:%S')} pod {pod.name}: preStop drain "
                                        f"exited {done.returncode}: {done.stderr.strip()[-300:]}")
            except subprocess.TimeoutExpired:
                pass
            self.prefix.sample(pod)
        self._kill(pod)

    @staticmethod
    def _kill(pod: Pod) -> None:
        procs = list(pod.procs.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def ready_ips(self) -> list[str]:
        """Ready runtime pods."""
        with self.lock:
            return [p.ip for p in self.pods.values() if p.ready and "runtime" in p.commands]

    def router_ips(self) -> list[str]:
        """Ready router pods: what the Service points at with spec.router."""
        with self.lock:
            return [p.ip for p in self.pods.values() if p.ready and "router" in p.commands]

    def runtime_pods(self) -> list[Pod]:
        with self.lock:
            return [p for p in self.pods.values() if "runtime" in p.commands]

    def shutdown(self) -> None:
        self.stop.set()
        self.thread.join(10)
        with self.lock:
            pods = list(self.pods.values()) + list(self.starting.values())
            self.pods.clear()
            self.starting.clear()
        for pod in pods:
            self._kill(pod)
        for t in self.terminating:
            t.join(40)
        # Whatever is still running (a drain that hung, a pod that never became ready): stop it.
        leftovers = [p for p in self.all_procs if p.poll() is None]
        self._kill(Pod("all", "", "", procs={str(i): p for i, p in enumerate(leftovers)}))


class Operator:
    """The real operator: the `kvserve-operator run` console script in its own process, logging in
    with a KUBECONFIG that points at the emulator, serving one namespace and its liveness
    endpoint, exactly as in a pod (`--standalone`: one instance, no peering object)."""

    def __init__(self, api_url: str, namespace: str, logs: Path):
        import socket

        with socket.socket() as sock, socket.socket() as metrics_sock:
            sock.bind(("127.0.0.1", 0))
            self.liveness = f"http://127.0.0.1:{sock.getsockname()[1]}/healthz"
            # Not the default 8082: a second demo or a local operator may hold it.
            metrics_sock.bind(("", 0))
            self.metrics_port = metrics_sock.getsockname()[1]
        kubeconfig = WORK / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": api_url}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "demo"}}],
            "users": [{"name": "demo", "user": {"token": "demo"}}]}))
        self.cmd = [str(BIN / "kvserve-operator"), "run", "--namespace", namespace, "--standalone",
                    "--scrape-interval", "1", "--wake-interval", "1", "--liveness", self.liveness,
                    "--metrics-port", str(self.metrics_port)]
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.log = logs / "operator.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Operator:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)

        def alive():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve-operator exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.liveness, timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait(alive, 60, "the operator's liveness endpoint")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # kopf stops its handlers and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the load --------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str = ""
    retries: int = 0


SYSTEM = "You are a helpful assistant. Answer questions about cats, dogs, the weather and numbers."
PROMPTS = ["The cat sat on the mat and watched the dog", "Tokens are merged into words and words",
           "Café, naïve, résumé: multi-byte text must survive", "def add(a, b): return a + b",
           "Stories about cats and dogs, told one token at a time"]


async def one_turn(session, router_ips, model_name: str, messages: list[dict], max_tokens: int,
                   seed: int) -> tuple[Result, str]:
    """One streaming chat completion through the Service (a ready router pod)."""
    import aiohttp

    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.8, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    err = "no ready router pod"
    # The router retries on another pod itself; the client only waits out a Service with no
    # ready router pod (the router starting), for up to a minute.
    deadline = time.monotonic() + 60
    retries = -1
    while time.monotonic() < deadline:
        ips = router_ips()  # the Service's endpoints now
        if not ips:
            await asyncio.sleep(0.5)
            continue
        retries += 1
        start = time.perf_counter()
        first = last = None
        tokens = 0
        text = []
        try:
            async with session.post(f"http://{random.choice(ips)}:{RUNTIME_PORT}/v1/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=300)) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        if (choice.get("delta") or {}).get("content"):
                            text.append(choice["delta"]["content"])
                            last = time.perf_counter()
                            first = first or last
            ttft = first - start if first else None
            tpot = (last - first) / (tokens - 1) if first and tokens > 1 else None
            return Result(True, ttft, tpot, tokens, retries=retries), "".join(text)
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.5)
    return Result(False, error=err, retries=max(retries, 0)), ""


async def conversations(kubelet: Kubelet, model_name: str, n: int, turns: int, concurrency: int,
                        max_tokens: int, status_line) -> tuple[list[Result], float]:
    """`n` chats of `turns` turns, `concurrency` at a time: each turn sends the whole history,
    which the pod that served the previous turn has in its prefix cache."""
    import aiohttp
    from tqdm import tqdm

    results: list[Result] = []
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=n * turns, desc="    requests", unit="req", ncols=100, file=sys.stdout,
               bar_format="{desc} {bar} {n_fmt}/{total_fmt} {postfix}")

    async def chat(c: int):
        async with sem:
            messages = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"{PROMPTS[(c + t) % len(PROMPTS)]} ({c}.{t})"})
                res, answer = await one_turn(session, kubelet.router_ips, model_name, messages, max_tokens,
                                             seed=c * 100 + t)
                results.append(res)
                bar.update(1)
                if not res.ok:
                    bar.update(turns - t - 1)
                    return
                messages.append({"role": "assistant", "content": answer})

    async def refresh():
        while True:
            bar.set_postfix_str(status_line(), refresh=True)
            kubelet.prefix.sample_all(kubelet.runtime_pods())
            await asyncio.sleep(0.5)

    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        ticker = asyncio.create_task(refresh())
        await asyncio.gather(*(chat(c) for c in range(n)))
        ticker.cancel()
    kubelet.prefix.sample_all(kubelet.runtime_pods())
    bar.set_postfix_str(status_line())
    bar.close()
    return results, time.perf_counter() - start


class PrefixMeter:
    """vllm:prefix_cache_{hits,queries} of every runtime pod, last value seen per pod: pods come
    and go with scaling, so each is read while it lives (and once more before it is drained)."""

    def __init__(self):
        self.last: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def sample(self, pod: Pod) -> None:
        try:
            with urllib.request.urlopen(f"http://{pod.ip}:{RUNTIME_PORT}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return
        from prometheus_client.parser import text_string_to_metric_families

        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        with self.lock:
            self.last[pod.name] = (values.get("vllm:prefix_cache_hits_total", 0.0),
                                   values.get("vllm:prefix_cache_queries_total", 0.0))

    def sample_all(self, pods: list[Pod]) -> None:
        for pod in pods:
            self.sample(pod)

    def totals(self) -> tuple[float, float]:
        with self.lock:
            return sum(h for h, _ in self.last.values()), sum(q for _, q in self.last.values())


def router_endpoints(kubelet: Kubelet) -> int | None:
    """Ready runtime pods as the routers see them (their /ready), or None when no router answers."""
    counts = []
    for ip in kubelet.router_ips():
        try:
            with urllib.request.urlopen(f"http://{ip}:{RUNTIME_PORT}/ready", timeout=2) as r:
                counts.append(int(json.loads(r.read()).get("ready_endpoints", 0)))
        except (OSError, ValueError):
            continue
    return max(counts) if counts else None


def router_view(kubelet: Kubelet) -> dict[str, float]:
    """The router's own counters (kvserve_router_*), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for ip in kubelet.router_ips():
        try:
            with urllib.request.urlopen(f"http://{ip}:{RUNTIME_PORT}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvserve_router_requests_total":
                    out[s.labels["decision"]] = out.get(s.labels["decision"], 0) + s.value
                elif s.name == "kvserve_router_retries_total":
                    out["retries"] = out.get("retries", 0) + s.value
    return out


# --- status and summary ----------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    from kvserve.testing.router_harness import percentile

    return percentile(values, q)


def describe(d: dict) -> str:
    """A decision's move: replicas and TP, or a pod layout changed in place (devicesPerPod)."""
    if "toLayout" in d:
        return f"layout {d['fromLayout']} -> {d['toLayout']} (in place)"
    return (f"replicas {d['fromReplicas']} -> {d['toReplicas']}, TP "
            f"{d['fromTensorParallelSize']} -> {d['toTensorParallelSize']}")


class Watcher:
    """Prints each new autoscaling decision from the resource's status as it appears."""

    def __init__(self, api: Api, path: str):
        self.api, self.path = api, path
        self.seen: set[str] = set()
        self.decisions: list[dict] = []
        self.max_replicas = 0
        self.obj: dict = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tqdm import tqdm

        while not self.stop.is_set():
            obj = self.api.call("GET", self.path) or {}
            self.obj = obj
            st = obj.get("status") or {}
            self.max_replicas = max(self.max_replicas, st.get("readyReplicas") or 0)
            for d in st.get("decisions") or []:
                key = json.dumps(d, sort_keys=True)
                if key not in self.seen:
                    self.seen.add(key)
                    self.decisions.append(d)
                    tqdm.write(f"    \033[33mdecision\033[0m {d['time']}: {describe(d)}: "
                               f"{d['reason']} ({d.get('message', '')[:90]})", file=sys.stdout)
            self.stop.wait(0.5)

    def line(self) -> str:
        st = self.obj.get("status") or {}
        layout = st.get("layout") or {}
        shape = (f"{layout['dataParallel']}xTP{layout['tensorParallel']}" if layout
                 else f"TP {st.get('tensorParallelSize', '?')}")
        return (f"ready {st.get('readyReplicas', 0)}/{st.get('desiredReplicas', '?')} "
                f"{shape} KV {st.get('kvCacheUtilizationPercent', '-')}% "
                f"queue {st.get('queueDepth', '-')}")


def idle_until_zero(watcher: Watcher, kubelet: Kubelet, timeout: float) -> bool:
    """A bar of idle seconds, with the live status, until the service is scaled to zero."""
    from tqdm import tqdm

    bar = tqdm(total=int(timeout), desc="    idle", unit="s", ncols=100, file=sys.stdout,
               bar_format="{desc} {bar} {n_fmt}s {postfix}")
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            st = watcher.obj.get("status") or {}
            bar.n = int(time.monotonic() - start)
            bar.set_postfix_str(watcher.line(), refresh=True)
            # Zero for a client only once the router knows it too: its pod watch can trail the
            # kubelet by a moment, and a request sent then is served by the draining pod, not held.
            if st.get("desiredReplicas") == 0 and not kubelet.ready_ips() and router_endpoints(kubelet) == 0:
                return True
            time.sleep(0.5)
        return False
    finally:
        bar.close()


def wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def summary(results: list[Result], duration: float, watcher: Watcher, events: list[dict],
            kubelet_notices: list[str], prefix: tuple[float, float], routed: dict[str, float],
            zero: dict[str, float | None]) -> None:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.tokens for r in ok)
    hits, queries = prefix
    decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(routed.items()) if k != "retries") or "none"
    slept, woke = zero.get("slept_after"), zero.get("woke_in")
    header("8/8", "Summary")
    rows = [
        ("requests", f"{len(ok)} ok, {len(results) - len(ok)} failed, "
                     f"{sum(r.retries for r in results)} client retries, "
                     f"{routed.get('retries', 0):.0f} router retries"),
        ("prefix-cache hit rate", f"{100 * hits / queries:.0f}% of {queries:.0f} prompt tokens (vllm:prefix_cache_* "
                                  f"summed over pods)" if queries else "n/a"),
        ("router decisions", decisions),
        ("scale to zero", f"after {slept:.0f} s idle" if slept is not None else "did not happen"),
        ("wake from zero", f"held request answered after {woke:.1f} s (pod start included)"
                           if woke is not None else "did not happen"),
        ("burst duration", f"{duration:.1f} s"),
        ("output throughput", f"{tokens / duration:.1f} tokens/s ({len(ok) / duration:.2f} req/s)"),
        ("TTFT p50 / p99", f"{1000 * pct(ttft, 0.5):.0f} ms / {1000 * pct(ttft, 0.99):.0f} ms"),
        ("TPOT p50 / p99", f"{1000 * pct(tpot, 0.5):.1f} ms / {1000 * pct(tpot, 0.99):.1f} ms"),
        ("most ready replicas", str(watcher.max_replicas)),
        ("layout changes", reshape_line(events)),
        ("Events posted", f"{len(events)}: " + ", ".join(
            f"{reason} {n}" for reason, n in sorted(collections.Counter(e.get("reason", "") for e in events).items()))),
    ]
    for k, v in rows:
        say(f"    {k:<22} {v}")
    failed = [r.error for r in results if not r.ok]
    if failed:
        say(f"    first failure: {failed[0]}")
    say("    autoscaling decisions (status.decisions, newest last):")
    for d in watcher.decisions:
        sig = d.get("signals") or {}
        say(f"      {d['time']}  {describe(d)}  {d['reason']}: "
            f"{d.get('message', '')}  [pods {sig.get('pods')}, KV {sig.get('kvCacheUtilization')}, "
            f"queue {sig.get('queueDepth')}]")
    if not watcher.decisions:
        say("      (none)")
    if kubelet_notices:
        say("    the emulated kubelet (container restarts, failed preStop drains):")
        for n in kubelet_notices:
            say(f"      {n}")
    say("    Events (kubectl get events):")
    for e in sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")[-12:]:
        say(f"      {e.get('type', ''):<8} {e.get('reason', ''):<16} {(e.get('message') or '')[:100]}")


def reshape_line(events: list[dict]) -> str:
    """The in-place layout changes (ReshapedInPlace Events) with their durations."""
    import re

    done = [e.get("message") or "" for e in events if e.get("reason") == "ReshapedInPlace"]
    if not done:
        return "none"
    moves = [m.group(1) for e in done if (m := re.search(r": (\S+ -> \S+ in [\d.]+s)", e))]
    return f"{len(done)} in place, no pod restarted: " + ", ".join(moves[:6]) + (" ..." if len(moves) > 6 else "")


def rbac_report(emulator) -> set:
    """Every API call the operator made in this run, checked against manifests/base's RBAC."""
    import rbac_audit

    rules = next(d for d in yaml.safe_load_all((ROOT / "manifests/base/rbac.yaml").read_text())
                 if d["kind"] == "ClusterRole")["rules"]
    used = rbac_audit.from_kmock(list(emulator.emulator))  # kmock: iterating gives its request log
    denied, unused = rbac_audit.audit(used, rules)
    kinds = sorted({f"{v} {r}" for v, g, r in set(used)})
    say(f"    RBAC audit: {len(used)} operator API calls ({', '.join(kinds)}); "
        + ("all allowed by manifests/base/rbac.yaml" if not denied
           else f"\033[31mDENIED by manifests/base/rbac.yaml: {sorted(denied)}\033[0m"))
    from kvserve.operator.router import ROUTER_RULES

    routed = rbac_audit.from_kmock(list(emulator.emulator), agents=("kvserve-router",))
    router_denied, _ = rbac_audit.audit(routed, ROUTER_RULES)
    say(f"    RBAC audit: {len(routed)} router API calls ({', '.join(sorted({f'{v} {r}' for v, g, r in set(routed)}))}); "
        + ("all allowed by the router's Role (get/list/watch pods)" if not router_denied
           else f"\033[31mDENIED by the router's Role: {sorted(router_denied)}\033[0m"))
    return denied | router_denied


# --- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32, help="chats in the burst")
    parser.add_argument("--turns", type=int, default=3, help="turns per chat (each resends the history)")
    parser.add_argument("--concurrency", type=int, default=16, help="chats at a time")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scale-down-timeout", type=float, default=150,
                        help="seconds to wait, idle, for the scale to zero")
    args = parser.parse_args(argv)

    WORK.mkdir(parents=True, exist_ok=True)
    logs = WORK / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    say("\033[1mkvserve demo\033[0m: runtime, agent, router and operator for real; the Kubernetes API, "
        "kubelet and Service emulated on this machine (see scripts/demo.py). Logs: " + str(logs))

    header("1/8", "Demo model")
    model = demo_model()

    header("2/8", "Kubernetes API: EMULATED (kmock KubernetesEmulator, in this process)")
    from kvserve.testing.kube_emulator import EmulatorThread

    emulator = EmulatorThread().start()
    api = emulator_api(emulator.url)
    say(f"    API server at {emulator.url}; pods will be local processes on 127.77.x.N")

    operator = kubelet = watcher = None
    cleaned = False
    results: list[Result] = []
    duration = 0.0
    zero: dict[str, float | None] = {"slept_after": None, "woke_in": None}
    prefix, routed = (0.0, 0.0), {}
    try:
        header("3/8", "Operator: REAL (kvserve-operator run, KUBECONFIG pointing at the emulator)")
        isvc = yaml.safe_load(EXAMPLE.read_text())
        ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        operator = Operator(emulator.url, ns, logs).start()
        kubelet = Kubelet(api, ns, model, logs, kubeconfig=WORK / "kubeconfig").start()
        say(f"    $ {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(operator.cmd))}")
        say(f"    operator live ({operator.liveness} answers); the kubelet emulation watches Deployments")

        header("4/8", f"Apply {EXAMPLE.relative_to(ROOT)} (with demo overrides: the router, scale to zero)")
        isvc["spec"]["model"]["uri"] = str(model)
        for section, values in DEMO_SPEC.items():
            for k, v in values.items():
                if v is None:
                    isvc["spec"].setdefault(section, {}).pop(k, None)
                else:
                    isvc["spec"].setdefault(section, {})[k] = v
        say(f"    spec.model.uri: {model} (instead of {yaml.safe_load(EXAMPLE.read_text())['spec']['model']['uri']})")
        say(f"    overrides: {json.dumps(DEMO_SPEC, separators=(',', ':'))}")
        path = f"/apis/kvserve.dev/v1alpha1/namespaces/{ns}/inferenceservices"
        for (secret, key), value in DEMO_SECRETS.items():
            api.call("POST", f"/api/v1/namespaces/{ns}/secrets",
                     {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
                      "data": {key: base64.b64encode(value.encode()).decode()}})
        say(f"    Secret {', '.join(n for n, _ in DEMO_SECRETS)}: the admin key for in-place layout changes")
        api.call("POST", path, isvc)
        watcher = Watcher(api, f"{path}/{name}")
        watcher.thread.start()
        dep = wait(lambda: api.call("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
                   30, "the operator's Deployment")
        say(f"    operator made Deployment {name} (replicas {dep['spec']['replicas']}), Service, "
            f"PodDisruptionBudget, and the router: Deployment, ServiceAccount, Role, RoleBinding {name}-router; "
            f"the Service points at the router")
        t0 = time.monotonic()
        wait(lambda: (watcher.obj.get("status") or {}).get("readyReplicas"), 120, "a ready pod")
        wait(kubelet.router_ips, 60, "a ready router pod")
        say(f"    runtime pod and router pod ready after {time.monotonic() - t0:.1f}s: {watcher.line()}")
        # devicesPerPod 2: quiet, the operator gives the pod the latency layout, in place; the
        # burst below takes it back to the throughput layout while requests stream.
        t0 = time.monotonic()
        try:
            wait(lambda: ((watcher.obj.get("status") or {}).get("layout") or {}).get("tensorParallel") == 2
                 and any(e.get("reason") == "ReshapedInPlace" for e in api.items(f"/api/v1/namespaces/{ns}/events")),
                 60, "the quiet pod's layout change")
            say(f"    quiet: the pod went to the latency layout in place after {time.monotonic() - t0:.1f}s: "
                f"{watcher.line()}")
        except RuntimeError as e:
            say(f"    {e} ({watcher.line()})")

        header("5/8", f"Burst: {args.conversations} chats x {args.turns} turns, {args.concurrency} at a time, "
                      f"through the router (each turn resends the history)")
        served = isvc["spec"]["model"]["servedName"]
        results, duration = asyncio.run(conversations(kubelet, served, args.conversations, args.turns,
                                                      args.concurrency, args.max_tokens, watcher.line))
        hits, queries = kubelet.prefix.totals()
        say(f"    burst done in {duration:.1f}s; prefix-cache hit rate over the pods: "
            + (f"{100 * hits / queries:.0f}% of prompt tokens" if queries else "n/a"))

        header("6/8", f"Idle: scale to zero after {DEMO_SPEC['autoscaling']['scaleToZeroAfterSeconds']}s without "
                      f"a request (the router's /router/demand tells the operator)")
        t0 = time.monotonic()
        if idle_until_zero(watcher, kubelet, args.scale_down_timeout):
            zero["slept_after"] = time.monotonic() - t0
            say(f"    scaled to zero after {zero['slept_after']:.1f}s idle: {watcher.line()}; the router still "
                f"answers")
        else:
            say(f"    not scaled to zero after {args.scale_down_timeout:.0f}s idle ({watcher.line()})")

        header("7/8", "A request while at zero: the router holds it, the operator wakes the service")
        if zero["slept_after"] is not None:
            t0 = time.perf_counter()

            async def wake_request():
                import aiohttp

                async with aiohttp.ClientSession() as session:
                    messages = [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "Wake up: " + PROMPTS[0]}]
                    return await one_turn(session, kubelet.router_ips, served, messages, 16, seed=7)

            woke, _ = asyncio.run(wake_request())
            results.append(woke)
            if woke.ok:
                zero["woke_in"] = time.perf_counter() - t0
                say(f"    held request answered after {zero['woke_in']:.1f}s (operator wake, pod start, router "
                    f"release): {watcher.line()}")
            else:
                say(f"    the held request failed: {woke.error}")
        kubelet.prefix.sample_all(kubelet.runtime_pods())
        prefix, routed = kubelet.prefix.totals(), router_view(kubelet)
        events = api.items(f"/api/v1/namespaces/{ns}/events")
        watcher.stop.set()
        summary(results, duration, watcher, events, kubelet.notices, prefix, routed, zero)

        say("\n    shutting down: deleting the InferenceService (the operator removes what it made)...")
        api.call("DELETE", f"{path}/{name}")
        try:
            wait(lambda: api.call("GET", f"{path}/{name}") is None
                 and not api.items(f"/api/v1/namespaces/{ns}/pods"), 90,
                 "the resource and its pods to go")
            say("    deleted; pods stopped")
            cleaned = True
        except RuntimeError as e:
            left = api.call("GET", f"{path}/{name}")
            pods = [p["metadata"]["name"] for p in api.items(f"/api/v1/namespaces/{ns}/pods")]
            say(f"    {e}: resource {'gone' if left is None else left['metadata']}; pods left {pods}; "
                f"kubelet errors {kubelet.errors[-3:]}")
    finally:
        if watcher is not None:
            watcher.stop.set()
        if kubelet is not None:
            kubelet.shutdown()
            for err in kubelet.errors[:5]:
                say(f"    kubelet: {err}")
        if operator is not None:
            operator.stop()
        emulator.stop()
    denied = rbac_report(emulator)
    ok = (results and all(r.ok for r in results) and watcher is not None and watcher.max_replicas > 1
          and zero["slept_after"] is not None and zero["woke_in"] is not None and not denied and cleaned)
    say("\n\033[1mdone\033[0m" + ("" if ok else " (with problems: see above and the logs)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
