"""Following every pod's KV events (the imperative shell around kv_index.py).

One asyncio task per pod with events (`Endpoint.events`): a SUB socket on its publisher, a DEALER
socket on its replay socket, and a monitor of the SUB socket's connection. Every (re)connection
resets that pod's index and replays its buffer from seq 0 (a restarted pod starts a new stream:
nothing the old one said still holds); a gap in the seqs replays from the first missing one.
A pod that goes away (or changes address) takes its index with it. Nothing here blocks the
router's loop for long: a replay waits at most `replay_timeout` per answer, reading ZMQ sockets
without blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence

from kvserve.runtime.kv_events.events import decode_batch

from .endpoints import Endpoint
from .kv_index import DOWN, LIVE, PARTIAL, KVIndexConfig, PodKVIndex, PreciseMatch

log = logging.getLogger("kvserve.router")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSubscriptions:
    def __init__(self, config: KVIndexConfig | None = None, *, topic: str = "", replay_timeout: float = 2.0,
                 resync_interval: float = 10.0, clock=time.monotonic):
        self.config = config or KVIndexConfig()
        self.topic = topic.encode("utf-8")
        self.replay_timeout, self.resync_interval, self.clock = replay_timeout, resync_interval, clock
        self.indexes: dict[str, PodKVIndex] = {}
        self.last_routed: dict[str, float] = {}
        self._tasks: dict[str, tuple[tuple[str, str], asyncio.Task]] = {}
        self._ctx = None

    # -- which pods ------------------------------------------------------------------------------
    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Follow the pods that publish events; drop the ones gone or moved (their index too)."""
        wanted = {e.name: e.events for e in endpoints if e.events is not None}
        for name in list(self._tasks):
            address, task = self._tasks[name]
            if wanted.get(name) != address:
                task.cancel()
                del self._tasks[name]
                self.indexes.pop(name, None)
                self.last_routed.pop(name, None)
        for name, address in wanted.items():
            if name not in self._tasks:
                index = self.indexes[name] = PodKVIndex(self.config)
                self._tasks[name] = (address, asyncio.get_running_loop().create_task(self._follow(name, address,
                                                                                                  index)))

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            # destroy, not term: a task cancelled by set_endpoints may not have closed its sockets yet.
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- what the policy asks --------------------------------------------------------------------
    def routed(self, pod: str) -> None:
        """A request went to `pod`: its events should follow (or it is lagging)."""
        if pod in self.indexes:
            self.last_routed[pod] = self.clock()

    def block_sizes(self) -> set[int]:
        return {i.block_size for i in self.indexes.values() if i.block_size}

    def precise(self, keys_for, pods: Sequence[str], adapter: str | None = None) -> PreciseMatch | None:
        """`keys_for(block_size, lora_key)`: the request's runtime block hashes at that block size,
        under that LoRA adapter key (None when they cannot be computed). `adapter`: the LoRA
        adapter the request names; each pod's events say which id its blocks of it are keyed
        with (a pod that never stored a block of it holds none). None when no pod has usable
        events (or, for an adapter, none has stored any of its blocks)."""
        from kvserve.runtime.lora.identity import cache_key

        now = self.clock()
        held: dict[str, float] = {}
        partial: dict[str, float] = {}
        total = 0
        known = False
        for pod in pods:
            index = self.indexes.get(pod)
            if index is None or index.state not in (LIVE, PARTIAL):
                continue
            lora_key = None
            if adapter is not None:
                lora_id = index.adapters.get(adapter)
                if lora_id is None:  # none of its blocks here
                    if index.trusted(now, self.last_routed.get(pod)):
                        held[pod] = 0.0
                    continue
                known, lora_key = True, cache_key(adapter, lora_id)
            keys = keys_for(index.block_size, lora_key)  # block_size None: the router's own --block-size
            if keys is None:
                return None
            total = max(total, len(keys))
            if index.trusted(now, self.last_routed.get(pod)):
                held[pod] = index.match(keys)
            elif index.state in (PARTIAL, LIVE):
                partial[pod] = index.match(keys)
        if (not held and not partial) or (adapter is not None and not known):
            return None
        return PreciseMatch(total, held, partial)

    def status(self) -> dict[str, dict]:
        return {pod: {"state": i.state, "blocks": len(i), "last_seq": i.last_seq, **i.stats}
                for pod, i in sorted(self.indexes.items())}

    # -- one pod ---------------------------------------------------------------------------------
    def _context(self):
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def _follow(self, name: str, address: tuple[str, str], index: PodKVIndex) -> None:
        try:
            import zmq
            from zmq.utils.monitor import parse_monitor_message
        except ImportError:
            log.error("KV events of %s: pyzmq is not installed (pip install 'kvserve[events]'); served-based "
                      "routing only", name)
            return

        ctx = self._context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(address[0])
        replay = None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_resync = 0.0
        try:
            while True:
                ready = dict(await poller.poll(1000))
                if monitor in ready:  # before data: a connection comes before what it carries
                    while True:
                        try:
                            event = parse_monitor_message(await monitor.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if event["event"] == zmq.EVENT_CONNECTED:
                            log.info("KV events of %s: connected to %s; resyncing", name, address[0])
                            index.reset()
                            replay = await self._replay(name, address, index, replay, index.start_replay())
                            last_resync = self.clock()
                        elif event["event"] == zmq.EVENT_DISCONNECTED:
                            index.state = DOWN
                if sub in ready:
                    while True:
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self._on_live(name, index, frames) is not None:  # a gap, or a restart
                            replay = await self._replay(name, address, index, replay, index.start_replay())
                if index.state == PARTIAL and index.stats.get("replay_timeouts") \
                        and self.clock() - last_resync > self.resync_interval:
                    # The last replay went unanswered (not a short buffer): try a full one again.
                    index.stats["replay_timeouts"] = 0
                    index.reset()
                    replay = await self._replay(name, address, index, replay, index.start_replay())
                    last_resync = self.clock()
        finally:
            for sock in (sub, monitor, replay):
                if sock is not None:
                    sock.close(linger=0)

    def _on_live(self, name: str, index: PodKVIndex, frames: list[bytes]) -> int | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            index.stats["bad"] += 1
            return None
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except ValueError as exc:
            # Skipped, not trusted: the index may now miss this batch's blocks.
            log.warning("KV events of %s: batch %d undecodable (%s)", name, seq, exc)
            index.stats["bad"] += 1
            if index.state == LIVE and seq == index.last_seq + 1:
                index.last_seq = seq
                index.state = PARTIAL
            return None
        return index.live(seq, batch, self.clock())

    async def _replay(self, name: str, address: tuple[str, str], index: PodKVIndex, sock, start: int):
        """Asks the pod's replay socket for every batch from `start` and feeds them to the index,
        again while the live batches that waited meanwhile show a new gap. Returns the DEALER
        socket to reuse (None after a timeout: a late answer must not be read as the next one)."""
        import zmq

        while True:
            if sock is None:
                sock = self._context().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address[1])
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    log.warning("KV events of %s: no replay answer from %s in %.1f s; index partial", name,
                                address[1], self.replay_timeout)
                    index.stats["replay_timeouts"] = index.stats.get("replay_timeouts", 0) + 1
                    index.replay_failed()
                    sock.close(linger=0)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                if frames[1] == END_SEQ:
                    break
                try:
                    batch = decode_batch(frames[2])
                except ValueError:
                    index.stats["bad"] += 1
                    continue
                index.replayed(int.from_bytes(frames[1], "big"), batch, self.clock())
            need = index.replay_done(self.clock())
            if need is None:
                return sock
            start = index.start_replay()
