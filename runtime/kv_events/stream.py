"""The server's one KV events stream: one publisher for all its data-parallel engines, kept
across live layout changes (runtime/engine/data_parallel.py).

Why the server, not each engine, owns the publisher: a reshape replaces every engine. Were the
publisher an engine's, the new layout would bind the endpoint again and number its batches from 0
again; a subscriber then reconnects (ZMQ retries about every 100 ms) and every batch sent before
its subscription reached the new socket is lost for good (PUB/SUB's slow joiner), which are
exactly the new layout's first blocks. A consumer without replay never sees them, and one that
replays cannot tell a restarted numbering from a gap. One publisher keeps the connection, the
numbering and the replay buffer; the layout change itself is told in the stream: an
``AllBlocksCleared`` in a batch without ``data_parallel_rank`` (it speaks for the whole pod) before
the new engines' first events, since their pools start empty.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .config import KVEventsConfig
from .events import AllBlocksCleared, KVEventSink
from .publisher import RankedPublisher, ZmqEventPublisher

log = logging.getLogger("kvserve.kv_events")


class ServerEventStream:
    def __init__(self, config: KVEventsConfig) -> None:
        self.publisher = ZmqEventPublisher(config)  # untagged: a batch of its own is the pod's
        log.info("KV events: publishing on %s (replay %s, topic %r)", self.publisher.endpoint,
                 self.publisher.replay_endpoint or "off", config.topic)

    @property
    def published(self) -> int:
        return self.publisher.published

    @property
    def dropped(self) -> int:
        return self.publisher.dropped

    def attach(self, engines: Sequence[Any]) -> None:
        """Every engine of a new layout reports into its own sink and publishes through the one
        publisher, its batches tagged with its data_parallel_rank when there are several."""
        for rank, engine in enumerate(engines):
            bm = engine.block_manager
            # With several KV cache groups, the reference group's pool: its blocks are the
            # context the cache holds (as attach_kv_events).
            pool = bm.managers[0] if hasattr(bm, "managers") else bm
            lora = getattr(engine, "lora", None)  # adapter blocks name their adapter
            sink = KVEventSink(pool.block_size, None if lora is None else lora.identity)
            pool.events = sink
            if getattr(engine, "offload", None) is not None:
                engine.offload.attach_events(sink)  # announces what a persistent tier holds
            tag = rank if len(engines) > 1 else None
            engine.kv_event_sink, engine.kv_event_publisher = sink, RankedPublisher(self.publisher, tag)
            engine.kv_events_shared = True  # the stream closes the publisher and counts its batches

    def layout_changed(self) -> None:
        """The old engines are gone and the new ones hold nothing yet."""
        self.publisher.publish([AllBlocksCleared()])

    def close(self) -> None:
        self.publisher.close()


def open_server_stream(config: KVEventsConfig | None) -> ServerEventStream | None:
    if config is None or not config.active:
        return None
    return ServerEventStream(config)
