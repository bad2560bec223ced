"""The router's hold queue (requests waiting for a ready pod) and its load parsing, in isolation."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.runtime.router.hold import HoldFull, HoldQueue, HoldTimeout
from kvserve.runtime.router.load import current_load, load_from_metrics, load_from_signals


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
