"""What each pod holds, from its KV events: the event-fed side of the router's prefix policy.

Pure (no I/O, no clock of its own). One `PodKVIndex` per pod keeps the block hashes that pod's
events say it holds, per medium (its KV pool "GPU", an offload tier "CPU" / "DISK"), LRU-capped,
and follows the event stream's sequence numbers:

- a batch whose seq is the next one is applied;
- a gap (seq jumps ahead: batches dropped by the network, the publisher's full queue or a slow
  subscriber) asks the shell to replay from the first missing seq; live batches wait meanwhile;
- a seq that goes backwards, or a reconnection, means the pod restarted: its index is cleared
  and the stream replayed from 0;
- a replay that cannot start where asked (the pod's buffer no longer has those batches) leaves
  the index *partial*: it may miss blocks, so the router uses it only together with what the pod
  served (see `trusted`).

The router computes a prompt's block hashes exactly as the runtime does
(runtime/engine/prefix_cache.py) and `match` counts the leading ones a pod holds, weighted by
medium: a block in the pool saves its whole prefill, one in a tier most of it (a load instead).

A pod with several data-parallel engines has a pool per engine: each batch names its engine in
`data_parallel_rank` (vLLM's field), and the index keeps one block map per engine, so a block one
engine evicts stays held by another that has it. A request is served by one engine (the pod
places it by prefix), so a pod's match is its best engine's, not the union. An AllBlocksCleared
in an untagged batch clears every engine: the pod changed its layout live and starts empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.runtime.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

SYNCING = "syncing"  # replaying the pod's buffered batches; live ones wait
LIVE = "live"  # every batch since the pod started (or since its buffer began) applied in order
PARTIAL = "partial"  # some batches could not be replayed: blocks may be missing
DOWN = "down"  # not connected (yet)

_MEDIUM_BITS = {"GPU": 1, "CPU": 2, "DISK": 4}
_OTHER_BIT = 8
MAX_PENDING = 1024  # live batches kept while a replay runs; past it the oldest go (a gap again)
MAX_ADAPTERS = 256  # LoRA adapters remembered per pod (name -> id); past it the least recently stored go


def medium_bit(medium: str | None) -> int:
    return _MEDIUM_BITS.get(medium or "GPU", _OTHER_BIT)


@dataclass(frozen=True)
class KVIndexConfig:
    max_blocks_per_pod: int = 100_000
    # What a held block is worth, by where it is held (1.0: its whole prefill saved).
    medium_weights: Mapping[str, float] = field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5})
    # A pod we sent a request to this long ago without an event since is lagging: its index is
    # not trusted until its events catch up.
    lag_seconds: float = 5.0

    def __post_init__(self):
        if not isinstance(self.max_blocks_per_pod, int) or self.max_blocks_per_pod < 1:
            raise ValueError(f"max_blocks_per_pod: must be an integer >= 1, got {self.max_blocks_per_pod!r}")
        for medium, weight in self.medium_weights.items():
            if not 0 <= weight <= 1:
                raise ValueError(f"medium_weights.{medium}: must be in [0, 1], got {weight!r}")
        if not self.lag_seconds > 0:
            raise ValueError(f"lag_seconds: must be > 0, got {self.lag_seconds!r}")

    def bit_weights(self) -> list[tuple[int, float]]:
        out = [(medium_bit(m), w) for m, w in self.medium_weights.items()]
        return sorted(out, key=lambda bw: -bw[1])


class PodKVIndex:
    def __init__(self, config: KVIndexConfig | None = None):
        self.config = config or KVIndexConfig()
        self._weights = self.config.bit_weights()
        # data_parallel_rank (None: a pod with one engine) -> hash -> medium bits
        self.engines: dict[int | None, OrderedDict[bytes | int, int]] = {}
        self.last_seq = -1
        self.state = DOWN
        self.block_size: int | None = None  # from the pod's BlockStored events
        self.last_event_at: float | None = None
        self.pending: list[tuple[int, EventBatch]] = []  # live batches that wait for a replay
        self.replay_from: int | None = None  # the seq the running replay was asked to start at
        self.replayed_through = -1  # live batches up to this seq are duplicates of a replay's
        self._partial = False
        # LoRA adapter name -> the id its blocks are keyed with on this pod (BlockStored's
        # lora_name / lora_id): what the router hashes an adapter request's prompt with.
        self.adapters: OrderedDict[str, int] = OrderedDict()
        self.stats = {"batches": 0, "gaps": 0, "restarts": 0, "partial": 0, "evicted": 0, "bad": 0}

    def __len__(self) -> int:
        return sum(len(b) for b in self.engines.values())

    @property
    def blocks(self) -> dict[bytes | int, int]:
        """Every engine's blocks together (hash -> medium bits): for status and tests."""
        out: dict[bytes | int, int] = {}
        for blocks in self.engines.values():
            for h, bits in blocks.items():
                out[h] = out.get(h, 0) | bits
        return out

    # -- the stream ------------------------------------------------------------------------------
    def reset(self) -> None:
        """The pod restarted (or we reconnected and cannot tell): nothing it held is known."""
        self.engines.clear()
        self.adapters.clear()
        self.last_seq = -1
        self.pending.clear()
        self.state = DOWN
        self.replay_from = None
        self.replayed_through = -1
        self._partial = False

    def start_replay(self) -> int:
        """Enter SYNCING; returns the seq the shell asks the pod's replay socket for."""
        self.state = SYNCING
        self.replay_from = self.last_seq + 1
        return self.replay_from

    def replayed(self, seq: int, batch: EventBatch, now: float) -> None:
        """One batch of a replay answer (in seq order)."""
        if seq <= self.last_seq:
            return
        if seq > self.last_seq + 1:  # the pod's buffer no longer holds what we missed
            self.stats["partial"] += 1
            self._partial = True
        self._apply(seq, batch, now)
        self.replayed_through = seq

    def replay_done(self, now: float) -> int | None:
        """The end marker came: go live, then take the live batches that waited. Returns a seq
        to replay from when those show a gap again, else None."""
        self.state = PARTIAL if self._partial else LIVE
        self.replay_from = None
        pending, self.pending = self.pending, []
        for i, (seq, batch) in enumerate(pending):
            if seq <= self.last_seq:
                continue  # the replay had it
            need = self.live(seq, batch, now)
            if need is not None:
                self.pending = self.pending + pending[i + 1:]
                return need
        return None

    def replay_failed(self) -> None:
        """No answer from the replay socket: live batches from here on, the gap stays unknown."""
        self._partial = True
        self.stats["partial"] += 1
        self.state = PARTIAL
        self.replay_from = None
        pending, self.pending = self.pending, []
        for seq, batch in pending:
            if seq > self.last_seq:
                self._apply(seq, batch, self.last_event_at or 0.0)

    def live(self, seq: int, batch: EventBatch, now: float) -> int | None:
        """A batch off the PUB socket. Returns None when it was applied (or waits for a running
        replay), else the seq the shell must replay from (the batch then waits)."""
        if self.state == SYNCING:
            self._wait(seq, batch)
            return None
        if seq == self.last_seq + 1:
            self._apply(seq, batch, now)
            return None
        if seq <= self.replayed_through:
            return None  # sent live while we replayed it
        if seq <= self.last_seq:  # the publisher's numbering started over: the pod restarted
            self.stats["restarts"] += 1
            self.reset()
            self._wait(seq, batch)
            return 0
        self.stats["gaps"] += 1
        self._wait(seq, batch)
        return self.last_seq + 1

    def _wait(self, seq: int, batch: EventBatch) -> None:
        self.pending.append((seq, batch))
        if len(self.pending) > MAX_PENDING:
            del self.pending[0]

    def _apply(self, seq: int, batch: EventBatch, now: float) -> None:
        self.last_seq = seq
        self.last_event_at = now
        self.stats["batches"] += 1
        cap = self.config.max_blocks_per_pod
        blocks = self.engines.setdefault(batch.data_parallel_rank, OrderedDict())
        for event in batch.events:
            if isinstance(event, BlockStored):
                bit = medium_bit(event.medium)
                self.block_size = event.block_size
                if event.lora_name is not None and isinstance(event.lora_id, int):
                    self.adapters.pop(event.lora_name, None)
                    self.adapters[event.lora_name] = event.lora_id
                    if len(self.adapters) > MAX_ADAPTERS:
                        self.adapters.popitem(last=False)
                for h in event.block_hashes:
                    blocks[h] = blocks.pop(h, 0) | bit
                while len(self) > cap and blocks:  # forget the oldest stored: a miss, never a false hit
                    blocks.popitem(last=False)
                    self.stats["evicted"] += 1
            elif isinstance(event, BlockRemoved):
                bit = medium_bit(event.medium)
                for h in event.block_hashes:
                    bits = blocks.get(h)
                    if bits is not None:
                        bits &= ~bit
                        if bits:
                            blocks[h] = bits
                        else:
                            del blocks[h]
            elif isinstance(event, AllBlocksCleared):
                if batch.data_parallel_rank is None:  # the whole pod speaks (a live reshape): every engine
                    for other in self.engines.values():
                        other.clear()
                blocks.clear()

    # -- queries ---------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes | int]) -> float:
        """Leading blocks of `hashes` the pod's best engine holds, each weighted by its best medium."""
        return max((self._match(blocks, hashes) for blocks in self.engines.values()), default=0.0)

    def _match(self, blocks: Mapping[bytes | int, int], hashes: Sequence[bytes | int]) -> float:
        total = 0.0
        for h in hashes:
            bits = blocks.get(h)
            if not bits:
                break
            total += next((w for b, w in self._weights if bits & b), 0.5)  # a medium we have no weight for
        return total

    def trusted(self, now: float, last_routed: float | None) -> bool:
        """Whether the router may rank this pod by its events alone: connected, in sequence, and
        not lagging (no request sent to it over `lag_seconds` ago that no event has followed)."""
        if self.state != LIVE:
            return False
        if last_routed is None:
            return True
        caught_up = self.last_event_at is not None and self.last_event_at >= last_routed
        return caught_up or now - last_routed < self.config.lag_seconds


@dataclass(frozen=True)
class PreciseMatch:
    """The event-fed view of one request: its runtime block hashes' count and, per pod whose
    events are trusted, the weighted blocks it holds (pods absent: use the served-based index)."""

    total_blocks: int
    held: Mapping[str, float]
    partial: Mapping[str, float] = field(default_factory=dict)  # pods with a partial index: a floor
