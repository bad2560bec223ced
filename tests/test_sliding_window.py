"""Window-bounded KV memory: when every layer attends within a sliding window (Mistral), the block
manager gives back the blocks wholly behind each sequence's window, so a long context holds about
one window of blocks, and nothing else changes: greedy output equals transformers' with prompts
longer than the window under chunked prefill, preemption, prefix caching, n > 1 (copy-on-write)
and speculative decoding, and no block leaks.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_parity import hf_greedy  # noqa: E402  (tests/ is on sys.path via conftest)

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.engine.block_manager import FREED, BlockManager
from kvserve.runtime.engine.prefix_cache import block_hashes

WINDOW = 8
BLOCK = 4


# -- the block manager, pure ---------------------------------------------------------------------
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 20)),
        st.tuples(st.just("release"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("rollback"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(num_blocks=st.integers(4, 30), block_size=st.integers(1, 6), window=st.integers(1, 12), ops=OPS)
def test_release_keeps_invariants_and_bounds_what_a_sequence_holds(num_blocks, block_size, window, ops):
    bm = BlockManager(num_blocks, block_size, sliding_window=window)
    computed: dict[int, int] = {}
    for op, a, b in ops:
        if op == "grow":
            # As the scheduler does: release first, then make the step's slots writable.
            bm.release_behind_window(a, computed.get(a, 0))
            if bm.can_allocate(a, computed.get(a, 0), b):
                bm.allocate_slots(a, computed.get(a, 0), b)
                computed[a] = computed.get(a, 0) + b
                held = [x for x in bm.get_block_table(a) if x != FREED]
                assert len(held) <= bm.max_blocks_held(computed[a], b)
        elif op == "release" and a in computed:
            bm.release_behind_window(a, computed[a])
            table = bm.get_block_table(a)
            first = bm.first_live_block(computed[a])
            assert table[:first] == [FREED] * first and FREED not in table[first:]
        elif op == "fork" and a != b and a in bm.block_tables and b not in bm.block_tables:
            bm.fork(a, b)
            computed[b] = computed[a]
        elif op == "rollback" and a in computed:  # speculative rollback never crosses the window
            keep = max(computed[a] - b, bm.first_live_block(computed[a]) * block_size + window)
            if keep < computed[a]:
                bm.truncate(a, keep)
                computed[a] = keep
        elif op == "free":
            bm.free(a)
            computed.pop(a, None)
        bm.check_invariants()
    for seq in list(bm.block_tables):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def test_prefix_lookup_needs_only_the_window_of_the_hit():
    bm = BlockManager(10, BLOCK, enable_caching=True, sliding_window=WINDOW)
    tokens = list(range(100, 140))  # 10 full blocks: the whole pool
    hashes = block_hashes(tokens, BLOCK)
    bm.allocate_slots(1, 0, len(tokens))
    bm.register(1, hashes)
    bm.release_behind_window(1, len(tokens))  # blocks 0..7 go back to the free list, still keyed
    assert bm.get_block_table(1)[:8] == [FREED] * 8 and bm.num_free_blocks == 8
    bm.free(1)
    # Reuse evicts the least recently used cached blocks: the first three.
    for seq in (100, 101, 102):
        bm.allocate_slots(seq, 0, BLOCK)
    assert all(bm.block_hashes[b] is None for seq in (100, 101, 102) for b in bm.get_block_table(seq))
    hit = bm.lookup(hashes)
    # A query at position 39 reads positions 32..39 (blocks 8, 9): the whole prefix is still a
    # hit, with FREED entries for the blocks behind that window.
    assert len(hit) == 10 and hit[:8] == [FREED] * 8 and FREED not in hit[8:]
    assert bm.can_allocate_with_prefix(hit, 39, 1)
    bm.take_prefix(2, hit)
    bm.check_invariants()
    assert bm.allocate_slots(2, 39, 1) == []
    bm.free(2)
    # The hit's own window must be cached: evict the rest and nothing is a hit.
    for seq in range(103, 110):
        bm.allocate_slots(seq, 0, BLOCK)
    assert bm.lookup(hashes) == []
    bm.check_invariants()


def test_max_blocks_held():
    bm = BlockManager(64, BLOCK, sliding_window=WINDOW)
    assert bm.max_blocks_held(3, 16) == 1
    assert bm.max_blocks_held(1000, 16) == 7  # ceil((8 - 1 + 16) / 4) + 1
    assert BlockManager(64, BLOCK).max_blocks_held(1000, 16) == 250


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mistral_window(tiny_model_factory):
    return tiny_model_factory("mistral", sliding_window=WINDOW)


def _run(engine: LLMEngine, prompts, params) -> tuple[list[list[list[int]]], int]:
    """Steps the engine to the end; returns each request's samples and the most blocks in use."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    peak, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.block_manager.check_invariants()
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert engine.block_manager.num_used_blocks == 0, "a block leaked"
    return [done[str(i)] for i in range(len(prompts))], peak


def test_a_long_context_holds_one_window_of_blocks(mistral_window, tiny_model_factory):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(150)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=512)
    engine = LLMEngine.from_args(model=str(mistral_window), **kw)
    (got,), peak = _run(engine, [prompt], [params])
    assert got[0] == hf_greedy(mistral_window, [prompt], [20])[0]
    bm = engine.block_manager
    assert peak <= bm.max_blocks_held(169, 16) == 7
    # The same model without a window keeps every block: 168 tokens (seen between steps; the
    # last step's block is freed within that step) need 42.
    full = tiny_model_factory("mistral", sliding_window=None)
    _, full_peak = _run(LLMEngine.from_args(model=str(full), **kw), [prompt], [params])
    assert full_peak == 42


def test_prefix_cache_forks_spec_decode_and_preemption_with_prompts_longer_than_the_window(mistral_window):
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(37)]  # several windows long
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    # Repetitive prompts so that n-gram drafts are proposed (and some accepted).
    prompts += [([rng.randrange(3, 512) for _ in range(5)] * 8)[: rng.randrange(20, 40)] for _ in range(4)]
    max_tokens = [6 + 3 * (i % 4) for i in range(len(prompts))]
    expected = hf_greedy(mistral_window, prompts, max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, n=2 if i % 3 == 0 else 1)
              for i, n in enumerate(max_tokens)]
    engine = LLMEngine.from_args(
        model=str(mistral_window), block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=16,
        max_num_seqs=10, enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    # The first prompt alone first, so that the others find its blocks cached.
    (first,), _ = _run(engine, prompts[:1], params[:1])
    got, peak = _run(engine, prompts, params)
    for samples, want in zip([first] + got[1:], expected):
        for sample in samples:  # greedy: every sample of an n > 1 request is the same
            assert sample == want[:len(sample)] and len(sample) == len(want)
    stats = engine.get_stats()
    assert stats.prefix_cache_hits_total > 0
    assert stats.num_preemptions_total > 0
    assert stats.spec_decode_num_accepted_tokens_total > 0
    assert peak <= engine.block_manager.num_blocks
