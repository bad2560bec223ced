"""Pure policy for adapters on a rank (no torch): which device slot holds which adapter, and how
one step's tokens group by adapter for the segmented ("SGMV") matmuls.

Device slots: `max_loras` of them, LRU. A step names at most `max_loras` distinct adapters (the
scheduler's promise), so every one of them gets a slot: one already there is kept, a new one
takes a free slot or the least recently used slot of an adapter this step does not need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first

    def assign(self, ids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for one step's adapters (ids > 0): (id -> slot, [(slot, id) to load now])."""
        wanted = list(dict.fromkeys(i for i in ids if i))
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step names {len(wanted)} adapters, more than max_loras {self.num_slots}")
        loads: list[tuple[int, int]] = []
        for i in wanted:
            if i in self._slot_of:
                self._slot_of.move_to_end(i)
        for i in wanted:
            if i in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self._slot_of if v not in wanted)  # least recently used
                slot = self._slot_of.pop(victim)
            self._slot_of[i] = slot
            loads.append((slot, i))
        return {i: self._slot_of[i] for i in wanted}, loads

    def evict(self, adapter_id: int) -> int | None:
        """Forgets an adapter (removed); returns the slot it held."""
        return self._slot_of.pop(adapter_id, None)

    def resident(self) -> dict[int, int]:
        return dict(self._slot_of)


class LRUCache:
    """Adapters loaded in host memory, at most `capacity`; `pinned` ones are never evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self.pinned: set[Hashable] = set()

    def get(self, key: Hashable):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any, protect: Iterable[Hashable] = ()) -> list[Hashable]:
        """Adds (or refreshes) an entry; returns the keys evicted to make room (least recent
        first, never pinned or `protect`ed ones: the cache may then exceed its capacity)."""
        self._items[key] = value
        self._items.move_to_end(key)
        keep = self.pinned | set(protect) | {key}
        evicted = []
        for k in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if k not in keep:
                del self._items[k]
                evicted.append(k)
        return evicted

    def pop(self, key: Hashable):
        self.pinned.discard(key)
        return self._items.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[Hashable]:
        return list(self._items)


@dataclass
class StepLayout:
    """How one step's packed tokens group by adapter slot.

    `token_slots[t]`: token t's slot, -1 for the base model. `segments`: (slot, start, end) ranges
    of one adapter each, over the tokens themselves when every adapter's tokens are already
    contiguous (`perm` None), else over the adapter tokens gathered in `perm` order (sorted by
    slot, stable): the segmented-gather shape of Punica's SGMV and S-LoRA. Long runs (prefill)
    stay segments of their own, even several of one adapter."""

    token_slots: list[int]
    segments: list[tuple[int, int, int]]
    perm: list[int] | None
    # Many short segments (decode): every slot's tokens in one row of M, as flat (gather,
    # scatter) lists of num_slots * M (padding gathers token T, a zero row, and scatters to 0),
    # so the layer runs two batched matmuls over all slots instead of two per adapter.
    padded: tuple[list[int], list[int]] | None = None


# The batched form pays for its padding rows; it is taken when they at most double the work.
MIN_SEGMENTS_FOR_PADDED = 3
# Runs of at least this many tokens (prefill chunks) are segments themselves even when an adapter
# has several: a run's two matmuls on a slice of x cost little more than one adapter-wide pair,
# while gathering and scatter-adding the rows (index_add_ on the CPU) costs a copy of the step.
MIN_RUN_FOR_DIRECT = 16


def step_layout(seq_slots: Sequence[int], seq_tokens: Sequence[int], num_slots: int | None = None) -> StepLayout:
    """From each scheduled sequence's slot (-1: none) and token count, in packing order;
    `num_slots` (max_loras) allows the padded batched form."""
    token_slots: list[int] = []
    runs: list[tuple[int, int, int]] = []  # (slot, start, end), contiguous runs of adapter tokens
    pos = 0
    for slot, n in zip(seq_slots, seq_tokens):
        token_slots.extend([slot] * n)
        if slot >= 0 and n:
            if runs and runs[-1][0] == slot and runs[-1][2] == pos:
                runs[-1] = (slot, runs[-1][1], pos + n)
            else:
                runs.append((slot, pos, pos + n))
        pos += n
    by_slot: dict[int, list[int]] = {}
    for slot, start, end in runs:
        by_slot.setdefault(slot, []).extend(range(start, end))
    if num_slots and len(by_slot) >= MIN_SEGMENTS_FOR_PADDED and min(e - s for _, s, e in runs) < MIN_RUN_FOR_DIRECT:
        width = max(len(t) for t in by_slot.values())
        used = sum(len(t) for t in by_slot.values())
        if num_slots * width <= 2 * used + 16:
            total = len(token_slots)
            gather, scatter = [], []
            for slot in range(num_slots):
                rows = by_slot.get(slot, [])
                gather += rows + [total] * (width - len(rows))
                scatter += rows + [0] * (width - len(rows))
            layout = _segmented(token_slots, runs, by_slot)
            layout.padded = (gather, scatter)
            return layout
    return _segmented(token_slots, runs, by_slot)


def segment_starts(segments) -> list[int]:
    """Each segment's start in the gathered token order (segments laid end to end)."""
    out, pos = [], 0
    for _, s, e in segments:
        out.append(pos)
        pos += e - s
    return out


def _segmented(token_slots, runs, by_slot) -> StepLayout:
    if len({r[0] for r in runs}) == len(runs) or min(e - s for _, s, e in runs) >= MIN_RUN_FOR_DIRECT:
        return StepLayout(token_slots, runs, None)
    perm: list[int] = []
    segments = []
    for slot in sorted(by_slot):
        start = len(perm)
        perm.extend(by_slot[slot])
        segments.append((slot, start, len(perm)))
    return StepLayout(token_slots, segments, perm)


@dataclass
class LoRAStepInput:
    """What a step tells every rank about adapters: the token layout, and the adapters to copy
    into device slots before the forward pass ((slot, LoRARequest) pairs, loaded from the host
    cache or the adapter's directory)."""

    layout: StepLayout
    loads: list[tuple[int, Any]] = field(default_factory=list)
