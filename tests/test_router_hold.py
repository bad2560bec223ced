"""The router's hold queue (requests waiting for a ready pod) and its load parsing, in isolation."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest
from aiohttp import web

from kvserve.runtime.router.endpoints import Endpoint
from kvserve.runtime.router.hold import HoldFull, HoldQueue, HoldTimeout
from kvserve.runtime.router.load import LoadPoller, current_load, load_from_metrics, load_from_signals
from kvserve.runtime.router.policy import EndpointLoad


async def test_held_requests_leave_in_arrival_order_each_after_the_previous_was_sent():
    queue = HoldQueue(max_held=10, timeout=5)
    order: list[int] = []

    async def request(i: int):
        ticket, waited = await queue.wait()
        order.append(i)
        await asyncio.sleep(0.01 * (5 - i))  # later ones would overtake if released all at once
        ticket.sent.set()

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert len(queue) == 5 and order == [] and queue.must_hold()
    queue.set_available(True)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4] and len(queue) == 0 and not queue.must_hold()


async def test_hold_timeout_full_and_a_client_that_leaves():
    queue = HoldQueue(max_held=2, timeout=0.1)
    with pytest.raises(HoldTimeout):
        await queue.wait()
    assert queue.timeouts_total == 1 and len(queue) == 0
    slow = HoldQueue(max_held=1, timeout=5)
    first = asyncio.create_task(slow.wait())
    await asyncio.sleep(0)
    with pytest.raises(HoldFull):
        await slow.wait()
    first.cancel()  # the client went away: it no longer counts, and does not block the others
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(slow) == 0
    second = asyncio.create_task(slow.wait())
    await asyncio.sleep(0)
    slow.set_available(True)
    ticket, _ = await asyncio.wait_for(second, 1)
    ticket.sent.set()


def test_load_parsing():
    s = load_from_signals({"ready": True, "stale": False, "requests_running": 3, "queue_depth": 2,
                           "kv_cache_utilization": 1.7}, at=10.0)
    assert (s.running, s.queue_depth, s.kv_cache_utilization, s.ok) == (3, 2, 1.0, True)
    assert not load_from_signals({"stale": True}, at=0).ok
    assert not load_from_signals({"ready": False}, at=0).ok
    fresh = current_load(s, in_flight=1, now=12.0, stale_after=5)
    assert fresh.fresh and fresh.busy() == 5
    assert not current_load(s, in_flight=1, now=20.0, stale_after=5).fresh  # too old: unknown
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 7\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    m = load_from_metrics(text, at=1.0)
    assert (m.running, m.queue_depth, m.kv_cache_utilization) == (2, 7, 0.5)


@pytest.mark.parametrize("in_flight, agent, own, busy", [
    (0, 1, None, 1),  # nothing known of the sample's window: the agent's count as it is
    (2, 1, None, 2),
    (0, 1, 1, 0),  # the sample still counts this router's request that has since finished
    (1, 1, 1, 1),  # ... or the one still open
    (1, 0, 1, 1),  # sampled before the request reached the pod
    (1, 3, 1, 3),  # two from other clients, plus this router's one
    (0, 3, 1, 2),  # this router's finished; the other clients' two remain
])
def test_busy_counts_the_agents_excess_over_this_routers_own_requests(in_flight, agent, own, busy):
    load = EndpointLoad(in_flight=in_flight, running=agent, fresh=True, own_at_sample=own)
    assert load.busy() == busy
    assert EndpointLoad(in_flight=in_flight, running=agent, fresh=False, own_at_sample=own).busy() == in_flight


def test_a_sample_taken_while_this_routers_request_ran_does_not_keep_the_pod_busy():
    """The pod's /metrics counts a request this router sent; once it has finished (the sample not
    yet renewed) the pod is idle again for the policy, while other clients' requests still count."""
    running = {"n": 0}

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", lambda _: web.Response(
            text=f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running['n']}\n"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        pod = Endpoint("pod-a", f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/metrics")
        poller, in_flight = LoadPoller(), collections.Counter()
        poller.in_flight = in_flight
        try:
            async with aiohttp.ClientSession() as session:
                in_flight["pod-a"] += 1  # this router sends one
                poller.sent("pod-a", in_flight["pod-a"])
                running["n"] = 1
                await poller.poll_once(session, [pod])
                assert poller.load("pod-a", in_flight["pod-a"]).busy() == 1
                in_flight["pod-a"] -= 1  # it finished; the sample still says 1
                assert poller.load("pod-a", in_flight["pod-a"]).busy() == 0
                running["n"] = 2  # two from elsewhere join
                await poller.poll_once(session, [pod])
                # This router's request was open when the sample's window began: it may be counted.
                assert poller.load("pod-a", 0).busy() == 1
                await poller.poll_once(session, [pod])
                assert poller.load("pod-a", 0).busy() == 2  # nothing of this router's open since
                await poller.poll_once(session, [])  # the pod went away: nothing kept for it
                assert not poller._peak and not poller._own
        finally:
            await runner.cleanup()

    asyncio.run(main())
