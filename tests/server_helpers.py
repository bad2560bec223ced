"""Helpers for the server tests: raw HTTP against a live server, metric reads, polling."""

from __future__ import annotations

import http.client as httpclient
import json
import time
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families


def http(url: str, method: str, path: str, body: bytes | str | dict | None = None,
         headers: dict | None = None, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value."""
    status, _, body = http(url, "GET", "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def m(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def idle(url: str) -> dict:
    """Waits until the engine is idle with an empty KV cache and returns that metrics snapshot."""
    def check():
        snap = metrics(url)
        if (m(snap, "vllm:num_requests_running") == 0 and m(snap, "vllm:num_requests_waiting") == 0
                and m(snap, "vllm:kv_cache_usage_perc") == 0):
            return snap
        return None
    return wait_until(check)
