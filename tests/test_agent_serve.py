"""`kvserve agent serve` against a loopback engine replaying the recorded vLLM exposition."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvserve.runtime.agent.app import AgentConfig, build_app

VLLM_TEXT = (pathlib.Path(__file__).parent / "fixtures" / "vllm_metrics.txt").read_text()


class ReplayEngine:
    """Serves a settable exposition the way vLLM does (/metrics, /health), or hangs, or dies."""

    def __init__(self):
        self.text = VLLM_TEXT
        self.delay = 0.0
        self.health_delay = 0.0
        self.healthy = True

    def app(self) -> web.Application:
        app = web.Application()

        async def metrics(request):
            await asyncio.sleep(self.delay)
            return web.Response(text=self.text, content_type="text/plain")

        async def health(request):
            await asyncio.sleep(self.health_delay)
            return web.Response(status=200 if self.healthy else 503)

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        return app


async def _start(app) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def _wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_agent_standardizes_vllm_and_survives_a_dead_engine():
    engine = ReplayEngine()
    erunner, eurl = await _start(engine.app())
    cfg = AgentConfig(engine_url=eurl, engine="vllm", interval_s=0.1, scrape_timeout_s=1.0, stale_after_s=2.0,
                      tensor_parallel_size=2)
    arunner, aurl = await _start(build_app(cfg))
    try:
        async with aiohttp.ClientSession() as http:
            async def signals():
                async with http.get(aurl + "/v1/signals") as r:
                    return await r.json()

            async def fresh():
                return (await signals())["stale"] is False

            await _wait_for(fresh)
            s = await signals()
            assert s["engine"] == "vllm" and s["ready"] is True
            assert s["kv_cache_utilization"] == 0.73 and s["queue_depth"] == 5 and s["requests_running"] == 12
            assert s["kv_cache_capacity_tokens"] == 81920 and s["tensor_parallel_size"] == 2
            assert s["prompt_tokens_total"] == 123456 and s["generation_tokens_total"] == 65432

            async with http.get(aurl + "/metrics") as r:
                text = await r.text()
            samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            assert samples["kvserve_kv_cache_utilization"] == 0.73
            assert samples["kvserve_queue_depth"] == 5
            assert samples["kvserve_requests_running"] == 12
            assert samples["kvserve_kv_cache_capacity_tokens"] == 81920
            assert samples["kvserve_prompt_tokens_total"] == 123456
            assert samples["kvserve_generation_tokens_total"] == 65432
            assert samples["kvserve_tensor_parallel_size"] == 2
            assert samples["kvserve_inter_token_latency_seconds_count"] == 2000
            assert samples["kvserve_inter_token_latency_seconds_sum"] == pytest.approx(42.5028186)
            assert samples["kvserve_engine_up"] == 1
            assert samples["kvserve_engine_sample_age_seconds"] < cfg.stale_after_s

            async with http.get(aurl + "/ready") as r:
                assert r.status == 200
            engine.healthy = False
            async with http.get(aurl + "/ready") as r:
                assert r.status == 503

            # Slow engine: scrapes time out, values stay, age grows.
            engine.delay = 3.0  # beyond scrape_timeout_s

            async def stale():
                return (await signals())["stale"] is True

            await _wait_for(stale)
            s1 = await signals()
            assert s1["kv_cache_utilization"] == 0.73 and s1["queue_depth"] == 5
            assert "Timeout" in s1["last_error"]

            # Dead engine: same, and the age keeps growing in /metrics.
            engine.delay = 0.0
            await erunner.cleanup()
            await asyncio.sleep(0.3)
            async with http.get(aurl + "/metrics") as r:
                text = await r.text()
            samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            assert samples["kvserve_engine_up"] == 0
            assert samples["kvserve_engine_sample_age_seconds"] > s1["sample_age_seconds"]
            assert samples["kvserve_queue_depth"] == 5  # the last sample, never zero
            async with http.get(aurl + "/ready") as r:
                assert r.status == 503
    finally:
        await arunner.cleanup()
        await erunner.cleanup()


async def test_agent_drain_waits_for_vllm_in_flight_work():
    engine = ReplayEngine()
    erunner, eurl = await _start(engine.app())
    arunner, aurl = await _start(build_app(AgentConfig(engine_url=eurl, engine="vllm", interval_s=0.1,
                                                       admin_api_key="admin-key")))
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer admin-key"}) as http:
            async with http.post(aurl + "/drain", params={"timeout": "0.3"}) as r:
                body = await r.json()
            assert body["drained"] is False and body["in_flight"] == 17

            async def finish_later():
                await asyncio.sleep(0.3)
                engine.text = VLLM_TEXT.replace("} 12.0\n", "} 0.0\n").replace("} 5.0\n", "} 0.0\n")

            task = asyncio.create_task(finish_later())
            async with http.post(aurl + "/drain", params={"timeout": "5"}) as r:
                body = await r.json()
            await task
            assert body["drained"] is True and body["in_flight"] == 0
            assert 0.2 < body["waited_seconds"] < 3

            async with http.post(aurl + "/drain", params={"timeout": "nope"}) as r:
                assert r.status == 400
    finally:
        await arunner.cleanup()
        await erunner.cleanup()


async def test_agent_without_engine_reports_unknown():
    arunner, aurl = await _start(build_app(AgentConfig(engine_url="http://127.0.0.1:9", interval_s=0.1)))
    try:
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as http:
            async with http.get(aurl + "/v1/signals") as r:
                s = await r.json()
            async with http.get(aurl + "/metrics") as r:
                text = await r.text()
        assert s["stale"] is True and s["engine_up"] is False and s["kv_cache_utilization"] is None
        assert "kvserve_queue_depth" not in text and "kvserve_engine_up 0.0" in text
    finally:
        await arunner.cleanup()


async def test_explicit_kvserve_engine_is_not_ready_while_loading_even_if_metrics_look_like_vllm():
    # A kvserve runtime still loading serves vllm:-only metrics, /health 200 and /ready 503.
    engine = ReplayEngine()
    app = engine.app()

    async def ready(request):
        return web.Response(status=503, text="loading")

    app.router.add_get("/ready", ready)
    erunner, eurl = await _start(app)
    cfg = AgentConfig(engine_url=eurl, engine="kvserve", interval_s=0.1, scrape_timeout_s=1.0, stale_after_s=2.0)
    arunner, aurl = await _start(build_app(cfg))
    try:
        async with aiohttp.ClientSession() as http:
            async def scraped():
                async with http.get(aurl + "/v1/signals") as r:
                    return (await r.json())["stale"] is False

            await _wait_for(scraped)
            async with http.get(aurl + "/v1/signals") as r:
                signals = await r.json()
            assert signals["engine"] == "kvserve" and signals["ready"] is False
            async with http.get(aurl + "/ready") as r:
                assert r.status == 503
    finally:
        await arunner.cleanup()
        await erunner.cleanup()


async def test_a_fresh_sample_is_never_published_before_its_readiness():
    # The readiness probe runs after /metrics; a slow one must not expose a window in which
    # /v1/signals says "not stale" next to the default ready=False (CI caught that under load).
    engine = ReplayEngine()
    engine.health_delay = 0.4
    erunner, eurl = await _start(engine.app())
    cfg = AgentConfig(engine_url=eurl, engine="vllm", interval_s=0.05, scrape_timeout_s=2.0, stale_after_s=5.0)
    arunner, aurl = await _start(build_app(cfg))
    try:
        async with aiohttp.ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 5.0
            seen_fresh = 0
            while seen_fresh < 5:
                assert asyncio.get_running_loop().time() < deadline, "never saw a fresh sample"
                async with http.get(aurl + "/v1/signals") as r:
                    sig = await r.json()
                if not sig["stale"]:
                    assert sig["ready"] is True, sig
                    seen_fresh += 1
                await asyncio.sleep(0.02)
    finally:
        await arunner.cleanup()
        await erunner.cleanup()
