"""LoRA policy, pure: device slots (LRU), the host cache, a step's token layout, and the
scheduler's adapter limit (never more than max_loras adapters in a step, no adapter starved)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.prefix_cache import block_hashes, extra_key
from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus
from kvserve.runtime.lora.slots import LRUCache, SlotTable, step_layout


def test_slot_table_keeps_resident_adapters_and_evicts_the_least_recent():
    t = SlotTable(2)
    assert t.assign([3, 0, 3, 5]) == ({3: 0, 5: 1}, [(0, 3), (1, 5)])
    assert t.assign([5]) == ({5: 1}, [])  # resident: nothing to load
    # 7 needs a slot: 3 is the least recently used and not in this step
    assert t.assign([7, 5]) == ({7: 0, 5: 1}, [(0, 7)])
    assert t.assign([5, 3]) == ({5: 1, 3: 0}, [(0, 3)])
    assert t.evict(5) == 1 and t.assign([9]) == ({9: 1}, [(1, 9)])
    with pytest.raises(ValueError, match="more than max_loras 2"):
        t.assign([1, 2, 4])


def test_host_cache_lru_respects_pins_and_the_step():
    c = LRUCache(2)
    assert c.put("a", 1) == [] and c.put("b", 2) == []
    c.get("a")
    assert c.put("c", 3) == ["b"]
    c.pinned.add("a")
    assert c.put("d", 4, protect=["c"]) == []  # a pinned, c needed now: over capacity for a while
    assert len(c) == 3 and c.put("e", 5) == ["c", "d"]
    assert c.pop("a") == 1 and "a" not in c.pinned


def test_step_layout_contiguous_and_gathered():
    contiguous = step_layout([0, 0, -1, 1], [3, 1, 2, 2])
    assert contiguous.perm is None
    assert contiguous.segments == [(0, 0, 4), (1, 6, 8)]
    assert contiguous.token_slots == [0, 0, 0, 0, -1, -1, 1, 1]
    gathered = step_layout([1, 0, -1, 1, 0], [1, 1, 1, 1, 1])
    assert gathered.perm == [1, 4, 0, 3]  # slot 0's tokens, then slot 1's, each in order
    assert gathered.segments == [(0, 0, 2), (1, 2, 4)]
    assert step_layout([-1, -1], [2, 1]).segments == []
    # Prefill-sized runs of one adapter stay apart: no gather and scatter.
    long_runs = step_layout([0, 1, 0], [20, 16, 30], num_slots=4)
    assert long_runs.perm is None and long_runs.padded is None
    assert step_layout([0, 1, 2, 0], [20, 16, 30, 1], num_slots=4).perm is not None  # a decode token among them
    assert step_layout([0, 1, 2, 0], [1, 1, 1, 1], num_slots=4).padded is not None
    assert long_runs.segments == [(0, 0, 20), (1, 20, 36), (0, 36, 66)]


def test_prefix_keys_differ_per_adapter_and_salt():
    ids = list(range(8))
    keys = {block_hashes(ids, 4, extra_key(salt, lora))[0]
            for salt in (None, "s") for lora in (None, b"lora:1:1", b"lora:1:2", b"lora:2:3")}
    assert len(keys) == 8


# -- the scheduler ----------------------------------------------------------------------------------
def _run(requests, *, max_loras, max_num_seqs, budget, num_blocks, max_steps=2000):
    """Drives the scheduler without a model (every sample is token 0) until every request is done.
    Returns (steps each request waited before its first schedule, finishing step of each)."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=512,
                          max_loras=max_loras)
    sched = Scheduler(cfg, BlockManager(num_blocks, 4))
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])  # by arrival step
    first, done = {}, {}
    seqs = {}
    step = 0
    while (pending or sched.has_unfinished()) and step < max_steps:
        while pending and pending[0][1][0] <= step:
            i, (_, lora, prompt, out) = pending.pop(0)
            seqs[i] = Sequence(str(i), list(range(1, prompt + 1)), out)
            seqs[i].lora_int_id = lora
            sched.add(seqs[i])
        out = sched.schedule()
        adapters = {item.seq.lora_int_id for item in out.scheduled if item.seq.lora_int_id}
        assert len(adapters) <= max_loras, f"step {step} runs adapters {adapters}"
        running = {s.lora_int_id for s in sched.running if s.lora_int_id}
        assert len(running) <= max_loras
        for item in out.scheduled:
            first.setdefault(int(item.seq.request_id), step)
        sampled = [item for item in out.scheduled if item.samples]
        sched.on_step_done(out)
        for item in sampled:
            item.seq.append_token(0)
            if item.seq.num_output_tokens >= item.seq.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
                done[int(item.seq.request_id)] = step
        sched.block_manager.check_invariants()
        step += 1
    return first, done, seqs


def test_an_adapter_over_the_limit_waits_and_base_requests_pass_it():
    # a (adapter 1) runs; b (adapter 2) must wait with max_loras 1; c (adapter 1, behind b) waits
    # too, so adapter 1 cannot keep b out forever; d (base model) passes b.
    first, done, _ = _run([(0, 1, 4, 6), (0, 2, 4, 2), (0, 1, 4, 2), (0, 0, 4, 2)], max_loras=1,
                          max_num_seqs=8, budget=64, num_blocks=64)
    assert first[0] == 0 and first[3] == 0
    assert first[1] > 0 and first[2] > first[1] - 1
    assert first[1] > done[0] - 1  # b starts once a's adapter has left the running set
    assert first[2] >= first[1]


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5), st.integers(1, 20), st.integers(1, 12)),
                         min_size=1, max_size=25),
       max_loras=st.integers(1, 3), max_num_seqs=st.integers(1, 6), budget=st.integers(8, 48))
def test_property_limit_holds_and_every_adapter_is_served(requests, max_loras, max_num_seqs, budget):
    """With any arrivals, adapters and limits: no step exceeds max_loras adapters, every request
    finishes, and no request waits behind a later-arriving request of another adapter forever
    (each finishes within a bound set by the work that arrived before it)."""
    first, done, seqs = _run(requests, max_loras=max_loras, max_num_seqs=max_num_seqs, budget=budget,
                             num_blocks=64)
    assert set(done) == set(range(len(requests))), "a request never finished (starved)"
    # FCFS across adapters: an adapter request is never first scheduled after an adapter request
    # of a *different* adapter that arrived strictly later and was queued behind it.
    for i, (arr_i, lora_i, _, _) in enumerate(requests):
        for j, (arr_j, lora_j, _, _) in enumerate(requests):
            if lora_i and lora_j and lora_i != lora_j and arr_j > arr_i and seqs[i].num_preemptions == 0 \
                    and seqs[j].num_preemptions == 0:
                assert first[i] <= first[j], (i, j)
