"""The engine's side of the offload tier: what is stored where, and the hooks that move blocks.

The block managers call two hooks (runtime/engine/block_manager.py): ``tier_lookup`` (does the tier
hold this prefix block?) while looking up a prefix, and ``on_evict`` when a cached block is about
to be overwritten: its content is saved first unless the tier already holds it. The scheduler
calls ``load`` for a prefix hit in the tier (blocks just allocated, filled before the step that
needs them), ``swap_out`` / ``swap_in`` around a preemption, and ``flush`` at the end of every
schedule. Operations go to the executor (``apply``), which runs them on rank 0 at once and sends
them to the other ranks with the next step, before its forward pass; a batch with loads goes to
every rank at once instead, and a key that any rank could not load comes back as failed (the
sequence then takes a shorter prefix and recomputes the rest).

Keys: a prefix block is ``group byte + its prefix-cache hash`` (the hash chains the whole prefix
and the cache salt); a swapped block is ``b"S" + sequence id + group + index`` (private to the
sequence, only ever in the swap space).
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvserve.runtime.engine.prefix_cache import extend_block_hashes
from kvserve.runtime.kv_offload.index import SWAP, TierIndex, preemption_choice
from kvserve.runtime.kv_offload.offloader import SWAP as SWAP_STORE
from kvserve.runtime.kv_offload.offloader import TIER as TIER_STORE

log = logging.getLogger(__name__)

# Rates before any is measured: a conservative host copy, and a prefill rate that only a fast
# device beats; both are replaced by moving averages of what the engine observes.
DEFAULT_TRANSFER_BYTES_PER_S = 2e9
DEFAULT_PREFILL_TOKENS_PER_S = 5e3


def tier_key(group: int, block_hash: bytes) -> bytes:
    return bytes((group,)) + block_hash


def swap_key(seq_id: int, group: int, index: int) -> bytes:
    return b"S" + struct.pack("<QBI", seq_id, group, index)


@dataclass
class OffloadStats:
    """Totals since start (the server renders them as counters)."""

    queries_tokens: int = 0  # tokens looked up while the tier is on (vllm:external_prefix_cache_queries)
    hit_tokens: int = 0  # tokens loaded from the tier instead of computed (vllm:external_prefix_cache_hits)
    hit_blocks: int = 0
    stored_blocks: int = 0
    failed_loads: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_bytes: int = 0


@dataclass
class SwapState:
    """A swapped-out sequence: how many tokens its saved blocks hold, how many leading entries of
    each group's table were FREED (behind a sliding window: not saved, never read again), and
    the saved blocks' (group, table index, key)."""

    num_computed_tokens: int
    num_freed: tuple[int, ...]
    saved: list[tuple[int, int, bytes]]

    @property
    def keys(self) -> list[bytes]:
        return [key for _, _, key in self.saved]


class OffloadManager:
    def __init__(self, *, apply: Callable[[list[tuple]], list[bytes]], block_bytes: Sequence[int], block_size: int,
                 tier_bytes: int, swap_bytes: int, medium: str = "CPU",
                 existing: Sequence[tuple[bytes, int]] = ()) -> None:
        self._apply = apply
        self.block_bytes = list(block_bytes)
        self.block_size = block_size
        self.tier = TierIndex(tier_bytes) if tier_bytes > 0 else None
        self.swap = TierIndex(swap_bytes) if swap_bytes > 0 else None
        self.medium = medium
        self.stats = OffloadStats()
        # A KV event sink (runtime/kv_events/events.py): the tier's stores and removals of the
        # reference group's blocks, with vLLM's medium ("CPU" or "DISK").
        self.events = None
        self._ops: list[tuple] = []
        self._pinned: set[bytes] = set()
        self._prefetched: OrderedDict[int, None] = OrderedDict()  # seq ids read ahead already
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S
        self.transfer_bytes_per_s = DEFAULT_TRANSFER_BYTES_PER_S
        if self.tier is not None:
            dropped = []
            for key, nbytes in existing:  # a warm restart: the directory's blocks, oldest first
                group = key[0]
                if group >= len(self.block_bytes) or nbytes != self.block_bytes[group]:
                    dropped.append(key)
                    continue
                evicted = self.tier.add(key, nbytes)
                dropped += [key] if evicted is None else evicted
            self._ops += [("drop", TIER_STORE, k) for k in dropped]
            if len(self.tier):
                log.info("kv offload: %d blocks (%.1f MiB) found in the tier", len(self.tier),
                         self.tier.used_bytes / 2**20)

    def attach_events(self, sink) -> None:
        """Reports the tier's stores and removals into `sink` (None: off), starting with a
        BlockStored for every block the tier holds already (a persistent tier found at a start
        or a reshape): a subscriber whose index was cleared learns them now, not when each is
        stored again. Those carry no parent or tokens (the files keep neither), one block each,
        so no chain between them is implied."""
        self.events = sink
        if sink is None or self.tier is None:
            return
        for key in self.tier.keys():  # oldest first, as the tier will drop them
            if key[0] == 0:
                sink.stored([key[1:]], None, (), medium=self.medium)

    # -- hooks for the block managers ------------------------------------------------------------
    def tier_lookup(self, group: int) -> Callable[[bytes], bool] | None:
        if self.tier is None:
            return None
        tier = self.tier
        return lambda h: tier_key(group, h) in tier

    def on_evict(self, group: int, meta: Callable[[int], tuple | None] | None = None
                 ) -> Callable[[int, bytes], None] | None:
        """The hook for group `group`'s pool; `meta(block)` gives a block's (parent hash, token
        ids, adapter identity) for the tier's BlockStored events (the pool keeps them while KV
        events are on)."""
        if self.tier is None:
            return None

        def evict(block: int, block_hash: bytes) -> None:
            key = tier_key(group, block_hash)
            if self.tier.touch(key):
                return  # already stored (it was loaded from the tier, or saved before)
            evicted = self.tier.add(key, self.block_bytes[group], self._pinned)
            if evicted is None:
                return
            self._drop_tier(evicted)
            self._ops.append(("save", TIER_STORE, group, block, key))
            self.stats.stored_blocks += 1
            if self.events is not None and group == 0:
                # Like the pool's own BlockStored, so an indexer that rehashes tokens sees it.
                parent, tokens, lora = (meta(block) if meta is not None else None) or (None, (), None)
                self.events.stored([block_hash], parent, tokens, medium=self.medium, lora=lora)
        return evict

    def _drop_tier(self, keys: list[bytes]) -> None:
        for k in keys:
            self._ops.append(("drop", TIER_STORE, k))
        if self.events is not None:
            self.events.removed([k[1:] for k in keys if k[0] == 0], medium=self.medium)

    # -- the scheduler's calls -------------------------------------------------------------------
    def pin(self, keys: list[bytes]) -> None:
        """Keys about to be loaded: not evicted from the tier meanwhile (eviction saves may add)."""
        self._pinned = set(keys)

    def load(self, loads: list[tuple[int, int, int]], hashes: Sequence[bytes]) -> bool:
        """Fills freshly allocated blocks from the tier: `loads` are (group, table index, block),
        `hashes` the sequence's block hashes. False if any failed (their keys are forgotten)."""
        ops = [("load", TIER_STORE, g, block, tier_key(g, hashes[i])) for g, i, block in loads]
        failed = self._run(ops)
        if failed:
            self.stats.failed_loads += len(failed)
            for k in failed:
                self.tier.remove(k)
            self._drop_tier(failed)
            return False
        for _, _, _, _, key in ops:
            self.tier.touch(key)
        self.stats.hit_blocks += len(loads)
        return True

    def prefetch(self, waiting: Iterable, bm) -> None:
        """Asks the ranks to read ahead the file-tier blocks the next waiting requests' prefixes
        will load (once per request), so admission copies bytes already in memory."""
        if self.tier is None or self.medium != "DISK" or not getattr(bm, "enable_caching", False):
            return
        managers = getattr(bm, "managers", None) or [bm]  # KV cache groups: the full group first
        for seq in waiting:
            if seq.seq_id in self._prefetched or seq.swapped is not None or seq.num_computed_tokens:
                continue
            self._prefetched[seq.seq_id] = None
            if len(self._prefetched) > 1024:
                self._prefetched.popitem(last=False)
            extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, bm.block_size, seq.cache_extra)
            keys, n = [], 0
            for h in seq.block_hashes:  # the prefix lookup's walk: pool or tier, up to a miss
                if h not in managers[0].cached:
                    key = tier_key(0, h)
                    if key not in self.tier:
                        break
                    keys.append(key)
                n += 1
            # A window group loads only the blocks inside the hit's window (a hint: the lookup may
            # still shorten the hit).
            for group, m in enumerate(managers[1:], 1):
                for h in seq.block_hashes[m.first_live_block(min(n * bm.block_size, seq.num_tokens - 1)):n]:
                    if h not in m.cached and tier_key(group, h) in self.tier:
                        keys.append(tier_key(group, h))
            if keys:
                self._ops.append(("prefetch", TIER_STORE, keys))

    def count_query(self, num_tokens: int, hit_tokens: int) -> None:
        self.stats.queries_tokens += num_tokens
        self.stats.hit_tokens += hit_tokens

    def swap_out(self, seq_id: int, tables: Sequence[Sequence[int]], num_computed_tokens: int) -> SwapState | None:
        """Saves a preempted sequence's blocks (`tables`: its table in every KV cache group) to
        the swap space when that is cheaper than recomputing them (and they fit); returns its
        SwapState, or None to recompute. Blocks given back behind a sliding window (leading FREED
        entries) are not saved: no later query reads them."""
        if self.swap is None or num_computed_tokens <= 0:
            return None
        n = -(-num_computed_tokens // self.block_size)
        num_freed, saved, nbytes = [], [], 0
        for group, table in enumerate(tables):
            blocks = table[:n]
            freed = next((i for i, b in enumerate(blocks) if b >= 0), len(blocks))
            if len(blocks) < n or any(b < 0 for b in blocks[freed:]):
                return None
            num_freed.append(freed)
            saved += [(group, i, blocks[i]) for i in range(freed, n)]
            nbytes += (n - freed) * self.block_bytes[group]
        choice = preemption_choice(num_computed_tokens=num_computed_tokens, swap_bytes=nbytes,
                                   swap_free_bytes=self.swap.free_bytes,
                                   prefill_tokens_per_s=self.prefill_tokens_per_s,
                                   transfer_bytes_per_s=self.transfer_bytes_per_s)
        if choice != SWAP:
            return None
        state = SwapState(num_computed_tokens, tuple(num_freed), [])
        for group, i, block in saved:
            key = swap_key(seq_id, group, i)
            self.swap.add(key, self.block_bytes[group])
            self._ops.append(("save", SWAP_STORE, group, block, key))
            state.saved.append((group, i, key))
        self.stats.swap_outs += 1
        self.stats.swapped_bytes += nbytes
        return state

    def swap_in(self, state: SwapState, tables: Sequence[Sequence[int]]) -> bool:
        """Loads a swapped sequence's blocks into its new tables (one per KV cache group, from
        ``resume``); the swap space forgets them."""
        ops = [("load", SWAP_STORE, group, tables[group][i], key) for group, i, key in state.saved]
        failed = self._run(ops)
        self.discard(state)
        if failed:
            self.stats.failed_loads += len(failed)
            return False
        self.stats.swap_ins += 1
        return True

    def discard(self, state: SwapState) -> None:
        for key in state.keys:
            if self.swap.remove(key):
                self._ops.append(("drop", SWAP_STORE, key))

    def flush(self) -> None:
        """Sends the queued saves and drops (the end of every schedule, and before any load)."""
        if self._ops:
            ops, self._ops = self._ops, []
            self._apply(ops)

    def _run(self, ops: list[tuple]) -> list[bytes]:
        ops, self._ops = self._ops + ops, []
        return self._apply(ops)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A moving average of prefill throughput (the recompute side of preemption_choice)."""
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = 0.8 * self.prefill_tokens_per_s + 0.2 * tokens / seconds

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.transfer_bytes_per_s = 0.8 * self.transfer_bytes_per_s + 0.2 * nbytes / seconds

    def save_cached(self, cached_per_group: Sequence[dict[bytes, int]],
                    meta_per_group: Sequence[Callable[[int], tuple | None]] | None = None) -> int:
        """Saves every cached pool block the tier lacks (a persistent tier before shutdown, so a
        restart finds what was in the pool too); returns how many."""
        if self.tier is None:
            return 0
        n = 0
        for group, cached in enumerate(cached_per_group):
            evict = self.on_evict(group, meta_per_group[group] if meta_per_group else None)
            for block_hash, block in list(cached.items()):
                if tier_key(group, block_hash) not in self.tier:
                    evict(block, block_hash)
                    n += 1
        self.flush()
        return n
