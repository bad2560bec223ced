"""Who owns which KV block: a free list, per-sequence block tables and reference counts.

Pure bookkeeping (no torch). A block's reference count is the number of block tables that list
it; a block is on the free list exactly when its count is 0. Sharing is already modelled so that
later features slot in without a rewrite:

- ``fork(parent, child)`` gives a child the parent's table with every count incremented (n > 1,
  beam search). Before a sequence writes into a block that another table also lists,
  ``allocate_slots`` swaps in a private copy and reports ``(src, dst)`` pairs for the caller to
  copy on the device (copy-on-write).
- Prefix caching will key full blocks by a hash chain (hash(parent_hash, block tokens)): a free
  block with a hash stays reusable until it is popped for something else, which is why the free
  list is an insertion-ordered dict (LRU order, O(1) removal of an arbitrary block).
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking ``can_allocate`` first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}

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

    # -- mutations -------------------------------------------------------------------------------
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
            self.ref_counts[block] += 1
        self.block_tables[child_seq_id] = table

    def free(self, seq_id: int) -> None:
        """Releases every block of `seq_id`; unknown ids are ignored (free is idempotent)."""
        table = self.block_tables.pop(seq_id, None)
        if not table:
            return
        # Reversed so the sequence's tail blocks, least likely shared by a future prefix, are
        # reused first.
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    # -- invariants (tests and debugging) --------------------------------------------------------
    def check_invariants(self) -> None:
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "reference counts disagree with the block tables"
        for block in range(self.num_blocks):
            assert (block in self._free) == (counts[block] == 0), f"block {block} free-list state"
        for table in self.block_tables.values():
            assert len(set(table)) == len(table), "a block is listed twice in one table"
