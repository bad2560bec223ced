"""The engine's pieces (runtime/engine/): all-or-nothing admission in the InputProcessor, forks
and speculative rollback in the scheduler, the engine-client interface the server talks to."""

from __future__ import annotations

import pytest

from kvserve.runtime import LLM, LLMEngine, SamplingParams
from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.client import EngineClient
from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer
from kvserve.runtime.engine.request import Request
from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus
from kvserve.runtime.outputs import RequestMetrics
from kvserve.runtime.sampler import SamplerOutput, SamplingRow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = LLMEngine.from_args(model=str(tiny_llama), block_size=4, num_kv_blocks=48,
                              max_model_len=64, max_num_batched_tokens=32)
    yield eng
    eng.close()


def _drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.mark.parametrize("bad,field", [
    (("b", [5, 512], GREEDY), "prompt_token_ids"),
    (("b", [5, 6], SamplingParams(max_tokens=70)), "max_tokens"),
    (("b", [5, 6], {"top_p": 0.0}), "top_p"),
    (("a", [5, 6], GREEDY), "request_id"),  # the same id twice in one batch
    (("", [5, 6], GREEDY), "request_id"),
])
def test_a_bad_request_in_a_batch_admits_none_of_it(engine, bad, field):
    before = engine.get_stats()
    free = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=field):
        engine.add_requests([("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, n=3)), bad])
    # Nothing queued, nothing to report, nothing counted (a bad request is not an abort).
    assert not engine.has_unfinished_requests() and engine.step() == []
    after = engine.get_stats()
    assert after.request_success_total == before.request_success_total
    assert after.num_waiting == after.num_running == 0 and engine.block_manager.num_free_blocks == free
    engine.add_requests([("a", [5, 6, 7], GREEDY), ("b", [5, 6], GREEDY)])  # the ids are free again
    assert set(_drain(engine)) == {"a", "b"}


def test_an_id_in_use_rejects_the_whole_batch(engine):
    engine.add_request("busy", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="request_id: 'busy' is already in use"):
        engine.add_requests([("fresh", [5, 6], GREEDY), ("busy", [8], GREEDY)])
    assert set(_drain(engine)) == {"busy"}


def test_offline_generate_rejects_a_bad_batch_before_running_any_of_it(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=48, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([[5, 6, 7], [5, 999]], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.get_stats().request_success_total == {}
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    finally:
        llm.close()


def test_llm_engine_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)
    assert engine.max_num_seqs == engine.config.max_num_seqs
    engine.check_token_ids([0, 511], "tokens")
    with pytest.raises(ValueError, match=r"tokens: 512 is not a token id in the vocabulary \[0, 512\)"):
        engine.check_token_ids([3, 512], "tokens")
    with pytest.raises(ValueError, match="tokens: True"):
        engine.check_token_ids([True], "tokens")


# -- the scheduler takes the sampled tokens: stops, forks, speculative rollback (pure) ------------
def _request(request_id: str, prompt: list[int], max_tokens: int, *, n: int = 1,
             eos: frozenset[int] = frozenset({0})) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
    metrics = RequestMetrics(arrival_time=0.0)
    samples = []
    for index in range(n):
        seq = Sequence(request_id, prompt, max_tokens)
        samples.append(Request(
            request_id=request_id, prompt=None, params=params, seq=seq,
            detok=IncrementalDetokenizer(lambda ids, skip: "".join(chr(97 + i % 26) for i in ids), prompt),
            metrics=metrics if index == 0 else RequestMetrics(arrival_time=0.0),
            row=SamplingRow(params, seq.token_ids, len(prompt)),
            stop_token_ids=frozenset(), eos_token_ids=eos, index=index))
    if n > 1:
        samples[0].unforked = samples[1:]
        for s in samples:
            s.group = samples
    return samples[0]


def _scheduler(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                     BlockManager(num_blocks, 4))


def test_update_from_output_forks_the_other_samples_off_the_prompt_blocks():
    sched = _scheduler()
    head = _request("r", [1, 2, 3, 4, 5], 4, n=3)
    by_seq = {s.seq.seq_id: s for s in head.samples}
    sched.add(head.seq)
    out = sched.schedule()
    update = sched.update_from_output(out, SamplerOutput([7, 8, 9], [None] * 3), by_seq)
    assert [(su.req.index, su.num_tokens, su.finished) for su in update.samples] == [(0, 1, False), (1, 1, False),
                                                                                    (2, 1, False)]
    assert update.num_prompt_tokens == 5 and update.num_generated_tokens == 3
    assert [s.seq.output_token_ids for s in head.samples] == [[7], [8], [9]]
    assert sched.num_running == 3 and not head.unforked
    tables = [sched.block_manager.get_block_table(s.seq.seq_id) for s in head.samples]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full prompt block is shared, not copied


def test_update_from_output_finishes_on_eos_and_length_and_frees_the_blocks():
    sched = _scheduler()
    a, b = _request("a", [1, 2, 3], 5), _request("b", [4, 5, 6], 1)
    by_seq = {r.seq.seq_id: r for r in (a, b)}
    sched.add(a.seq)
    sched.add(b.seq)
    update = sched.update_from_output(sched.schedule(), SamplerOutput([0, 9], [None, None]), by_seq)
    assert [(su.req.request_id, su.finished) for su in update.samples] == [("a", True), ("b", True)]
    assert (a.finish_reason, b.finish_reason) == ("stop", "length")
    assert a.seq.status is SequenceStatus.FINISHED_STOPPED and sched.num_running == 0
    assert sched.block_manager.num_used_blocks == 0


def test_a_speculative_run_is_rolled_back_to_what_was_verified():
    sched = _scheduler()
    req = _request("s", [1, 2, 3, 4, 5], 20)
    by_seq = {req.seq.seq_id: req}
    sched.add(req.seq)
    sched.update_from_output(sched.schedule(), SamplerOutput([6], [None]), by_seq)
    req.seq.spec_token_ids[:] = [7, 8, 9]  # three drafts: positions 6..9 run
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4
    assert len(sched.block_manager.get_block_table(req.seq.seq_id)) == 3  # room for 10 positions
    # One draft accepted, then the target's own token: 7, 10.
    update = sched.update_from_output(out, SamplerOutput([[7, 10]], [None]), by_seq)
    assert (update.num_spec_runs, update.num_draft_tokens, update.num_accepted_tokens) == (1, 3, 1)
    assert update.samples[0].num_tokens == 2 and req.seq.token_ids[5:] == [6, 7, 10]
    assert req.seq.num_computed_tokens == req.seq.num_tokens - 1 == 7
    assert len(sched.block_manager.get_block_table(req.seq.seq_id)) == 2  # the rejected drafts' block went back


def test_a_speculative_run_stops_at_the_token_that_ends_it():
    sched = _scheduler()
    req = _request("s", [1, 2, 3], 20)
    by_seq = {req.seq.seq_id: req}
    sched.add(req.seq)
    sched.update_from_output(sched.schedule(), SamplerOutput([6], [None]), by_seq)
    req.seq.spec_token_ids[:] = [0, 5]
    update = sched.update_from_output(sched.schedule(), SamplerOutput([[0, 5, 11]], [None]), by_seq)
    assert update.samples[0].num_tokens == 1 and update.samples[0].finished
    assert req.seq.output_token_ids == [6, 0] and req.finish_reason == "stop"
    assert sched.block_manager.num_used_blocks == 0
