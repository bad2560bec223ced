"""Pure policy of the offload tier: which keys a store holds, and swap versus recompute.

``TierIndex`` is the engine's authoritative view of one store (the tier, or the swap space): an
LRU of keys with their sizes under a byte budget. Every rank's store obeys the same sequence of
adds and drops, so at tensor parallelism they hold the same keys (each its own shard).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class TierIndex:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """Oldest (next to go) first."""
        return list(self._entries)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def touch(self, key: bytes) -> bool:
        """Marks a key as just used; False if it is not held."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def add(self, key: bytes, nbytes: int, pinned: Iterable[bytes] = ()) -> list[bytes] | None:
        """Makes room for and records `key` (most recently used); returns the keys evicted for it,
        or None (and changes nothing) when it cannot fit even with every unpinned key gone.
        Keys in `pinned` (about to be read) are never evicted."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return []
        pinned = set(pinned)
        evictable = sum(n for k, n in self._entries.items() if k not in pinned) if pinned else self.used_bytes
        if nbytes > self.free_bytes + evictable:
            return None
        evicted = []
        for k in list(self._entries):
            if self.used_bytes + nbytes <= self.capacity_bytes:
                break
            if k in pinned:
                continue
            self.used_bytes -= self._entries.pop(k)
            evicted.append(k)
        self._entries[key] = nbytes
        self.used_bytes += nbytes
        return evicted

    def remove(self, key: bytes) -> bool:
        n = self._entries.pop(key, None)
        if n is None:
            return False
        self.used_bytes -= n
        return True


SWAP, RECOMPUTE = "swap", "recompute"


def preemption_choice(*, num_computed_tokens: int, swap_bytes: int, swap_free_bytes: int,
                      prefill_tokens_per_s: float, transfer_bytes_per_s: float) -> str:
    """Whether a preempted sequence is swapped out (its blocks copied out now and back on resume:
    `swap_bytes` each way) or recomputed (its `num_computed_tokens` prefilled again): whichever
    the measured rates say is faster. Swap needs room for every block."""
    if swap_bytes <= 0 or num_computed_tokens <= 0 or swap_bytes > swap_free_bytes:
        return RECOMPUTE
    if transfer_bytes_per_s <= 0:
        return RECOMPUTE
    if prefill_tokens_per_s <= 0:
        return SWAP
    swap_s = 2 * swap_bytes / transfer_bytes_per_s
    recompute_s = num_computed_tokens / prefill_tokens_per_s
    return SWAP if swap_s < recompute_s else RECOMPUTE
