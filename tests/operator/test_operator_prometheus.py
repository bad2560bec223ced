"""The Prometheus signal source against a real Prometheus scraping a real agent."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvserve.operator.sources import PrometheusSource
from kvserve.testing.e2e_harness import Load, StubPod, free_port_on_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

pytestmark = pytest.mark.timeout(120)


def _pod(name: str, ip: str) -> dict:
    return {"metadata": {"name": name},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


async def test_prometheus_source_reads_the_agents_gauges(tmp_path):
    try:
        import prometheus_bin

        prom = prometheus_bin.ensure() / "prometheus"
    except Exception as error:  # no binary and no way to fetch one here
        pytest.skip(f"prometheus unavailable: {error}")
    ip = "127.0.0.97"
    agent_port = free_port_on_all([ip])
    engine_port = free_port_on_all([ip])
    prom_port = free_port_on_all(["127.0.0.1"])
    load = Load()
    load.kv, load.queue, load.running = 0.8, 3, 5
    load.itl_sum, load.itl_count = 12.5, 250
    pod = StubPod("tiny-1", ip, 2, engine_port, agent_port, load)
    await pod.start()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "kvserve-agent", "static_configs": [
                  {"targets": [f"{ip}:{agent_port}"], "labels": {"namespace": "default", "pod": "tiny-1"}}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([str(prom), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        source = PrometheusSource(f"http://127.0.0.1:{prom_port}", timeout=2)
        pods = [_pod("tiny-1", ip), _pod("tiny-2", "127.0.0.98")]
        deadline = time.monotonic() + 60
        while True:
            errors: dict[str, str] = {}
            signals = await source.scrape("default", "tiny", pods, errors)
            if not signals[0].stale or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        first, missing = signals
        assert not first.stale, errors
        assert first.kv_cache_utilization == pytest.approx(0.4)  # 0.8 of TP 1's pool at TP 2
        assert (first.queue_depth, first.requests_running, first.tensor_parallel_size) == (3, 5, 2)
        assert first.kv_cache_capacity_tokens == 8192
        # What the TPOT gate needs (0.05 s per token), and the pod's engine count.
        assert (first.itl_seconds_sum, first.itl_seconds_count) == (12.5, 250)
        assert first.data_parallel_size == 1
        assert missing.stale and missing.ready  # no series for it: never scaled down on
    finally:
        proc.terminate()
        proc.wait(10)
        await pod.stop()


async def test_prometheus_unreachable_gives_stale_signals():
    source = PrometheusSource("http://127.0.0.1:9", timeout=1)
    errors: dict[str, str] = {}
    (signal,) = await source.scrape("default", "tiny", [_pod("tiny-1", "127.0.0.2")], errors)
    assert signal.stale and "prometheus" in errors
