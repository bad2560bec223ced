"""Scheduler tables: token budget, sequence cap, decode-first, FCFS, chunking, preemption, refusal."""

import pytest

from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=256, chunked=True):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def add(sched, rid, prompt_len, max_tokens=8):
    seq = Sequence(rid, list(range(1, prompt_len + 1)), max_tokens)
    sched.add(seq)
    return seq


def step(sched):
    """One engine step without a model: sampled token = 0; finished at max_tokens."""
    out = sched.schedule()
    plan = [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]
    sampled = [item for item in out.scheduled if item.samples]
    sched.on_step_done(out)
    for item in sampled:
        item.seq.append_token(0)
        if item.seq.num_output_tokens >= item.seq.max_tokens:
            sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    sched.block_manager.check_invariants()
    return plan, [s.request_id for s in out.preempted]


def test_budget_chunks_the_prompt_that_does_not_fit():
    s = make(budget=16)
    for rid in "abc":
        add(s, rid, 10)
    assert step(s) == ([("a", 10), ("b", 6)], [])
    # a decodes first, then b finishes its prompt, then c gets what is left
    assert step(s) == ([("a", 1), ("b", 4), ("c", 10)], [])
    assert step(s) == ([("a", 1), ("b", 1), ("c", 1)], [])


def test_sequence_cap():
    s = make(max_num_seqs=2, budget=100)
    for rid in "abc":
        add(s, rid, 3)
    assert step(s) == ([("a", 3), ("b", 3)], [])
    assert s.num_running == 2 and s.num_waiting == 1
    assert step(s) == ([("a", 1), ("b", 1)], [])


def test_fcfs_no_overtaking_even_if_a_later_prompt_would_fit():
    s = make(budget=8, chunked=False, max_model_len=8)
    add(s, "a", 6, max_tokens=2)
    add(s, "b", 5, max_tokens=2)
    add(s, "c", 1, max_tokens=2)
    assert step(s) == ([("a", 6)], [])  # b does not fit in the 2 left; c must not jump it
    assert step(s) == ([("a", 1), ("b", 5), ("c", 1)], [])


def test_decodes_first_and_budget_limits_decodes_too():
    s = make(budget=2)
    add(s, "a", 1, max_tokens=5)
    add(s, "b", 1, max_tokens=5)
    add(s, "c", 1, max_tokens=5)
    assert step(s) == ([("a", 1), ("b", 1)], [])
    assert step(s) == ([("a", 1), ("b", 1)], [])  # running decodes take the whole budget


def test_preempts_most_recent_and_requeues_it_first():
    # 4 blocks of 2 tokens; each sequence's 3-token prompt takes 2 blocks.
    s = make(num_blocks=4, block_size=2, budget=100)
    a = add(s, "a", 3, max_tokens=4)
    b = add(s, "b", 3, max_tokens=4)
    add(s, "c", 3, max_tokens=4)
    assert step(s) == ([("a", 3), ("b", 3)], [])
    # a's decode still fits (slot 3 in its 2nd block)
    assert step(s) == ([("a", 1), ("b", 1)], [])
    # both need a 3rd block: a preempts b (the newest), b goes before c in the queue
    assert step(s) == ([("a", 1)], ["b"])
    assert [q.request_id for q in s.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and b.num_output_tokens == 2
    assert s.num_preemptions == 1
    # a finishes after its 4th token and b is recomputed with its generated tokens
    plan, _ = step(s)
    assert plan == [("a", 1)]
    assert a.is_finished
    # b's 5 tokens take 3 of the 4 free blocks; c (2 blocks) must wait
    assert step(s) == ([("b", 5)], [])


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=3, block_size=2, budget=100)
    add(s, "a", 4, max_tokens=3)  # 2 blocks
    add(s, "b", 2, max_tokens=3)  # 1 block
    assert step(s) == ([("a", 4), ("b", 2)], [])
    # a needs a 3rd block (token 5): the newest running is b, so b goes
    assert step(s) == ([("a", 1)], ["b"])


def test_abort_frees_blocks_wherever_the_sequence_is():
    s = make(num_blocks=8, block_size=2, budget=4)
    a = add(s, "a", 6)
    b = add(s, "b", 3)
    step(s)  # a gets 4 tokens (partial prefill), b waits
    s.finish(a, SequenceStatus.FINISHED_ABORTED)
    s.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()


@pytest.mark.parametrize(
    "prompt_len,max_tokens,field",
    [
        (0, 4, "prompt"),
        (300, 4, "prompt"),  # over max_model_len 256
        (250, 10, "max_tokens"),  # prompt + max_tokens over max_model_len
        (60, 10, "max_tokens"),  # over the whole cache: 16 blocks x 4 = 64 tokens
    ],
)
def test_refuses_requests_that_can_never_fit(prompt_len, max_tokens, field):
    s = make(num_blocks=16)
    with pytest.raises(ValueError, match=f"^{field}"):
        add(s, "x", prompt_len, max_tokens)
    assert not s.has_unfinished()


def test_refuses_prompt_over_budget_without_chunking():
    s = make(budget=8, chunked=False, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        add(s, "x", 9, 1)


def test_everything_completes_under_pressure():
    s = make(num_blocks=6, block_size=2, budget=5, max_num_seqs=4)
    seqs = [add(s, str(i), 1 + i % 4, max_tokens=2 + i % 3) for i in range(10)]
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
    assert all(q.is_finished for q in seqs)
    assert all(q.num_output_tokens == q.max_tokens for q in seqs)
    assert s.block_manager.num_free_blocks == 6


# -- pipelined: micro-batches in flight (EngineCore.depth > 1) -------------------------------------

def _land(sched, out):
    """The token of a micro-batch that comes back later (as step() does, for one batch)."""
    sched.on_step_done(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(0)
    sched.block_manager.check_invariants()


def test_in_flight_sequences_are_skipped_and_batches_alternate():
    s = make(budget=100)
    seqs = [add(s, rid, 3) for rid in "abcd"]
    first = s.schedule(max_seqs=2)
    assert [i.seq.request_id for i in first.scheduled] == ["a", "b"]
    in_flight = {i.seq.seq_id for i in first.scheduled}
    second = s.schedule(in_flight, max_seqs=2)
    assert [i.seq.request_id for i in second.scheduled] == ["c", "d"]
    # a and b are still in flight, c and d now too: nothing may run until one batch lands
    assert s.schedule(in_flight | {i.seq.seq_id for i in second.scheduled}).is_empty
    _land(s, first)
    third = s.schedule({i.seq.seq_id for i in second.scheduled}, max_seqs=2)
    assert [(i.seq.request_id, i.num_new_tokens) for i in third.scheduled] == [("a", 1), ("b", 1)]
    assert all(seq.status is SequenceStatus.RUNNING for seq in seqs)


def test_an_in_flight_sequence_is_never_the_preemption_victim():
    # 4 blocks of 2 tokens: a and b (3-token prompts) take 2 each; b is the newest.
    s = make(num_blocks=4, block_size=2, budget=100)
    a = add(s, "a", 3, max_tokens=4)
    b = add(s, "b", 3, max_tokens=4)
    out = s.schedule()
    _land(s, out)
    _land(s, s.schedule())  # both decode into their 2nd block; the pool is full
    # b is in flight and a needs a 3rd block: b (the newest) may not go, so a preempts itself
    out = s.schedule({b.seq_id})
    assert out.scheduled == [] and [q.request_id for q in out.preempted] == ["a"]
    assert b.status is SequenceStatus.RUNNING and b.num_computed_tokens == 4
    assert a.status is SequenceStatus.WAITING and a.num_computed_tokens == 0
    s.block_manager.check_invariants()
