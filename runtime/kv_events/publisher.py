"""Publishing event batches over ZMQ, off the engine step's critical path.

The step hands its events to ``publish`` (a deque append under a lock); one thread encodes each
batch, numbers it, sends it on a PUB socket as the multipart message ``(topic, seq, payload)``
(seq: 8 bytes big-endian, from 0 at process start) and keeps the last ``buffer_steps`` batches.
A ROUTER socket on ``replay_endpoint`` answers a request frame holding a start seq (8 bytes
big-endian) with every kept batch from that seq on, one ``(seq, payload)`` message each, then an
end marker whose seq is -1 and payload empty: what vLLM's publisher does, so vLLM's subscribers
(a REQ or DEALER socket) resync from us unchanged.

Bounded everywhere: the hand-off queue drops its oldest batch when full (counted in
``dropped``; a subscriber sees the gap in the seqs and replays), the replay buffer keeps
``buffer_steps`` batches, the PUB socket ``hwm`` messages. Every socket belongs to the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from .config import KVEventsConfig
from .events import Event, EventBatch, KVEventSink, encode_batch

log = logging.getLogger("kvserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 5  # how long the idle thread waits for a replay request before looking at the queue


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullPublisher:
    """Events off: nothing is sent (the sink is not even attached)."""

    dropped = 0
    published = 0

    def publish(self, events: Sequence[Event]) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int | None = None,
                 clock=time.time) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._clock = clock
        self._topic = config.topic.encode("utf-8")
        self._queue: deque[tuple[float, list[Event], int | None]] = deque()
        self._lock = threading.Condition()
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.dropped = 0  # batches dropped from a full hand-off queue
        self.published = 0
        self._closing = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r} / "
                             f"{config.replay_endpoint!r}: {exc}") from None
        # Read here, before the thread owns the sockets (a ZMQ socket is not thread-safe).
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = (None if self._replay is None
                                else self._replay.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event], data_parallel_rank: int | None = None) -> None:
        """One step's events; returns at once (the thread encodes and sends them). A DP engine
        that shares this publisher names its rank, so its batches say whose pool they describe."""
        if not events:
            return
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self.config.max_queue_size:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("KV event queue full: %d batches dropped so far (subscribers will replay)",
                                self.dropped)
            rank = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
            self._queue.append((self._clock(), list(events), rank))
            self._lock.notify()

    def _take(self) -> tuple[float, list[Event], int | None] | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _send(self, item: tuple[float, list[Event], int | None]) -> None:
        import zmq

        ts, events, rank = item
        payload = encode_batch(EventBatch(ts, events, rank))
        seq = self._next_seq
        self._next_seq += 1
        self._replay_buffer.append((seq, payload))
        self._send_live(seq, payload, zmq)
        self.published += 1

    def _send_live(self, seq: int, payload: bytes, zmq) -> None:
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: that subscriber replays the gap
            pass

    def _answer_replays(self) -> None:
        import zmq

        while True:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            if rest and rest[0] == b"":  # REQ and DEALER-as-REQ clients send an empty delimiter
                rest = rest[1:]
            start = int.from_bytes(rest[0], "big") if len(rest) == 1 and len(rest[0]) == 8 else None
            try:
                if start is not None:
                    for seq, payload in list(self._replay_buffer):
                        if seq >= start:
                            self._replay.send_multipart((ident, b"", seq_bytes(seq), payload))
                self._replay.send_multipart((ident, b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # the client went away mid-answer
                log.debug("replay answer to a subscriber failed: %s", exc)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                item = self._take()
                if item is not None:
                    self._send(item)
                    if self._replay is not None:
                        self._answer_replays()
                    continue
                with self._lock:
                    if self._closing:
                        return
                if self._replay is not None:
                    if poller.poll(_POLL_MS):
                        self._answer_replays()
                else:
                    with self._lock:
                        if not self._queue and not self._closing:
                            self._lock.wait(0.1)
        except Exception:  # a publisher that dies must not take the engine with it
            log.exception("KV event publisher stopped")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (up to `timeout`), then closes the sockets. Idempotent."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class RankedPublisher:
    """A DP engine's view of the publisher it shares with engine 0: its batches carry its rank;
    engine 0 closes the publisher, and counts its batches."""

    def __init__(self, publisher: ZmqEventPublisher, rank: int) -> None:
        self.publisher, self.rank = publisher, rank

    @property
    def published(self) -> int:
        return self.publisher.published

    @property
    def dropped(self) -> int:
        return self.publisher.dropped

    def publish(self, events: Sequence[Event]) -> None:
        self.publisher.publish(events, self.rank)

    def close(self) -> None:
        pass


def make_publisher(config: KVEventsConfig | None, **kwargs) -> NullPublisher | ZmqEventPublisher:
    if config is None or not config.active:
        return NullPublisher()
    return ZmqEventPublisher(config, **kwargs)


def attach_kv_events(config: KVEventsConfig | None,
                     block_manager) -> tuple[KVEventSink | None, NullPublisher | ZmqEventPublisher]:
    """The engine's sink and publisher: the sink hooked into the block pool (with several KV cache
    groups, the reference group's pool: its blocks are the context the cache holds), or
    (None, a NullPublisher) with events off."""
    if config is None or not config.active:
        return None, NullPublisher()
    pool = block_manager.managers[0] if hasattr(block_manager, "managers") else block_manager
    sink = KVEventSink(pool.block_size)
    publisher = ZmqEventPublisher(config)
    pool.events = sink
    log.info("KV events: publishing on %s (replay %s, topic %r)", publisher.endpoint,
             publisher.replay_endpoint or "off", config.topic)
    return sink, publisher
