"""Runs one LLMEngine in its own thread and hands each request's outputs to asyncio.

The engine is not thread-safe, so only the engine thread touches it: adds, aborts and stats
requests travel as commands through a lock-protected deque and are applied between steps. Each
step's outputs go back to the event loop in one `call_soon_threadsafe`, which routes them to the
per-request asyncio queues; the event loop never waits on a step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.runtime.engine.client import EngineClient

log = logging.getLogger("kvserve.server")

STATS_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; the server cannot serve any more."""


class RequestStream:
    """Outputs of one or more engine requests that belong to one HTTP request."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)

    def put(self, item: Any) -> None:
        self.queue.put_nowait(item)

    async def __aiter__(self):
        """Yields RequestOutputs until every request of the group has finished."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item


class AsyncEngine:
    """Thread owner of the engine. Create in the event loop; call `start()` once the engine exists.

    The engine is anything of the EngineClient shape (runtime/engine/client.py); the handlers
    read its constant facts through this object and never reach the engine itself."""

    def __init__(self, engine: EngineClient, on_stats: Callable[[Any], None] | None = None):
        self.engine = engine
        self.on_stats = on_stats
        self.loop = asyncio.get_running_loop()
        self._commands: deque[tuple[str, Any, Future | None]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, RequestStream] = {}
        self._seqs: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.last_stats: Any = None
        self.steps = 0
        self._dirty = False

    # -- the engine's constant facts (any thread) -------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    @property
    def structured_outputs(self) -> Any:
        return self.engine.structured_outputs

    def check_token_ids(self, ids: Any, field: str) -> None:
        self.engine.check_token_ids(ids, field)

    # -- event-loop side --------------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        """Engine requests added (or being added) and not yet finished or aborted."""
        return len(self._streams)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences of those requests (a request with n samples runs n sequences)."""
        return sum(self._seqs.get(rid, 1) for rid in self._streams)

    def _submit(self, kind: str, payload: Any, want_result: bool) -> asyncio.Future | None:
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        fut: Future | None = Future() if want_result else None
        with self._lock:
            self._commands.append((kind, payload, fut))
        self._wake.set()
        return asyncio.wrap_future(fut, loop=self.loop) if fut is not None else None

    async def add(self, requests: list[tuple[str, Any, Any]], lora_request: Any = None) -> RequestStream:
        """Adds (request_id, prompt, params) as one group, with one LoRA adapter (None: the base
        model); all or nothing.

        Raises the engine's ValueError (nothing stays added) or EngineDeadError.
        """
        stream = RequestStream([rid for rid, _, _ in requests])
        for rid, _, params in requests:
            self._streams[rid] = stream
            self._seqs[rid] = getattr(params, "n", 1) or 1
        try:
            await self._submit("add", (requests, lora_request), True)
        except BaseException:
            # Also on cancellation: the add may still be applied, so an abort must follow it.
            for rid in stream.request_ids:
                self._streams.pop(rid, None)
                self._seqs.pop(rid, None)
            if self.dead is None:
                self._submit("abort", list(stream.request_ids), False)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Aborts unfinished requests; their blocks are freed before the next step."""
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        for rid in request_ids:
            self._seqs.pop(rid, None)
        if live and self.dead is None:
            self._submit("abort", live, False)

    def abort_all(self) -> int:
        """Aborts every request in the engine but keeps their streams: each handler then gets its
        request's final output (finish_reason "abort") and ends its response cleanly."""
        live = list(self._streams)
        if live and self.dead is None:
            self._submit("abort", live, False)
        return len(live)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the engine thread between steps (for stats and admin reads)."""
        return await self._submit("call", fn, True)

    async def refresh_stats(self, timeout: float = 1.0) -> None:
        """Takes a fresh stats snapshot between steps; keeps the last one if a step runs long."""
        if self.dead is not None:
            return
        try:
            await asyncio.wait_for(self.call(lambda engine: self._refresh_stats()), timeout)
        except TimeoutError:
            pass

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
                self._seqs.pop(out.request_id, None)
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        self._seqs.clear()
        for stream in streams:
            stream.put(exc)

    async def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def close(self) -> None:
        """After stop(): closes the engine (frees its pools, reaps tensor-parallel workers)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)

    # -- engine thread ----------------------------------------------------------------------------
    def _apply_commands(self) -> bool:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for kind, payload, fut in commands:
            # Claiming the future first means a caller that gives up (a timed-out handler, a
            # client that left) can no longer cancel it under us; if it already did, there is
            # nobody to answer, and only an abort still has work to do.
            if fut is not None and not fut.set_running_or_notify_cancel() and kind != "abort":
                continue
            try:
                if kind == "add":
                    requests, lora_request = payload
                    if lora_request is None:  # an engine without LoRA takes no lora_request at all
                        self.engine.add_requests(requests)  # all or nothing
                    else:
                        self.engine.add_requests(requests, lora_request=lora_request)
                    result = None
                elif kind == "abort":
                    for rid in payload:
                        self.engine.abort_request(rid)
                    result = None
                else:
                    result = payload(self.engine)
            except Exception as exc:  # the caller gets it; the engine loop goes on
                if fut is not None:
                    fut.set_exception(exc)
                continue
            if fut is not None:
                fut.set_result(result)
        return bool(commands)

    def _refresh_stats(self) -> None:
        self.last_stats = self.engine.get_stats()
        self._stats_at = time.monotonic()
        if self.on_stats is not None:
            self.on_stats(self.last_stats)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                if self._apply_commands():
                    self._dirty = True
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.steps += 1
                    self._dirty = True
                    if outputs:
                        self.loop.call_soon_threadsafe(self._dispatch, outputs)
                    if time.monotonic() - self._stats_at >= STATS_INTERVAL_S:
                        self._refresh_stats()
                    continue
                # Idle: publish final stats (usage back to 0) before sleeping until a command.
                if self._dirty:
                    self._refresh_stats()
                    self._dirty = False
                check_health = getattr(self.engine, "check_health", None)
                if check_health is not None:
                    check_health()  # e.g. a dead tensor-parallel worker: end the loop, /health says why
                self._wake.wait(timeout=1.0)
        except BaseException as exc:  # a step crashed: fail every request rather than hang them
            log.exception("engine loop died")
            self.dead = exc
            with self._lock:
                pending = list(self._commands)
                self._commands.clear()
            for _, _, fut in pending:
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(f"engine stopped: {exc!r}"))
            try:
                self.loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine stopped: {exc!r}"))
            except RuntimeError:
                pass  # loop already closed
