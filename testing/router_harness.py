"""Real pieces for router tests and the routing benchmark: runtime processes as "pods" on their own
loopback addresses, Pod objects for them in the Kubernetes API emulator, `kvserve router`
processes watching that API, and a multi-turn chat workload through the official openai client.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.testing.e2e_harness import free_port_on_all, wait_for  # noqa: F401  (tests and benches import wait_for from here)
from kvserve.testing.kube_emulator import EmulatorThread

KVSERVE = str(Path(sys.executable).parent / "kvserve")
NAMESPACE = "default"


def get_json(url: str, timeout: float = 5.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def scrape(url: str) -> dict[str, float]:
    """sample name{labels} -> value, from a /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@dataclass
class RuntimePod:
    name: str
    ip: str
    port: int
    proc: subprocess.Popen | None = None  # a process of its own, or
    thread: Any = None  # an in-process kvserve.runtime.server.main.ServerThread (cheaper to start)
    annotations: dict[str, str] = field(default_factory=dict)  # on its Pod object

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else self.thread.exit_code is None


_taken_ports: set[int] = set()


def free_port_pair() -> int:
    """A port p, with p + 1, free on every interface (a KV events publisher and its replay socket),
    never handed out twice in this process."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
        if port + 1 > 65535 or {port, port + 1} & _taken_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        _taken_ports.update((port, port + 1))
        return port
    raise RuntimeError("no free port pair")


class RuntimePods:
    """`kvserve serve` runtimes, one per loopback address, all on the same port: each a process of
    its own, or (names in `in_process`) a server thread of the test process, which skips a torch
    import per pod on a busy machine."""

    def __init__(self, model: Path, ips: list[str], *, extra: dict[str, list[str]] | None = None,
                 args: list[str] = (), logs: Path | None = None, threads: int = 1, in_process: set[str] = frozenset(),
                 served_name: str = "tiny", port: int | None = None, prefix: str = "tiny", kv_events: bool = False):
        """`kv_events`: every pod publishes KV events on a port pair of its own (the publisher binds
        every interface), named on its Pod by the kvserve.dev/kv-events-port annotation."""
        self.model, self.ips, self.logs = model, ips, logs
        self.port = port or free_port_on_all(ips)
        self.pods: dict[str, RuntimePod] = {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        for i, ip in enumerate(ips):
            name = f"{prefix}-{chr(ord('a') + i)}"
            argv = [str(model), "--host", ip, "--port", str(self.port), "--served-model-name", served_name, *args,
                    *((extra or {}).get(name, []))]
            annotations = {}
            if kv_events:
                events = free_port_pair()
                argv += ["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                    "replay_endpoint": f"tcp://*:{events + 1}"})]
                annotations["kvserve.dev/kv-events-port"] = str(events)
            if name in in_process:
                from kvserve.runtime.server.main import ServerThread

                self.pods[name] = RuntimePod(name, ip, self.port, thread=ServerThread(argv).start(),
                                             annotations=annotations)
                continue
            out = open(logs / f"{name}.log", "w") if logs else subprocess.DEVNULL
            self.pods[name] = RuntimePod(name, ip, self.port, proc=subprocess.Popen(
                [KVSERVE, "serve", *argv], stdout=out, stderr=subprocess.STDOUT, env=env), annotations=annotations)

    def wait_ready(self, timeout: float = 180) -> RuntimePods:
        for pod in self.pods.values():
            def ready(pod=pod):
                if not pod.alive():
                    raise AssertionError(f"{pod.name} exited")
                try:
                    with urllib.request.urlopen(pod.url + "/ready", timeout=2) as r:
                        return r.status == 200
                except OSError:
                    return False
            wait_for(ready, timeout, f"{pod.name} ready")
        return self

    def kill(self, name: str) -> None:
        proc = self.pods[name].proc
        assert proc is not None, "only a pod with a process of its own can be killed"
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        procs = [p.proc for p in self.pods.values() if p.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for pod in self.pods.values():
            if pod.thread is not None:
                pod.thread.stop()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def prefix_counters(self) -> tuple[float, float]:
        """(hits, queries) summed over every live pod's vllm:prefix_cache_* counters."""
        hits = queries = 0.0
        for pod in self.pods.values():
            if not pod.alive():
                continue
            m = scrape(pod.url)
            hits += m.get("vllm:prefix_cache_hits_total", 0.0)
            queries += m.get("vllm:prefix_cache_queries_total", 0.0)
        return hits, queries


class Cluster:
    """The Kubernetes API emulator, with Pod objects the test makes Ready or removes."""

    def __init__(self, work: Path, service: str = "tiny"):
        import yaml

        self.service = service
        self.emulator = EmulatorThread().start()
        self.url = self.emulator.url
        self.kubeconfig = work / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
            "users": [{"name": "test", "user": {"token": "test"}}]}))

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def pods(self) -> list[str]:
        items = (self._call("GET", f"/api/v1/namespaces/{NAMESPACE}/pods") or {}).get("items", [])
        return sorted(p["metadata"]["name"] for p in items)

    def set_pods(self, pods: list[RuntimePod]) -> None:
        """Exactly these pods exist and are Ready (what the kubelet and endpoints controller show)."""
        from kvserve.runtime.router.endpoints import inferenceservice_selector

        want = {p.name: p for p in pods}
        for name in self.pods():
            if name not in want:
                self._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        have = set(self.pods())
        for name, pod in want.items():
            if name in have:
                continue
            self._call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NAMESPACE, "annotations": dict(pod.annotations),
                             "labels": {**inferenceservice_selector(self.service), "app.kubernetes.io/name": "kvserve"}},
                "spec": {"containers": [{"name": "runtime", "image": "kvserve"}]},
                "status": {"phase": "Running", "podIP": pod.ip,
                           "conditions": [{"type": "Ready", "status": "True"}]}})

    def stop(self) -> None:
        self.emulator.stop()


class RouterProcess:
    """`kvserve router` watching the emulator (or fixed endpoints), on 127.0.0.1:<free port>."""

    def __init__(self, *args: str, cluster: Cluster | None = None, log: Path | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if cluster is not None:
            env["KUBECONFIG"] = str(cluster.kubeconfig)
            args = ("--namespace", NAMESPACE, *args)
        self.cmd = [KVSERVE, "router", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = log
        self.proc = subprocess.Popen(self.cmd, stdout=open(log, "w") if log else subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def demand(self) -> dict:
        return get_json(self.url + "/router/demand") or {}

    def wait_ready(self, endpoints: int | None = None, timeout: float = 30) -> RouterProcess:
        def ok():
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited with {self.proc.returncode}"
                                     + (f": {self.log.read_text()[-2000:]}" if self.log else ""))
            d = self.demand()
            return d.get("synced") and (endpoints is None or d.get("ready_endpoints") == endpoints)
        wait_for(ok, timeout, f"router ready with {endpoints} endpoints")
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the multi-turn chat workload ------------------------------------------------------------

WORDS = ("cache prefix token block router replica latency stream request model kernel tensor batch queue "
         "memory paged attention decode prefill operator service scale signal agent cluster node pod").split()


@dataclass
class Turn:
    conversation: int
    turn: int
    ok: bool
    ttft: float | None = None
    latency: float = 0.0
    tokens: int = 0
    error: str = ""
    text: str = ""  # the answer, which goes back into the conversation's history
    streamed: bool = False  # the client received content before the end (or the failure)


@dataclass
class Workload:
    conversations: int = 12
    turns: int = 4
    concurrency: int = 6
    user_words: int = 40
    system_words: int = 60
    max_tokens: int = 8
    seed: int = 0
    model: str = "tiny"
    stream: bool = True
    # A user's pause between an answer and the next message (0: the next turn at once, so every
    # conversation in flight keeps the engine saturated). Conversations start spread over one
    # pause, as users do, instead of all at once.
    think_seconds: float = 0.0
    # Each pause drawn from think_seconds x [1 - jitter, 1 + jitter] (seeded). Pauses that are all
    # alike keep the conversations' turns in one fixed order, so a round-robin balancer sends
    # every turn of a conversation to the same pod by accident (turn n of conversation c is
    # request n x conversations + c); real users' pauses differ.
    think_jitter: float = 0.0
    results: list[Turn] = field(default_factory=list)

    def _text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    async def run(self, base_url: str | Sequence[str], timeout: float = 120.0) -> Workload:
        """Conversations in parallel (`concurrency` at a time), each one turn after another: turn
        n+1's request is turn n's messages, its answer and a new user message. Several base URLs
        (router replicas behind a load balancer): turn n goes to base_url[n % len]."""
        import openai

        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=timeout)
                   for u in urls]
        rng = random.Random(self.seed)
        system = f"[{self.seed}] " + self._text(rng, self.system_words)  # shared by this run's conversations
        plans = [[self._text(rng, self.user_words) for _ in range(self.turns)] for _ in range(self.conversations)]
        gate = asyncio.Semaphore(self.concurrency)

        pause_rng = random.Random(f"pauses-{self.seed}")  # its own: the texts stay as they were
        pauses = [[self.think_seconds * (1 + self.think_jitter * (2 * pause_rng.random() - 1))
                   for _ in range(self.turns)] for _ in range(self.conversations)]

        async def conversation(c: int) -> None:
            async with gate:
                if self.think_seconds:
                    await asyncio.sleep(c * self.think_seconds / self.conversations)
                messages = [{"role": "system", "content": system}]
                for t, user in enumerate(plans[c]):
                    if t and self.think_seconds:
                        await asyncio.sleep(pauses[c][t])
                    messages.append({"role": "user", "content": f"conversation {self.seed}.{c} turn {t}: {user}"})
                    result = await self._turn(clients[t % len(clients)], c, t, messages)
                    self.results.append(result)
                    if not result.ok:
                        return
                    messages.append({"role": "assistant", "content": result.text or "ok"})

        try:
            await asyncio.gather(*(conversation(c) for c in range(self.conversations)))
        finally:
            for client in clients:
                await client.close()
        return self

    async def _turn(self, client, c: int, t: int, messages: list[dict]) -> Turn:
        start = time.perf_counter()
        first = None
        text = []
        tokens = 0
        try:
            if self.stream:
                stream = await client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:
                            first = first or time.perf_counter()
                            text.append(choice.delta.content)
            else:
                reply = await client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=0,
                    extra_body={"ignore_eos": True})
                first = time.perf_counter()
                text.append(reply.choices[0].message.content or "")
                tokens = reply.usage.completion_tokens
        except Exception as error:  # the test decides what a failure means
            return Turn(c, t, False, latency=time.perf_counter() - start, error=f"{type(error).__name__}: {error}",
                        streamed=bool(text))
        return Turn(c, t, True, ttft=(first - start) if first else None, latency=time.perf_counter() - start,
                    tokens=tokens, text="".join(text), streamed=bool(text))


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ttft_p50_by_turn(turns: list[Turn]) -> dict[str, float]:
    """Turn number (from 1) -> TTFT p50 of that turn's requests. A cached history is the gain of
    both the KV tier and cache-aware routing, and it grows turn by turn."""
    return {str(t + 1): percentile([r.ttft for r in turns if r.turn == t and r.ttft is not None], 0.5)
            for t in sorted({r.turn for r in turns})}
