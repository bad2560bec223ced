"""`kvserve agent serve`: scrapes the local engine and serves the standardized signals.

The scraper keeps the last good sample and when it was taken. A dead or slow engine never turns
into zeros: the values stay at the last sample and `sample_age_seconds` keeps growing, so the
operator can tell "idle" from "unknown". Before the first good sample, value series are absent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from kvserve.runtime.server.auth import admin_denial
from kvserve.runtime.server.drain import effective_drain_timeout
from kvserve.runtime.server.errors import APIError

from .signals import EngineSample, standardize

log = logging.getLogger("kvserve.agent")

# Readiness route per engine: vLLM and SGLang answer /health only once the model is loaded.
READY_PATHS = {"kvserve": "/ready", "vllm": "/health", "sglang": "/health", "auto": "/ready"}


@dataclass
class AgentConfig:
    engine_url: str = "http://127.0.0.1:8000"
    engine: str = "auto"  # auto | kvserve | vllm | sglang
    host: str = "0.0.0.0"
    port: int = 8081
    interval_s: float = 1.0
    scrape_timeout_s: float = 2.0
    stale_after_s: float = 5.0
    drain_timeout_s: float = 30.0
    admin_api_key: str | None = None  # required on POST /drain and sent on to the runtime; None: 403
    tensor_parallel_size: int | None = None  # for engines that do not export it (vLLM, SGLang)
    model_dir: str | None = None  # the pod's model directory: its config goes into /v1/signals
    model_retry_s: float = 5.0  # how often to look again while the directory holds no model yet
    # LoRA adapters (runtime/agent/adapters.py): the desired list [{name, uri}] and where to fetch
    # them (a path the runtime sees at the same place). None: the agent manages no adapters.
    adapters_file: str | None = None
    adapters_dir: str = "/adapters"
    # The key sent to the engine's LoRA routes instead of the admin key: vLLM knows no admin key
    # and guards them with its user API key. None: the admin key.
    engine_api_key: str | None = None


@dataclass
class ScrapeState:
    """What the agent knows about the engine; `now` is time.monotonic()."""

    started_at: float
    sample: EngineSample | None = None
    sampled_at: float | None = None
    sample_requested_at: float | None = None  # when the sample's /metrics request was sent
    up: bool = False
    ready: bool = False
    last_error: str | None = None
    scrapes: int = 0
    failures: int = 0
    model: dict | None = None  # model_info.describe() of the model directory, once read
    model_error: str | None = None

    def age(self, now: float) -> float:
        return now - (self.sampled_at if self.sampled_at is not None else self.started_at)


def signals_json(state: ScrapeState, config: AgentConfig, now: float, adapters: dict | None = None) -> dict:
    """The operator's view (docs/architecture.md); value fields are null before any sample."""
    sample = state.sample
    age = state.age(now)
    tp = sample.tensor_parallel_size if sample else None
    if tp is None:
        tp = config.tensor_parallel_size
    if tp is None and sample is not None:
        tp = 1

    def val(name: str, cast=float):
        v = getattr(sample, name) if sample else None
        return None if v is None else cast(v)

    return {
        "engine": sample.engine if sample else (config.engine if config.engine != "auto" else None),
        "ready": state.ready and state.up,
        "stale": sample is None or not state.up or age > config.stale_after_s,
        "sample_age_seconds": round(age, 3),
        "kv_cache_utilization": val("kv_cache_utilization"),
        "queue_depth": val("queue_depth", int),
        "requests_running": val("requests_running", int),
        "kv_cache_capacity_tokens": val("kv_cache_capacity_tokens", int),
        "tensor_parallel_size": None if tp is None else int(tp),
        "data_parallel_size": val("data_parallel_size", int),
        "prompt_tokens_total": val("prompt_tokens_total", int),
        "generation_tokens_total": val("generation_tokens_total", int),
        "inter_token_latency_seconds_sum": val("inter_token_latency_seconds_sum"),
        "inter_token_latency_seconds_count": val("inter_token_latency_seconds_count", int),
        "model_name": sample.model_name if sample else None,
        "lora_adapters": list(sample.lora_adapters) if sample and sample.lora_adapters is not None else None,
        "engine_up": state.up,
        "last_error": state.last_error,
        "model": state.model,
        "model_error": state.model_error,
        "adapters": adapters,
    }


class _SignalsCollector:
    """Renders the state at scrape time so the age is current even if the scraper is stuck."""

    def __init__(self, agent: Agent):
        self.agent = agent

    def collect(self):
        s = self.agent.signals()
        g = GaugeMetricFamily
        yield g("kvserve_engine_up", "1 if the last scrape of the engine succeeded.", value=int(s["engine_up"]))
        yield g(
            "kvserve_engine_sample_age_seconds",
            "Seconds since the last good engine sample (since agent start before the first).",
            value=s["sample_age_seconds"],
        )
        gauges = [
            ("kvserve_kv_cache_utilization", "kv_cache_utilization", "Fraction of KV cache in use (0..1)."),
            ("kvserve_queue_depth", "queue_depth", "Requests waiting for admission."),
            ("kvserve_requests_running", "requests_running", "Requests being executed."),
            ("kvserve_kv_cache_capacity_tokens", "kv_cache_capacity_tokens", "KV cache capacity in tokens."),
            ("kvserve_tensor_parallel_size", "tensor_parallel_size", "Tensor-parallel degree of the engine."),
            ("kvserve_data_parallel_size", "data_parallel_size", "Engines in the pod (its live DP x TP layout)."),
        ]
        for name, key, doc in gauges:
            if s[key] is not None:
                yield g(name, doc, value=s[key])
        for name, key, doc in [
            ("kvserve_prompt_tokens", "prompt_tokens_total", "Prompt tokens processed by the engine."),
            ("kvserve_generation_tokens", "generation_tokens_total", "Tokens generated by the engine."),
        ]:
            if s[key] is not None:
                yield CounterMetricFamily(name, doc, value=s[key])
        # The operator's TPOT gate reads these totals through Prometheus as it does from /v1/signals.
        if s["inter_token_latency_seconds_count"] is not None and s["inter_token_latency_seconds_sum"] is not None:
            yield SummaryMetricFamily("kvserve_inter_token_latency_seconds",
                                      "The engine's time between output tokens (TPOT), all requests.",
                                      count_value=s["inter_token_latency_seconds_count"],
                                      sum_value=s["inter_token_latency_seconds_sum"])
        if s["engine"] is not None:
            info = g("kvserve_engine_info", "Which engine the agent reads.", labels=["engine", "model_name"])
            info.add_metric([s["engine"], s["model_name"] or ""], 1)
            yield info


@dataclass
class Agent:
    config: AgentConfig
    clock: callable = time.monotonic
    state: ScrapeState = field(init=False)

    def __post_init__(self):
        self.state = ScrapeState(started_at=self.clock())
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SignalsCollector(self))
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._model_task: asyncio.Task | None = None
        self._adapters_task: asyncio.Task | None = None
        self.adapters = None
        if self.config.adapters_file:
            from .adapters import AdapterSync

            self.adapters = AdapterSync(self.config.adapters_file, self.config.adapters_dir, RuntimeAdmin(self),
                                        clock=self.clock)

    def signals(self) -> dict:
        adapters = self.adapters.report() if self.adapters is not None else None
        return signals_json(self.state, self.config, self.clock(), adapters)

    @property
    def base(self) -> str:
        return self.config.engine_url.rstrip("/")

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def _engine_kind(self, sample: EngineSample | None = None) -> str:
        # An explicit --engine wins: while a kvserve runtime is still loading, its /metrics can
        # look like another engine's, and guessing wrong would probe /health instead of /ready.
        sample = sample or self.state.sample
        if self.config.engine != "auto" or sample is None:
            return self.config.engine
        return sample.engine

    async def probe_ready(self, timeout: float | None = None,
                          sample: EngineSample | None = None) -> tuple[int, str]:
        """The engine's readiness status code and body, or 503 when it cannot be reached."""
        path = READY_PATHS.get(self._engine_kind(sample), "/ready")
        try:
            t = aiohttp.ClientTimeout(total=timeout or self.config.scrape_timeout_s)
            async with self.session.get(self.base + path, timeout=t) as resp:
                body = await resp.text()
                if resp.status == 404 and path == "/ready":  # an engine without /ready
                    async with self.session.get(self.base + "/health", timeout=t) as r2:
                        return r2.status, await r2.text()
                return resp.status, body
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return 503, f"engine unreachable: {type(exc).__name__}: {exc}"

    async def scrape_once(self) -> None:
        self.state.scrapes += 1
        requested_at = self.clock()
        t = aiohttp.ClientTimeout(total=self.config.scrape_timeout_s)
        try:
            async with self.session.get(self.base + "/metrics", timeout=t) as resp:
                if resp.status != 200:
                    raise ValueError(f"engine /metrics answered HTTP {resp.status}")
                text = await resp.text()
            sample = standardize(text, self.config.engine)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            self.state.up = False
            self.state.failures += 1
            self.state.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return
        # Probe before publishing: a /v1/signals read between the two awaits would otherwise
        # see a fresh sample next to the previous (on the first scrape: default False) readiness.
        sampled_at = self.clock()
        status, _ = await self.probe_ready(sample=sample)
        self.state.sample = sample
        self.state.sampled_at = sampled_at
        self.state.sample_requested_at = requested_at
        self.state.up = True
        self.state.last_error = None
        self.state.ready = status == 200

    async def run_scraper(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.scrape_once()
            except Exception:  # the loop must outlive any surprise from one scrape
                log.exception("scrape failed")
            await asyncio.sleep(max(0.0, self.config.interval_s - (self.clock() - started)))

    async def drain(self, timeout: float) -> dict:
        """Starts the engine's drain and waits until nothing is in flight or `timeout` passes.

        kvserve has POST /drain, which stops admission and waits itself. vLLM and SGLang have no
        such route: the pod is already out of the Service endpoints when preStop runs, so the
        agent waits for running + waiting to reach zero in its own scrapes.
        """
        deadline = self.clock() + timeout
        started = self.clock()
        engine = self._engine_kind()
        result: dict = {"engine": engine, "drained": False}
        if engine in ("kvserve", "auto"):
            headers = {"Authorization": f"Bearer {self.config.admin_api_key}"} if self.config.admin_api_key else {}
            try:
                # The runtime may wait its own time box, then up to 5 s for aborted requests to end.
                t = aiohttp.ClientTimeout(total=timeout + 10)
                async with self.session.post(self.base + "/drain", params={"timeout": str(timeout)},
                                             headers=headers, timeout=t) as r:
                    if r.status == 200:
                        body = await r.json()
                        result.update(drained=bool(body.get("drained")), in_flight=body.get("in_flight"),
                                      aborted=body.get("aborted", 0))
                        result["waited_seconds"] = round(self.clock() - started, 3)
                        return result
                    result["engine_status"] = r.status
                    if r.status in (401, 403):
                        # Watching scrapes instead would report "drained" without admission ever
                        # having stopped: a refused drain is an error, said as such.
                        result["error"] = f"the engine refused the drain: {await _error_message(r)}"
                        result["waited_seconds"] = round(self.clock() - started, 3)
                        return result
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
        # Fallback for engines without a drain route: watch in-flight work through fresh scrapes.
        while True:
            await self.scrape_once()
            s = self.state.sample
            if not self.state.up:
                result.update(drained=True, in_flight=0, note="engine is down")
                break
            in_flight = int((s.requests_running or 0) + (s.queue_depth or 0)) if s else 0
            result["in_flight"] = in_flight
            if in_flight == 0:
                result["drained"] = True
                break
            if self.clock() >= deadline:
                break
            await asyncio.sleep(min(0.25, max(0.0, deadline - self.clock())))
        result["waited_seconds"] = round(self.clock() - started, 3)
        return result

    async def read_model(self) -> None:
        """Reads the model directory until it holds a model (the pod's fetch step puts it there
        before the agent starts; elsewhere it may come later). A model does not change within a
        pod, so once read it is kept."""
        from .model_info import read_model_info

        while self.state.model is None:
            try:
                self.state.model = await asyncio.to_thread(read_model_info, self.config.model_dir)
                self.state.model_error = None
            except Exception as exc:  # unreadable now; the error is reported, and tried again
                self.state.model_error = f"{type(exc).__name__}: {exc}"
            if self.state.model is None:
                await asyncio.sleep(self.config.model_retry_s)
        log.info("model: %s, %s layers, %s heads / %s KV heads, %s", self.state.model.get("architecture"),
                 self.state.model.get("num_layers"), self.state.model.get("num_attention_heads"),
                 self.state.model.get("num_kv_heads"), self.state.model.get("dtype"))

    async def run_adapters(self) -> None:
        """Keeps the runtime's adapters equal to the list, once the runtime is ready."""
        while True:
            try:
                if self.state.ready and self.state.up:
                    sample = self.state.sample
                    await self.adapters.sync_once(self.clock(), sample.lora_adapters if sample else None,
                                                  self.state.sample_requested_at)
            except Exception:  # one bad round must not end adapter management
                log.exception("adapter sync failed")
            await asyncio.sleep(self.config.interval_s)

    async def start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self.run_scraper())
        self._model_task = asyncio.create_task(self.read_model()) if self.config.model_dir else None
        self._adapters_task = asyncio.create_task(self.run_adapters()) if self.adapters is not None else None

    async def stop(self, app: web.Application) -> None:
        for task in (self._task, self._model_task, self._adapters_task):
            if task:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._session:
            await self._session.close()


class RuntimeAdmin:
    """The runtime's LoRA admin routes (vLLM's names), called with the pod's admin key (or, for
    vLLM, the engine's API key: config.engine_api_key)."""

    def __init__(self, agent: Agent):
        self.agent = agent

    async def _post(self, path: str, body: dict) -> None:
        from .adapters import LoadRefused, Unreachable

        key = self.agent.config.engine_api_key or self.agent.config.admin_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            # Loading reads the adapter's weights: seconds for a large one.
            async with self.agent.session.post(self.agent.base + path, json=body, headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=120)) as r:
                if r.status == 200:
                    return
                message = await _error_message(r)
                # 409: an unload while requests still use the adapter; tried again later. A 401/403
                # (e.g. vLLM with an API key, which knows no admin key) is final and reported: the
                # pod must not wait for a credential that will never change.
                if 400 <= r.status < 500 and r.status not in (408, 409, 429):
                    raise LoadRefused(f"HTTP {r.status}: {message}")
                raise Unreachable(f"HTTP {r.status}: {message}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None

    async def load(self, name: str, path: str) -> None:
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})


AGENT_KEY = web.AppKey("agent", Agent)


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    """The message of an OpenAI-shaped error body, else the body's text, else the status."""
    text = await resp.text()
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:500] or f"HTTP {resp.status}"


def _parallelism_proxy(agent: Agent, config: AgentConfig):
    """The runtime's /admin/parallelism (read, or change the pod's layout live) for the operator:
    the caller shows the admin key here, and the agent sends the pod's key on to the runtime."""

    async def handler(request: web.Request) -> web.Response:
        route = f"{request.method} /admin/parallelism"
        denial = admin_denial(request.headers.get("Authorization"), config.admin_api_key, route=route)
        if denial is not None:
            return APIError(denial.status, denial.message).response()
        body = await request.content.read(4097)
        headers = {"Authorization": f"Bearer {config.admin_api_key}", "Content-Type": "application/json"}
        try:
            # A reshape starts the new layout's workers and loads its shards: seconds to minutes.
            async with agent.session.request(request.method, agent.base + "/admin/parallelism", data=body or None,
                                             headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return APIError(503, f"the runtime did not answer: {type(exc).__name__}: {exc}").response()

    return handler


def build_app(config: AgentConfig) -> web.Application:
    agent = Agent(config)
    app = web.Application()
    app[AGENT_KEY] = agent

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(agent.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def signals(request: web.Request) -> web.Response:
        return web.json_response(agent.signals())

    async def ready(request: web.Request) -> web.Response:
        if agent.adapters is not None and not agent.adapters.settled:
            # Not in the Service until every listed adapter was tried: a client naming one must
            # not get a 404 from a pod that would have it a second later.
            return web.Response(status=503, text="loading LoRA adapters")
        status, body = await agent.probe_ready()
        return web.Response(status=200 if status == 200 else 503, text=body or ("ok" if status == 200 else "not ready"))

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def drain(request: web.Request) -> web.Response:
        denial = admin_denial(request.headers.get("Authorization"), config.admin_api_key, route="POST /drain")
        if denial is not None:
            return APIError(denial.status, denial.message).response()
        try:
            timeout = effective_drain_timeout(request.query.get("timeout"), config.drain_timeout_s)
        except ValueError as exc:
            return APIError(400, str(exc), param="timeout").response()
        result = await agent.drain(timeout)
        return web.json_response(result)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/signals", signals)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", health)
    app.router.add_post("/drain", drain)
    parallelism = _parallelism_proxy(agent, config)
    app.router.add_get("/admin/parallelism", parallelism)
    app.router.add_post("/admin/parallelism", parallelism)
    app.on_startup.append(agent.start)
    app.on_cleanup.append(agent.stop)
    return app


def serve(config: AgentConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the exit code (1 when the port cannot be bound)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        web.run_app(build_app(config), host=config.host, port=config.port, print=None)
    except OSError as exc:  # port in use, unknown host: one clear line, not a traceback
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc.strerror or exc)
        return 1
    return 0


class DrainRefused(Exception):
    """The agent answered the drain with an error status; the message is its own."""


async def request_drain(agent_url: str, timeout: float, admin_api_key: str | None) -> dict:
    """Client side of `kvserve agent drain` (the preStop hook)."""
    t = aiohttp.ClientTimeout(total=timeout + 15)
    headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
    async with aiohttp.ClientSession(timeout=t) as session:
        async with session.post(agent_url.rstrip("/") + "/drain", params={"timeout": str(timeout)},
                                headers=headers) as resp:
            if resp.status != 200:
                raise DrainRefused(f"the agent answered HTTP {resp.status}: {await _error_message(resp)}")
            return await resp.json()
