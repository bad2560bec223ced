"""The events and their wire encoding (vLLM's), and the sink the block pool reports into.

Wire shape (msgpack, what vLLM's msgspec structs with ``array_like`` + ``tag`` produce, so its
decoder and llm-d's indexer read ours unchanged): a batch is ``[ts, [event, ...]]`` (plus
``data_parallel_rank`` when set), an event is an array led by its class name:

    ["BlockStored", [hash, ...], parent_hash | None, [token_id, ...], block_size, lora_id | None, medium,
     lora_name | None]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

Block hashes are the prefix cache's own keys (runtime/engine/prefix_cache.py: 32-byte SHA-256
chain, sent as msgpack bin), so a subscriber that hashes a prompt the same way finds them.

Pure (no zmq): the publisher (publisher.py) sends what ``KVEventSink.take`` returns once a step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The engine's own KV pool is "GPU" in vLLM's vocabulary on every device (a CPU pod's pool too);
# an offload tier reports "CPU" (host memory) or "DISK" (files).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"

Hash = bytes | int


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    # A LoRA adapter's blocks: its pod-independent id and name (runtime/lora/identity.py); the
    # prefix-cache key of the adapter is cache_key(lora_name, lora_id).
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> list:
        # lora_name always (nil too): vLLM's current struct has it as a required field.
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium, self.lora_name]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Hash]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    body: list[Any] = [batch.ts, [e.to_wire() for e in batch.events]]
    if batch.data_parallel_rank is not None:  # omitted at its default, as msgspec's omit_defaults does
        body.append(batch.data_parallel_rank)
    import msgpack  # the events extra; importing this module (the router's policy does) needs none

    return msgpack.packb(body, use_bin_type=True)


def _hashes(value: Any) -> list[Hash]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool)
                                              for h in value):
        raise ValueError("block_hashes: must be a list of bytes or integers")
    return value


def _event(raw: Any) -> Event:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ValueError("event: must be an array led by its type name")
    tag, args = raw[0], raw[1:]
    if tag == "BlockStored":
        if len(args) < 4:
            raise ValueError("BlockStored: too few fields")
        hashes, parent, tokens, block_size = args[:4]
        lora_id = args[4] if len(args) > 4 else None
        medium = args[5] if len(args) > 5 else None
        lora_name = args[6] if len(args) > 6 and isinstance(args[6], str) else None
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
            raise ValueError("BlockStored.lora_id: must be an integer or nil")
        if parent is not None and not isinstance(parent, (bytes, int)):
            raise ValueError("BlockStored.parent_block_hash: must be bytes, an integer or nil")
        if not isinstance(tokens, list) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError("BlockStored: token_ids must be a list and block_size an integer >= 1")
        return BlockStored(_hashes(hashes), parent, tokens, block_size, lora_id,
                           medium if isinstance(medium, str) else None, lora_name)
    if tag == "BlockRemoved":
        if not args:
            raise ValueError("BlockRemoved: too few fields")
        medium = args[1] if len(args) > 1 else None
        return BlockRemoved(_hashes(args[0]), medium if isinstance(medium, str) else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"event: unknown type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A payload off the wire; ValueError for anything that is not a batch in this shape (a
    subscriber drops such a batch and resyncs rather than trusting half of it)."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"batch: not msgpack ({type(exc).__name__})") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[0], (int, float)) \
            or not isinstance(raw[1], list):
        raise ValueError("batch: must be [ts, [events...]]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EventBatch(float(raw[0]), [_event(e) for e in raw[1]], rank)


class KVEventSink:
    """Collects the events of one engine step (the block pool reports into it; an offload tier
    may too, from its own thread, hence the lock). Consecutive removals of one medium merge into
    one event, as a step's evictions come one block at a time. `lora_identity(lora_int_id)`:
    the engine's adapter registry (LoRAManager.identity), which names an adapter's blocks."""

    def __init__(self, block_size: int, lora_identity=None) -> None:
        self.block_size = block_size
        self.lora_identity = lora_identity
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def stored(self, block_hashes: Sequence[Hash], parent_block_hash: Hash | None, token_ids: Sequence[int],
               *, medium: str | None = MEDIUM_GPU, lora_int_id: int = 0,
               lora: tuple[int, str] | None = None) -> None:
        """`lora`: the adapter's (lora_id, lora_name) when already known (else from `lora_int_id`)."""
        if not block_hashes:
            return
        if lora is None and lora_int_id and self.lora_identity is not None:
            lora = self.lora_identity(lora_int_id)
        event = BlockStored(list(block_hashes), parent_block_hash, list(token_ids), self.block_size,
                            None if lora is None else lora[0], medium, None if lora is None else lora[1])
        with self._lock:
            self._events.append(event)

    def removed(self, block_hashes: Sequence[Hash], *, medium: str | None = MEDIUM_GPU) -> None:
        if not block_hashes:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.extend(block_hashes)
            else:
                self._events.append(BlockRemoved(list(block_hashes), medium))

    def cleared(self) -> None:
        with self._lock:
            # What came before in this step no longer matters to anyone.
            self._events = [AllBlocksCleared()]

    def take(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, []
        return events
