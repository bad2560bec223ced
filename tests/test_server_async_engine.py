"""The engine thread outlives callers that give up: a cancelled call or add never kills it."""

from __future__ import annotations

import asyncio
import threading

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.server.async_engine import AsyncEngine


async def test_cancelled_callers_do_not_stop_the_engine_loop(tiny_llama):
    engine = LLMEngine.from_args(model=str(tiny_llama), num_kv_blocks=64, max_model_len=256)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        # Hold the engine thread inside a call so the next commands queue up behind it.
        release = threading.Event()
        blocker = asyncio.ensure_future(async_engine.call(lambda e: release.wait(5)))
        await asyncio.sleep(0.05)
        # Callers that give up while queued, as a timed-out /metrics handler or a client that
        # disconnects during admission does.
        with_timeout = asyncio.ensure_future(asyncio.wait_for(async_engine.refresh_stats(0.01), 1))
        gone_add = asyncio.ensure_future(async_engine.add(
            [("gone", "hello there", SamplingParams(max_tokens=4, temperature=0))]))
        await asyncio.sleep(0.05)
        gone_add.cancel()
        release.set()
        await blocker
        await with_timeout
        await asyncio.gather(gone_add, return_exceptions=True)

        stream = await async_engine.add([("kept", "hello there", SamplingParams(max_tokens=4, temperature=0))])
        outputs = [out async for out in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        assert async_engine.dead is None
        await async_engine.call(lambda e: None)  # let the thread apply the cancelled add's abort
        assert engine.get_stats().kv_blocks_used == 0
    finally:
        await async_engine.stop()
