"""`kvserve router` in front of real runtimes: three `kvserve serve` processes of a tiny model, each
on its own loopback address like pods, their Pod objects in the Kubernetes API emulator, and real
router processes watching that API. The clients are the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.testing.router_harness import Cluster, RouterProcess, RuntimePods, Workload, get_json, scrape, wait_for

pytestmark = pytest.mark.timeout(240)

IPS = ["127.0.1.2", "127.0.1.3", "127.0.1.4"]


@pytest.fixture(scope="module")
def env(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("router")
    # tiny-c runs one sequence at a time: the order requests reach it is the order they finish.
    pods = RuntimePods(tiny_llama, IPS, args=["--num-kv-blocks", "1024", "--max-model-len", "2048"],
                       extra={"tiny-c": ["--max-num-seqs", "1"]}, logs=work, in_process={"tiny-b", "tiny-c"},
                       kv_events=True)
    cluster = Cluster(work)
    routers: list[RouterProcess] = []
    try:
        port = ("--runtime-port", str(pods.port))
        # Served-based: the pods' KV events (their annotation) are test_event_fed_router's.
        prefix = RouterProcess("--inferenceservice", "tiny", *port, "--agent-port", "0", "--hold-timeout", "60",
                               "--served-model-name", "tiny", "--no-kv-events", cluster=cluster,
                               log=work / "router-prefix.log")
        routers.append(prefix)
        rr = RouterProcess("--inferenceservice", "tiny", *port, "--agent-port", "0", "--policy", "round-robin",
                           cluster=cluster, log=work / "router-rr.log")
        routers.append(rr)
        pods.wait_ready()
        cluster.set_pods(list(pods.pods.values()))
        yield {"pods": pods, "cluster": cluster, "prefix": prefix.wait_ready(3), "rr": rr.wait_ready(3),
               "work": work}
    finally:
        for r in routers:
            r.stop()
        pods.stop()
        cluster.stop()


def hit_rate(pods: RuntimePods, workload: Workload, url: str) -> float:
    hits0, queries0 = pods.prefix_counters()
    asyncio.run(workload.run(url))
    assert all(r.ok for r in workload.results), [r.error for r in workload.results if not r.ok][:3]
    hits1, queries1 = pods.prefix_counters()
    return (hits1 - hits0) / (queries1 - queries0)


def test_prefix_routing_finds_the_cache_round_robin_misses(env):
    pods, prefix, rr = env["pods"], env["prefix"], env["rr"]
    # Each run has its own system prompt and conversations: nothing carries over between runs.
    shape = dict(conversations=9, turns=4, concurrency=6, max_tokens=16, system_words=20, user_words=60)
    rr_rate = hit_rate(pods, Workload(seed=1, **shape), rr.url)
    prefix_rate = hit_rate(pods, Workload(seed=2, stream=False, **shape), prefix.url)
    print(f"prefix-cache hit rate over 3 pods: round-robin {rr_rate:.2f}, prefix {prefix_rate:.2f}")
    assert prefix_rate > rr_rate + 0.15
    m = scrape(prefix.url)
    hits = sum(v for k, v in m.items() if k.startswith("kvserve_router_requests_total") and "prefix-hit" in k)
    assert hits >= 9 * 3  # every later turn found its conversation's pod
    assert m["kvserve_router_prefix_matched_chunks_total"] > 0.5 * m["kvserve_router_prefix_query_chunks_total"]
    served = {k for k, v in m.items() if k.startswith("kvserve_router_requests_total") and v}
    assert {p for p in pods.pods if any(f"upstream={p}" in k for k in served)} == set(pods.pods)  # all pods used
    # The conversations it counts per pod (finished ones too, until --session-ttl): all 9, and
    # every pod keeps some.
    kept = [v for k, v in m.items() if k.startswith("kvserve_router_conversations{")]
    assert len(kept) == 3 and sum(kept) == 9 and min(kept) >= 1, kept
    # Streaming through the router is measured per pod.
    asyncio.run(Workload(seed=3, conversations=3, turns=1, max_tokens=4).run(prefix.url))
    m = scrape(prefix.url)
    assert sum(v for k, v in m.items() if k.startswith("kvserve_router_upstream_ttft_seconds_count")) >= 3


def test_event_fed_router_ranks_pods_by_the_blocks_they_hold(env):
    pods, work = env["pods"], env["work"]
    # No --tokenizer, as the operator runs it: the router asks a pod's /tokenize for the token ids
    # (its own tokenizer is tested against the runtime's hashes in test_router_kv_events.py).
    router = RouterProcess("--inferenceservice", "tiny", "--runtime-port", str(pods.port), "--agent-port", "0",
                           cluster=env["cluster"], log=work / "router-events.log")
    try:
        router.wait_ready(3, timeout=60)
        # Every pod's stream followed (the annotation gives each its own port), replayed from 0.
        wait_for(lambda: [p["state"] for p in get_json(router.url + "/router/kv-events")["pods"].values()]
                 == ["live"] * 3, 30, "all pods' events live")
        shape = dict(conversations=4, turns=3, concurrency=2, max_tokens=8, system_words=20, user_words=60)
        rate = hit_rate(pods, Workload(seed=11, **shape), router.url)
        status = get_json(router.url + "/router/kv-events")
        assert status["ranked_by_events"] >= 4 * 2  # the later turns: every pod's events were live
        assert all(p["blocks"] > 0 for p in status["pods"].values() if p["batches"]), status
        m = scrape(router.url)
        hits = sum(v for k, v in m.items() if k.startswith("kvserve_router_requests_total") and "prefix-hit" in k)
        assert hits >= 4 * 2 and rate > 0.5, (hits, rate)
        assert sum(v for k, v in m.items() if k.startswith("kvserve_router_kv_events_live{")) == 3
        assert m["kvserve_router_kv_events_ranked_requests_total"] >= 4 * 2
        # A pod the ring gave no conversation holds nothing (4 conversations on 3 pods may leave one idle).
        blocks = [v for k, v in m.items() if k.startswith("kvserve_router_kv_events_blocks{")]
        assert len(blocks) == 3 and sum(v > 0 for v in blocks) == sum(1 for p in status["pods"].values()
                                                                       if p["batches"]), (blocks, status)
    finally:
        router.stop()


def test_models_are_merged_and_health_answers(env):
    prefix = env["prefix"]
    models = get_json(prefix.url + "/v1/models")
    assert [c["id"] for c in models["data"]] == ["tiny"]
    assert get_json(prefix.url + "/v1/models/tiny")["id"] == "tiny"
    assert get_json(prefix.url + "/health") == {"status": "ok"}
    assert get_json(prefix.url + "/ready")["ready_endpoints"] == 3
    conn = http.client.HTTPConnection("127.0.0.1", prefix.port, timeout=10)
    conn.request("GET", "/v1/models/nope")
    resp = conn.getresponse()
    assert resp.status == 404 and json.loads(resp.read())["error"]["code"] == "model_not_found"
    # A bad body is the pod's to answer (OpenAI's 400), passed through as is.
    conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "Invalid JSON" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_client_disconnect_aborts_the_request_upstream(env):
    pods, prefix = env["pods"], env["prefix"]
    conn = http.client.HTTPConnection("127.0.0.1", prefix.port, timeout=30)
    body = {"model": "tiny", "prompt": "a long story that never ends " * 3, "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    pod = resp.getheader("X-Kvserve-Pod")
    resp.read1(100)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    url = pods.pods[pod].url

    def aborted():
        m = scrape(url)
        return m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:request_success_total{finished_reason=abort}")
    wait_for(aborted, 20, "the runtime to abort the request")


def test_held_requests_are_released_in_order_after_scale_from_zero(env):
    pods, cluster, prefix = env["pods"], env["cluster"], env["prefix"]
    # The pod plans requests (parse, template, tokenize) on a pool of threads, which may hand two
    # requests that arrive a millisecond apart to the engine in either order. One planning thread
    # keeps tiny-c's engine order equal to the order the router sent them, which is what is tested.
    state = pods.pods["tiny-c"].thread.server.state
    state.preprocess, two_threads = ThreadPoolExecutor(1, thread_name_prefix="kvserve-preprocess"), state.preprocess
    two_threads.shutdown(wait=True)
    cluster.set_pods([])  # scaled to zero
    prefix.wait_ready(0)
    # Still says what it serves while no pod is ready (clients list models before asking).
    assert [c["id"] for c in get_json(prefix.url + "/v1/models")["data"]] == ["tiny"]
    finished: list[int] = []
    errors: list[str] = []

    def send(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", prefix.port, timeout=60)
        body = {"model": "tiny", "prompt": f"held request number {i} " * 4, "max_tokens": 24, "ignore_eos": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            errors.append(f"{i}: {resp.status} {data[:200]!r}")
        finished.append(i)

    threads = []
    for i in range(5):
        t = threading.Thread(target=send, args=(i,))
        t.start()
        threads.append(t)
        wait_for(lambda: prefix.demand().get("held") == i + 1, 10, f"{i + 1} held requests")
    demand = prefix.demand()
    assert demand["held"] == 5 and demand["oldest_held_seconds"] > 0 and demand["ready_endpoints"] == 0
    time.sleep(0.3)
    started = time.monotonic()
    cluster.set_pods([pods.pods["tiny-c"]])  # a pod is ready again (one sequence at a time)
    for t in threads:
        t.join(60)
    assert not errors, errors
    # tiny-c runs one at a time, and the router releases held requests in arrival order, each once
    # the previous one's headers are out; two neighbours sent a millisecond apart on their own
    # connections may still reach the pod's engine in either order, nothing further than that.
    assert sorted(finished) == [0, 1, 2, 3, 4]
    assert all(abs(finished.index(i) - i) <= 1 for i in range(5)), finished
    print(f"held requests answered {time.monotonic() - started:.2f}s after the pod became ready")
    m = scrape(prefix.url)
    assert m["kvserve_router_holds_total{outcome=released}"] == 5
    assert m["kvserve_router_hold_seconds_count"] == 5 and m["kvserve_router_held_requests"] == 0
    assert prefix.demand()["held"] == 0


def test_no_ready_pod_is_a_503_with_retry_after(env, tmp_path):
    cluster = env["cluster"]
    short = RouterProcess("--inferenceservice", "nothing-here", "--hold-timeout", "0.5", cluster=cluster,
                          log=tmp_path / "router.log").wait_ready(0)
    full = RouterProcess("--inferenceservice", "nothing-here", "--max-held", "0", cluster=cluster).wait_ready(0)
    try:
        for router, wording in ((short, "No pod became ready in time"), (full, "hold queue is full")):
            conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": "x", "prompt": "hi"}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 503 and resp.getheader("Retry-After") == "5"
            assert wording in body["error"]["message"] and body["error"]["type"] == "service_unavailable_error"
            conn.close()
        assert short.demand()["hold_timeouts_total"] == 1 and short.demand()["held"] == 0
    finally:
        short.stop()
        full.stop()


def test_a_pod_killed_mid_run_loses_no_request_that_had_not_started_streaming(env):
    pods, cluster, prefix = env["pods"], env["cluster"], env["prefix"]
    cluster.set_pods(list(pods.pods.values()))
    prefix.wait_ready(3)

    def sent_to(pod: str) -> float:
        return sum(v for k, v in scrape(prefix.url).items()
                   if k.startswith("kvserve_router_requests_total") and f"upstream={pod}" in k)

    def retries_total() -> float:
        return sum(v for k, v in scrape(prefix.url).items() if k.startswith("kvserve_router_retries_total"))

    retries_before, sent_before = retries_total(), sent_to("tiny-a")
    streams = Workload(seed=4, conversations=9, turns=4, concurrency=6, max_tokens=48)
    whole = Workload(seed=5, conversations=9, turns=4, concurrency=6, max_tokens=48, stream=False)

    async def run():
        async def kill_once_it_serves():
            # Killed once the router has sent it work of this run (a fixed delay raced the workload:
            # on a fast machine, or when no conversation hashed to tiny-a, nothing noticed the kill).
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(sent_to, "tiny-a") == sent_before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # SIGKILL, and the Pod object stays Ready: the router finds out by being refused.
            await asyncio.to_thread(pods.kill, "tiny-a")
        await asyncio.gather(streams.run(prefix.url), whole.run(prefix.url), kill_once_it_serves())

    asyncio.run(run())
    failed = [r for r in streams.results + whole.results if not r.ok]
    assert all(r.streamed for r in failed), [r.error for r in failed if not r.streamed]
    assert all(r.ok for r in whole.results)  # nothing reached these clients before the end
    retries = retries_total()
    print(f"{len(failed)} streams cut mid-way, {retries - retries_before:.0f} requests retried on another pod")
    assert sent_to("tiny-a") > sent_before
    # The kill was felt: a stream cut mid-way, or a refused request retried on another pod.
    assert failed or retries > retries_before
