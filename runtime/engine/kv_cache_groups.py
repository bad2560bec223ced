"""KV cache groups: one block table and one pool of blocks per kind of attention layer.

A model whose layers mix full attention and a sliding window (Gemma 2/3, Qwen2 with
``max_window_layers``) cannot give back the blocks behind the window if one block table serves
every layer: the global layers still read them. Splitting the layers into groups by window (the
idea of vLLM V1's hybrid KV cache manager) lets each group keep its own block tables: the
full-attention group keeps every block of a sequence, the sliding-window group gives back the
blocks wholly behind its window (``BlockManager.release_behind_window``), so its memory is about
window + one step per sequence at any context length.

Here each group is its own pool: the layers' K/V tensors are per layer already, so a group's
layers get as many blocks as that group was given, and block ids are per group.
``KVCacheCoordinator`` runs one ``BlockManager`` per group and offers the scheduler the same
calls a single ``BlockManager`` does, each applied to every group: admission and growth succeed
only when every group can allocate (checked first, so a failure changes nothing), preemption and
``free`` release every group, copy-on-write pairs come back tagged with their group, and a
prefix-cache hit is the longest prefix every group can serve (the window group needs only the
blocks inside the hit's window). A model with one group keeps the plain ``BlockManager``.

Pure bookkeeping (no torch): table and property tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.prefix_cache import BlockHash


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: the same attention window (None: full attention)."""

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i attends within `layer_windows[i]` (None: every
    position). Full attention first (it holds every position, so its table is the reference one),
    then the windows from widest to narrowest."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, -(w or 0)))
    return tuple(KVCacheGroup(w, tuple(by_window[w])) for w in order)


def hybrid_group_blocks(groups: Sequence[KVCacheGroup], *, budget_blocks: float, block_size: int,
                        max_model_len: int, max_step_tokens: int) -> list[int]:
    """Blocks per group out of a budget of `budget_blocks` whole-model blocks (a block of every
    layer), split in proportion to what one sequence of `max_model_len` tokens holds in each
    group when a step computes at most `max_step_tokens` of it, so the pools run out together at
    that length. A window group never gets less than that one sequence's bound (which serves a
    sequence of any length), so a budget below one max-length sequence still serves whatever
    the first group's share holds; the first group takes what the others leave."""
    need = [BlockManager(1, block_size, sliding_window=g.window).max_blocks_held(max_model_len, max_step_tokens)
            for g in groups]
    layer_blocks = budget_blocks * sum(len(g.layers) for g in groups)
    # A sequence at max_model_len takes sum(len * need) layer-blocks.
    sequences = layer_blocks / sum(len(g.layers) * n for g, n in zip(groups, need))
    rest = [max(n, int(sequences * n)) for n in need[1:]]
    first = int((layer_blocks - sum(len(g.layers) * n for g, n in zip(groups[1:], rest))) / len(groups[0].layers))
    return [max(0, first)] + rest


@dataclass
class GroupPrefix:
    """A prefix-cache hit of ``len(self)`` blocks: each group's blocks for it (``FREED`` where a
    window group does not need them)."""

    per_group: list[list[int]]

    def __len__(self) -> int:
        return len(self.per_group[0])

    def __bool__(self) -> bool:
        return len(self) > 0


class KVCacheCoordinator:
    """One BlockManager per KV cache group, driven together (the scheduler's view of them is the
    one BlockManager's interface). Copy-on-write pairs are ``(group, src, dst)`` triples."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: Sequence[int], block_size: int,
                 enable_caching: bool = False) -> None:
        if len(groups) != len(num_blocks) or not groups:
            raise ValueError(f"num_blocks: need one count per KV cache group ({len(groups)}), got {list(num_blocks)}")
        self.groups = tuple(groups)
        self.managers = [BlockManager(n, block_size, enable_caching=enable_caching, sliding_window=g.window)
                         for g, n in zip(groups, num_blocks)]
        self.block_size = block_size
        self.enable_caching = enable_caching

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """The reference (first, widest) group's blocks: its token slots are the context tokens
        the cache holds at once."""
        return self.managers[0].num_blocks

    @property
    def usage(self) -> float:
        """The fullest group's fraction in use: admission stops when any group runs out."""
        return max(m.usage for m in self.managers)

    @property
    def num_used_blocks(self) -> int:
        """``usage`` in the reference group's blocks (0 exactly when nothing is held)."""
        if all(m.num_used_blocks == 0 for m in self.managers):
            return 0
        return max(1, round(self.usage * self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def block_tables(self) -> dict[int, list[int]]:
        """The reference group's tables (sequence -> blocks)."""
        return self.managers[0].block_tables

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.managers[0].get_block_table(seq_id)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """The reference group's blocks for `num_tokens` (a full-attention sequence's table)."""
        return self.managers[0].blocks_for_tokens(num_tokens)

    def group_tables(self, seq_id: int) -> tuple[list[int], ...]:
        """The sequence's block table in every group (copies)."""
        return tuple(list(m.get_block_table(seq_id)) for m in self.managers)

    def fits(self, num_kv_tokens: int, max_step_tokens: int) -> bool:
        return all(m.fits(num_kv_tokens, max_step_tokens) for m in self.managers)

    def can_allocate(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        return all(m.can_allocate(seq_id, num_computed, num_new) for m in self.managers)

    # -- prefix caching --------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> GroupPrefix:
        """The longest prefix every group can serve. A full group serves every prefix of its
        longest hit, a window group only those whose window is cached, so shrink to the shortest
        answer until all agree (each round strictly shortens it)."""
        n = len(hashes)
        while True:
            per_group = [m.lookup(hashes[:n]) for m in self.managers]
            shortest = min(len(p) for p in per_group)
            if shortest == n or shortest == 0:
                return GroupPrefix([p[:shortest] for p in per_group] if shortest else [[] for _ in per_group])
            n = shortest

    def can_allocate_with_prefix(self, prefix: GroupPrefix, num_computed: int, num_new: int) -> bool:
        return all(m.can_allocate_with_prefix(p, num_computed, num_new)
                   for m, p in zip(self.managers, prefix.per_group))

    def take_prefix(self, seq_id: int, prefix: GroupPrefix) -> list[tuple[int, int, int]]:
        """Every group's blocks of the hit; returns the (group, table index, block) to load from
        the offload tier."""
        if any(m.get_block_table(seq_id) for m in self.managers):
            raise ValueError(f"sequence {seq_id} already has blocks")
        return [(g, i, b) for g, (m, p) in enumerate(zip(self.managers, prefix.per_group))
                for i, b in m.take_prefix(seq_id, p)]

    def key_loaded(self, hashes: Sequence[BlockHash], loads: Sequence[tuple[int, int, int]],
                   token_ids: Sequence[int] | None = None, lora_int_id: int = 0) -> None:
        for g, m in enumerate(self.managers):
            m.key_loaded(hashes, [(i, b) for lg, i, b in loads if lg == g], token_ids, lora_int_id)

    def register(self, seq_id: int, hashes: Sequence[BlockHash], token_ids: Sequence[int] | None = None,
                 lora_int_id: int = 0) -> None:
        for m in self.managers:
            m.register(seq_id, hashes, token_ids, lora_int_id)

    def reset_prefix_cache(self) -> None:
        for m in self.managers:
            m.reset_prefix_cache()

    # -- mutations -------------------------------------------------------------------------------
    def resume(self, seq_id: int, num_freed: Sequence[int], num_tokens: int) -> bool:
        """``BlockManager.resume`` in every group (`num_freed` per group), or in none."""
        if not all(m.blocks_for_tokens(num_tokens) - f <= m.num_free_blocks for m, f in zip(self.managers, num_freed)):
            return False
        for m, f in zip(self.managers, num_freed):
            m.resume(seq_id, f, num_tokens)
        return True

    def release_behind_window(self, seq_id: int, num_computed: int) -> int:
        return sum(m.release_behind_window(seq_id, num_computed) for m in self.managers)

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int, int]]:
        """Every group's slots [num_computed, num_computed + num_new), or NoFreeBlocksError from
        the first group that cannot, before any group has changed."""
        for m in self.managers:
            if not m.can_allocate(seq_id, num_computed, num_new):
                m.allocate_slots(seq_id, num_computed, num_new)  # raises, changing nothing
        return [(g, src, dst) for g, m in enumerate(self.managers)
                for src, dst in m.allocate_slots(seq_id, num_computed, num_new)]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        for m in self.managers:
            m.truncate(seq_id, num_tokens)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        if any(child_seq_id in m.block_tables for m in self.managers):
            raise ValueError(f"sequence {child_seq_id} already has a block table")
        for m in self.managers:
            m.fork(parent_seq_id, child_seq_id)

    def free(self, seq_id: int) -> None:
        for m in self.managers:
            m.free(seq_id)

    # -- invariants (tests and debugging) --------------------------------------------------------
    def check_invariants(self) -> None:
        for m in self.managers:
            m.check_invariants()
        seqs = [set(m.block_tables) for m in self.managers]
        assert all(s == seqs[0] for s in seqs), "a sequence has a block table in some groups only"
