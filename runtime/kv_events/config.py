"""`--kv-events-config`: vLLM's KVEventsConfig, the same keys and defaults, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.options import json_object

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: str | None = None
    # Bound when it names every interface ("*", "::") or is ipc:// / inproc://; otherwise the
    # publisher connects to it (a collector that binds), as vLLM does.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket that answers replays; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it the oldest drop
    topic: str = ""

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"kv_events_config.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            fail("enable_kv_cache_events", "must be a boolean")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            fail("publisher", f"must be one of {list(PUBLISHERS)}")
        for name in ("endpoint",) + (("replay_endpoint",) if self.replay_endpoint is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, str) or "://" not in value:
                fail(name, "must be a ZMQ endpoint such as tcp://*:5557")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                fail(name, f"must be an integer >= {low}")
        if not isinstance(self.topic, str):
            fail("topic", "must be a string")

    @property
    def active(self) -> bool:
        """Whether anything is published (events on and a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: Any) -> KVEventsConfig | None:
        """None, a dict, a KVEventsConfig, or that as a JSON string (the flag's form)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**json_object(value, "kv_events_config", {f.name for f in dataclasses.fields(cls)}))
