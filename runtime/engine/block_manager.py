"""Who owns which KV block: a free list, per-sequence block tables and reference counts.

Pure bookkeeping (no torch). A block's reference count is the number of block tables that list
it; a block is on the free list exactly when its count is 0. Sharing is already modelled so that
later features slot in without a rewrite:

- ``fork(parent, child)`` gives a child the parent's table with every count incremented (n > 1,
  beam search). Before a sequence writes into a block that another table also lists,
  ``allocate_slots`` swaps in a private copy and reports ``(src, dst)`` pairs for the caller to
  copy on the device (copy-on-write).
- Prefix caching (``enable_caching``) keys full, computed blocks by a hash chain
  (runtime/engine/prefix_cache.py). A freed block keeps its key and stays reusable until it is popped
  for something else: the free list is an insertion-ordered dict, cached blocks join it at the
  end (least recently used first out) and key-less blocks at the front (reused before any cached
  one). A hit takes the block back (off the free list if nobody held it).
- A cached block's contents never change: writes go to positions past the cached prefix, or,
  for the one recomputed last token of a fully cached prompt, into a private copy when the block
  is shared (copy-on-write) or in place with the identical K/V when it is not.
- Sliding window (``sliding_window`` w, for models whose every layer attends within w tokens):
  a query at position p reads only positions > p - w, so once a sequence's next query is at
  position c (its computed length), every block wholly before c - w + 1 is dead for it.
  ``release_behind_window`` gives those back (their table entries become ``FREED``, keeping
  positions aligned with table indices), so a long sequence holds about w + one step of tokens,
  not its whole context. A prefix-cache hit then needs only the blocks inside the window of the
  hit's end: the blocks before it may have been evicted, and come back as ``FREED`` entries.
- Offload tier (runtime/kv_offload/, only when configured): ``tier_lookup`` extends a prefix hit
  with blocks the tier holds (``TIER`` entries; ``take_prefix`` gives each a fresh block and
  returns it for the caller to load), and ``on_evict`` sees every cached block just before it is
  reused, so its content can be copied out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvserve.runtime.engine.prefix_cache import BlockHash

if TYPE_CHECKING:
    from kvserve.runtime.kv_events.events import KVEventSink

# Block-table entry of a block given back because it lies wholly behind the sliding window.
FREED = -1
# Prefix-lookup entry of a block the offload tier holds (never in a block table).
TIER = -2


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking ``can_allocate`` first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self._num_freed: dict[int, int] = {}  # seq -> leading FREED entries of its table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.enable_caching = enable_caching
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # key -> block holding that content
        self._num_registered: dict[int, int] = {}  # seq -> leading blocks already keyed
        # The offload tier's hooks (None: no tier, and no extra work).
        self.tier_lookup: Callable[[BlockHash], bool] | None = None
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # KV events (runtime/kv_events): told of every key this pool gains, evicts or forgets.
        self.events: KVEventSink | None = None
        # With events on, each keyed block's (parent hash, token ids) until it is evicted: the
        # offload tier's BlockStored for an evicted block carries them like the pool's did.
        self.stored_meta: dict[int, tuple[BlockHash | None, tuple[int, ...], tuple[int, str] | None]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_kv_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of `num_kv_tokens` K/V slots ever holds at once when each
        step computes at most `max_step_tokens` of them: all of them without a window; with one,
        the window before a step plus the step, at the worst block alignment."""
        whole = self.blocks_for_tokens(num_kv_tokens)
        if self.sliding_window is None:
            return whole
        span = self.sliding_window - 1 + min(max_step_tokens, num_kv_tokens)
        return min(whole, self.blocks_for_tokens(span) + 1)

    def fits(self, num_kv_tokens: int, max_step_tokens: int) -> bool:
        """Whether the whole pool could ever hold one such sequence (``max_blocks_held``)."""
        return self.max_blocks_held(num_kv_tokens, max_step_tokens) <= self.num_blocks

    def first_live_block(self, num_computed: int) -> int:
        """Index of the first block a query at position `num_computed` (or later) can read."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def num_new_blocks_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Blocks to take from the free list so that slots [0, num_computed + num_new) exist and
        the ones being written are private to this sequence."""
        table = self.block_tables.get(seq_id, [])
        needed = max(0, self.blocks_for_tokens(num_computed + num_new) - len(table))
        first, last = num_computed // self.block_size, min(len(table), self.blocks_for_tokens(num_computed + num_new))
        needed += sum(1 for i in range(first, last) if self.ref_counts[table[i]] > 1)
        return needed

    def can_allocate(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        return self.num_new_blocks_needed(seq_id, num_computed, num_new) <= len(self._free)

    # -- prefix caching --------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (empty when caching is off).

        With a sliding window, a prefix of n blocks is a hit when the blocks a query at its end
        can read (from ``first_live_block(n * block_size - 1)`` on) are cached; the entries before
        them are ``FREED``."""
        blocks: list[int] = []
        if not self.enable_caching:
            return blocks
        tier = self.tier_lookup
        if self.sliding_window is None:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    if tier is None or not tier(h):
                        break
                    block = TIER
                blocks.append(block)
            return blocks
        best, run_start = 0, 0
        for j, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None and tier is not None and tier(h):
                block = TIER
            blocks.append(block if block is not None else FREED)
            if block is None:
                run_start = j + 1
            # The scheduler recomputes from position n * block_size - 1 at the earliest.
            elif run_start <= self.first_live_block((j + 1) * self.block_size - 1):
                best = j + 1
        first = self.first_live_block(best * self.block_size - 1) if best else 0
        return [FREED] * first + blocks[first:best]

    def can_allocate_with_prefix(self, prefix: Sequence[int], num_computed: int, num_new: int) -> bool:
        """Whether a sequence without blocks can take `prefix` and then write slots
        [num_computed, num_computed + num_new)."""
        end = self.blocks_for_tokens(num_computed + num_new)
        needed = max(0, end - len(prefix))
        # A written prefix block someone else holds is copied first.
        needed += sum(1 for i in range(num_computed // self.block_size, min(len(prefix), end))
                      if prefix[i] >= 0 and self.ref_counts[prefix[i]] >= 1)
        if self.tier_lookup is not None:
            needed += sum(1 for b in prefix if b == TIER)  # each loaded into a fresh block
        revived = sum(1 for b in prefix if b >= 0 and self.ref_counts[b] == 0)
        return needed <= len(self._free) - revived

    def take_prefix(self, seq_id: int, prefix: Sequence[int]) -> list[tuple[int, int]]:
        """Gives a sequence without blocks the cached blocks `prefix` (from ``lookup``). Returns
        (table index, block) of each ``TIER`` entry, now a fresh block for the caller to load and
        then key with ``key_loaded``."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        for block in prefix:
            if block < 0:
                continue
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        table = list(prefix)
        loads = []
        if self.tier_lookup is not None:
            # After the pool's own hits are held, so making room never evicts one of them.
            for i, block in enumerate(table):
                if block == TIER:
                    table[i] = self._pop_free()
                    loads.append((i, table[i]))
        self.block_tables[seq_id] = table
        self._num_registered[seq_id] = len(prefix)
        self._num_freed[seq_id] = sum(1 for b in prefix if b == FREED)
        return loads

    def key_loaded(self, hashes: Sequence[BlockHash], loads: Sequence[tuple[int, int]],
                   token_ids: Sequence[int] | None = None, lora_int_id: int = 0) -> None:
        """Keys blocks just loaded from the offload tier (`loads` from ``take_prefix``);
        `token_ids` (the sequence's) and its adapter only feed the KV events' BlockStored."""
        self._key_blocks(loads, hashes, token_ids, lora_int_id)

    def register(self, seq_id: int, hashes: Sequence[BlockHash], token_ids: Sequence[int] | None = None,
                 lora_int_id: int = 0) -> None:
        """Keys the sequence's leading full, computed blocks; `hashes[i]` is block i's key.
        A block whose content is already cached elsewhere stays unkeyed (one block per key).
        `token_ids` (the sequence's) and its adapter only feed the KV events' BlockStored."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(seq_id, [])
        start = self._num_registered.get(seq_id, 0)
        end = min(len(hashes), len(table))
        self._key_blocks(((i, table[i]) for i in range(start, end) if table[i] != FREED), hashes, token_ids,
                         lora_int_id)
        if end > start:
            self._num_registered[seq_id] = end

    def _key_blocks(self, blocks: Iterable[tuple[int, int]], hashes: Sequence[BlockHash],
                    token_ids: Sequence[int] | None, lora_int_id: int = 0) -> None:
        """Keys each (index, block) whose content is not cached yet (one block per key); with KV
        events, each run of consecutive newly keyed indices is one BlockStored."""
        run: list[int] = []
        # The adapter's (lora_id, lora_name) as of now: an offload tier's event for the block
        # names it when the pool evicts it, by which time the int id may name another adapter.
        resolve = getattr(self.events, "lora_identity", None) if lora_int_id else None
        lora = resolve(lora_int_id) if resolve is not None else None
        for i, block in blocks:
            h = hashes[i]
            if self.block_hashes[block] is None and h not in self.cached:
                self.block_hashes[block] = h
                self.cached[h] = block
                if self.events is not None:
                    size = self.block_size
                    self.stored_meta[block] = (hashes[i - 1] if i else None,
                                               tuple(token_ids[i * size:(i + 1) * size]) if token_ids else (), lora)
                    if run and run[-1] != i - 1:
                        self._report_stored(run, hashes, token_ids, lora_int_id)
                        run = []
                    run.append(i)
        if run:
            self._report_stored(run, hashes, token_ids, lora_int_id)

    def _report_stored(self, run: list[int], hashes: Sequence[BlockHash], token_ids: Sequence[int] | None,
                       lora_int_id: int = 0) -> None:
        first, last, size = run[0], run[-1], self.block_size
        tokens = [] if token_ids is None else token_ids[first * size:(last + 1) * size]
        self.events.stored([hashes[i] for i in run], hashes[first - 1] if first else None, tokens,
                           lora_int_id=lora_int_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drops the blocks past the first `num_tokens` slots (speculative rollback)."""
        table = self.block_tables.get(seq_id)
        if not table:
            return
        keep = self.blocks_for_tokens(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
        if self._num_registered.get(seq_id, 0) > keep:
            self._num_registered[seq_id] = keep

    def release_behind_window(self, seq_id: int, num_computed: int) -> int:
        """Gives back the blocks of `seq_id` that no query at position >= `num_computed` can read
        (none without a sliding window). Returns how many entries became FREED."""
        table = self.block_tables.get(seq_id)
        if self.sliding_window is None or not table:
            return 0
        start = self._num_freed.get(seq_id, 0)
        end = min(self.first_live_block(num_computed), len(table))
        for i in range(start, end):
            if table[i] != FREED:
                self._release(table[i])
                table[i] = FREED
        if end > start:
            self._num_freed[seq_id] = end
        return max(0, end - start)

    def reset_prefix_cache(self) -> None:
        """Forgets every key (blocks in use keep their contents)."""
        self.block_hashes = [None] * self.num_blocks
        self.cached.clear()
        self._num_registered.clear()
        self.stored_meta.clear()
        if self.events is not None:
            self.events.cleared()

    # -- mutations -------------------------------------------------------------------------------
    def resume(self, seq_id: int, num_freed: int, num_tokens: int) -> bool:
        """Gives a sequence without blocks a table for slots [0, num_tokens) whose first
        `num_freed` entries are FREED (a swapped-out sequence's blocks behind its window, never
        read again) and the rest fresh blocks; False (nothing changed) if too few are free."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        fresh = self.blocks_for_tokens(num_tokens) - num_freed
        if fresh > len(self._free):
            return False
        self.block_tables[seq_id] = [FREED] * num_freed + [self._pop_free() for _ in range(fresh)]
        self._num_freed[seq_id] = num_freed
        self._num_registered[seq_id] = 0
        return True

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """Makes slots [num_computed, num_computed + num_new) writable for `seq_id`.

        Returns copy-on-write pairs (src_block, dst_block) whose contents the caller must copy
        before writing. All-or-nothing: raises NoFreeBlocksError and changes nothing if the
        free list is too short.
        """
        if self.num_new_blocks_needed(seq_id, num_computed, num_new) > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id} needs more KV blocks than are free")
        table = self.block_tables.setdefault(seq_id, [])
        end_block = self.blocks_for_tokens(num_computed + num_new)
        copies = []
        for i in range(num_computed // self.block_size, min(len(table), end_block)):
            if self.ref_counts[table[i]] > 1:
                src = table[i]
                dst = self._pop_free()
                self.ref_counts[src] -= 1
                table[i] = dst
                copies.append((src, dst))
        while len(table) < end_block:
            table.append(self._pop_free())
        return copies

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (copy-on-write on its next write)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq_id} already has a block table")
        table = list(self.block_tables.get(parent_seq_id, []))
        for block in table:
            if block != FREED:
                self.ref_counts[block] += 1
        self.block_tables[child_seq_id] = table
        if parent_seq_id in self._num_registered:
            self._num_registered[child_seq_id] = self._num_registered[parent_seq_id]
        if parent_seq_id in self._num_freed:
            self._num_freed[child_seq_id] = self._num_freed[parent_seq_id]

    def free(self, seq_id: int) -> None:
        """Releases every block of `seq_id`; unknown ids are ignored (free is idempotent)."""
        table = self.block_tables.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._num_freed.pop(seq_id, None)
        if not table:
            return
        # Reversed so the sequence's tail blocks, least likely shared by a future prefix, are
        # reused first.
        for block in reversed(table):
            self._release(block)

    def _release(self, block: int) -> None:
        if block == FREED:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self.block_hashes[block] is None:
                self._free.move_to_end(block, last=False)

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self.block_hashes[block]
        if h is not None:  # evict: the content is about to be overwritten
            if self.on_evict is not None:
                self.on_evict(block, h)
            self.block_hashes[block] = None
            del self.cached[h]
            self.stored_meta.pop(block, None)
            if self.events is not None:
                self.events.removed([h])
        self.ref_counts[block] = 1
        return block

    # -- invariants (tests and debugging) --------------------------------------------------------
    def check_invariants(self) -> None:
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                if block != FREED:
                    counts[block] += 1
        assert counts == self.ref_counts, "reference counts disagree with the block tables"
        for block in range(self.num_blocks):
            assert (block in self._free) == (counts[block] == 0), f"block {block} free-list state"
        for seq_id, table in self.block_tables.items():
            live = [b for b in table if b != FREED]
            assert len(set(live)) == len(live), "a block is listed twice in one table"
            freed = self._num_freed.get(seq_id, 0)
            assert all(b == FREED for b in table[:freed]) and FREED not in table[freed:], \
                "FREED entries must be exactly the table's leading ones"
        for h, block in self.cached.items():
            assert self.block_hashes[block] == h, f"cached key of block {block} disagrees"
        assert len(self.cached) == sum(h is not None for h in self.block_hashes), "unindexed keyed block"
