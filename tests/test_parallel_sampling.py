"""n > 1: samples share the prompt's KV blocks by reference count, copy on write, and never leak."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime import LLM, LLMEngine, SamplingParams


def make_engine(model, **kw):
    opts = dict(block_size=4, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64)
    opts.update(kw)
    return LLMEngine.from_args(model=str(model), **opts)


def drain(engine):
    final = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.block_tables
    return final


PROMPT = list(range(20, 30))  # 10 tokens: two full blocks of 4 and a half-full third


@pytest.mark.parametrize("caching", [True, False])
def test_samples_share_prompt_blocks_and_copy_the_partial_one_on_write(tiny_llama, caching):
    engine = make_engine(tiny_llama, enable_prefix_caching=caching)
    bm = engine.block_manager
    engine.add_request("r", PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill, then four first tokens from the same logits: the samples fork
    tables = [bm.get_block_table(s.seq.seq_id) for s in engine.core.requests["r"].samples]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert [bm.ref_counts[b] for b in tables[0]] == [4, 4, 4]
    assert bm.num_used_blocks == 3  # the prompt is held once whatever n is
    shared_partial = tables[0][2]
    k_before = [k[shared_partial, :2].clone() for k, _ in engine.kv_caches]

    engine.step()  # every sample writes its token 10 into the shared third block
    tables = [bm.get_block_table(s.seq.seq_id) for s in engine.core.requests["r"].samples]
    assert all(t[:2] == tables[0][:2] for t in tables) and bm.ref_counts[tables[0][0]] == 4
    thirds = [t[2] for t in tables]
    assert len(set(thirds)) == 4  # n - 1 copies, and the last writer kept the original
    assert shared_partial in thirds
    assert bm.num_used_blocks == 2 + 4
    for third in thirds:  # a real copy in the pools: the two prompt slots came along
        for (k, _), before in zip(engine.kv_caches, k_before):
            torch.testing.assert_close(k[third, :2], before, rtol=0, atol=0)
    outs = drain(engine)["r"].outputs
    assert [c.index for c in outs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in outs)


def test_seeded_samples_are_distinct_reproducible_and_equal_seed_plus_index(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT, params)
    outs = drain(engine)
    a = [c.token_ids for c in outs["a"].outputs]
    b = [c.token_ids for c in outs["b"].outputs]
    assert a == b  # reproducible, whatever shares the batch
    assert len({tuple(t) for t in a}) == 3  # distinct
    for j in range(3):  # sample j is what an n=1 request with seed 11 + j gives
        engine.add_request(f"one{j}", PROMPT, params.clone(n=1, seed=11 + j))
    ones = drain(engine)
    assert [ones[f"one{j}"].outputs[0].token_ids for j in range(3)] == a


def test_greedy_n_equals_n1_and_llm_returns_n_completions(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, max_model_len=128)
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    out = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(n=3, temperature=0, max_tokens=7), use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert all(c.token_ids == ref.outputs[0].token_ids for c in out[0].outputs)
    assert all(c.text == ref.outputs[0].text for c in out[0].outputs)
    stats = llm.engine.get_stats()
    assert stats.prompt_tokens_total == len(PROMPT) * 2 + 5  # a prompt counts once, not n times
    assert stats.request_success_total["length"] == 3  # requests, not samples


def test_aborts_before_and_after_the_fork_and_early_finishers_leak_nothing(tiny_llama):
    engine = make_engine(tiny_llama, max_num_batched_tokens=4)
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12)
    engine.add_request("before", PROMPT, params)  # still prefilling in chunks of 4
    engine.step()
    engine.abort_request("before")
    out = engine.step()
    assert out[0].finished and [c.finish_reason for c in out[0].outputs] == ["abort"] * 4
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0

    engine.add_request("after", PROMPT, params)
    for _ in range(5):
        engine.step()
    assert len(engine.core.requests["after"].samples) == 4
    engine.abort_request("after")
    drain(engine)

    # Samples that stop at different times (stop token 7 is frequent for some seeds): each frees
    # its own blocks; the request finishes when the last one does.
    engine.add_request("mixed", PROMPT, SamplingParams(n=6, temperature=1.5, seed=1, max_tokens=12,
                                                         stop_token_ids=list(range(3, 200))))
    final = drain(engine)["mixed"]
    assert len(final.outputs) == 6 and all(c.finish_reason in ("stop", "length") for c in final.outputs)


def test_preempted_samples_recompute_and_finish(tiny_llama):
    """A pool too small for all samples at once: samples get preempted and recomputed (with the
    prompt found in the prefix cache) and still produce what an unpressured engine produces."""
    params = SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=20, ignore_eos=True)
    roomy = make_engine(tiny_llama)
    roomy.add_request("r", PROMPT, params)
    want = [c.token_ids for c in drain(roomy)["r"].outputs]
    tight = make_engine(tiny_llama, num_kv_blocks=14)
    tight.add_request("r", PROMPT, params)
    got = [c.token_ids for c in drain(tight)["r"].outputs]
    assert tight.get_stats().num_preemptions_total > 0
    assert got == want
