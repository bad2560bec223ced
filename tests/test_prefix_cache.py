"""Automatic prefix caching: keys, the block manager's cache, and the engine end to end.

The oracle is the same engine with caching off: outputs must be token-for-token identical,
whatever the cache hits, evictions and preemptions along the way.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.prefix_cache import block_hashes, hash_block


def run(engine, prompts, params, ids=None):
    """Adds every prompt, steps until idle; returns {request_id: final RequestOutput}."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final


def assert_no_leak(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.block_tables


# -- keys --------------------------------------------------------------------------------------
def test_hash_chain_keys_the_whole_prefix_and_the_salt():
    a = block_hashes(list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    b = block_hashes([99] + list(range(1, 12)), 4)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # a change flows down the chain
    assert block_hashes(list(range(12)), 4, b"salt") != a
    assert block_hashes(list(range(13)), 4) == a  # the partial last block has no key
    # Fixed-width encoding: token lists that would concatenate alike still differ.
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])


# -- block manager with caching: property test -------------------------------------------------
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # tiny alphabet: many shared prefixes
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5), TOKENS),
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 9)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("truncate"), st.integers(0, 5), st.integers(0, 30)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4), ops=OPS)
def test_caching_block_manager_keeps_invariants(num_blocks, block_size, ops):
    """No leak, no block owned twice, counts consistent, and every cached block holds exactly
    the tokens its key names (tracked here as the content each block would hold)."""
    bm = BlockManager(num_blocks, block_size, enable_caching=True)
    content: dict[int, list[int | None]] = {}  # block -> tokens written in its slots
    seqs: dict[int, list[int]] = {}  # seq -> tokens with K/V (computed)

    def write(seq, start, tokens):
        table = bm.get_block_table(seq)
        for pos, t in enumerate(tokens, start):
            blk = table[pos // block_size]
            content.setdefault(blk, [None] * block_size)[pos % block_size] = t

    def apply_copies(copies):
        for src, dst in copies:
            content[dst] = list(content.get(src, [None] * block_size))

    for op, a, b in ops:
        if op == "admit" and a not in bm.block_tables:
            hashes = block_hashes(b, block_size)
            prefix = bm.lookup(hashes)
            cached = min(len(prefix) * block_size, len(b) - 1)
            for i, blk in enumerate(prefix):  # a hit names exactly the tokens in that block
                assert content[blk] == b[i * block_size:(i + 1) * block_size]
            if bm.can_allocate_with_prefix(prefix, cached, len(b) - cached):
                bm.take_prefix(a, prefix)
                apply_copies(bm.allocate_slots(a, cached, len(b) - cached))
                write(a, cached, b[cached:])
                seqs[a] = list(b)
                bm.register(a, hashes)
        elif op == "grow" and a in bm.block_tables:
            toks = seqs[a]
            if bm.can_allocate(a, len(toks), b):
                apply_copies(bm.allocate_slots(a, len(toks), b))
                new = [(len(toks) + i) % 4 for i in range(b)]
                write(a, len(toks), new)
                toks.extend(new)
                bm.register(a, block_hashes(toks, block_size))
        elif op == "fork" and a != b and a in bm.block_tables and b not in bm.block_tables:
            bm.fork(a, b)
            seqs[b] = list(seqs[a])
        elif op == "truncate" and a in bm.block_tables:
            keep = min(b, len(seqs[a]))
            bm.truncate(a, keep)
            del seqs[a][keep:]
        elif op == "free":
            bm.free(a)
            seqs.pop(a, None)
        bm.check_invariants()
        for h, blk in bm.cached.items():
            assert bm.block_hashes[blk] == h
        # Blocks written by a sequence are private to it from its first written slot on.
        for s, toks in seqs.items():
            assert len(bm.get_block_table(s)) == bm.blocks_for_tokens(len(toks))
    for s in list(bm.block_tables):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def test_lru_eviction_order_and_revival():
    bm = BlockManager(4, 2, enable_caching=True)
    h = block_hashes([1, 2, 3, 4], 2)
    bm.allocate_slots(1, 0, 4)
    bm.register(1, h)
    table = list(bm.get_block_table(1))
    bm.free(1)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # Unkeyed free blocks go first; then the tail block of the freed sequence, then its head.
    bm.allocate_slots(2, 0, 4)
    assert len(bm.cached) == 2
    bm.allocate_slots(3, 0, 1)
    assert bm.lookup(h) == [table[0]]  # the tail block was evicted, the head survives
    bm.take_prefix(4, bm.lookup(h))  # revived off the free list
    assert bm.num_free_blocks == 0
    for s in (2, 3, 4):
        bm.free(s)
    bm.check_invariants()


# -- engine --------------------------------------------------------------------------------------
def make_engine(model, caching: bool, **kw):
    opts = dict(block_size=4, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=48)
    opts.update(kw)
    return LLMEngine.from_args(model=str(model), enable_prefix_caching=caching, **opts)


def shared_prefix_workload(seed=0, n=12):
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    prompts = []
    for i in range(n):
        sys_p = systems[i % 3]
        prompts.append(sys_p + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))])
    prompts.append(list(prompts[0]))  # an exact repeat: fully cached
    prompts.append(systems[1][:8])  # a prompt that is a prefix of cached prompts
    return prompts


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=10)],
                         ids=["greedy", "seeded"])
def test_outputs_identical_with_caching_on_and_off(tiny_llama, params):
    prompts = shared_prefix_workload()
    results = {}
    for caching in (False, True):
        engine = make_engine(tiny_llama, caching)
        # Two waves: the second one finds the first one's blocks cached (or freed and evictable).
        first = run(engine, prompts[:6], params, ids=[f"a{i}" for i in range(6)])
        second = run(engine, prompts, params)
        results[caching] = ({k: v.outputs[0].token_ids for k, v in first.items()},
                            {k: v.outputs[0].token_ids for k, v in second.items()})
        stats = engine.get_stats()
        if caching:
            assert stats.prefix_cache_hits_total > 0
            assert 0 < stats.prefix_cache_hits_total < stats.prefix_cache_queries_total
            assert second["r12"].num_cached_tokens == len(prompts[12]) // 4 * 4
        else:
            assert stats.prefix_cache_queries_total == stats.prefix_cache_hits_total == 0
        assert_no_leak(engine)
    assert results[True] == results[False]


def test_shared_1k_prefix_computes_only_the_suffix(tiny_llama):
    engine = make_engine(tiny_llama, True, block_size=16, num_kv_blocks=200, max_model_len=1200,
                         max_num_batched_tokens=2048)
    rng = random.Random(1)
    system = [rng.randrange(3, 512) for _ in range(1024)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = run(engine, [system + [5, 6, 7]], params, ids=["a"])["a"]
    before = engine.get_stats()
    suffix = [rng.randrange(3, 512) for _ in range(21)]
    b = run(engine, [system + suffix], params, ids=["b"])["b"]
    after = engine.get_stats()
    assert b.num_cached_tokens == 1024 and a.num_cached_tokens == 0
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 1024
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == 1024 + 21
    # The suffix once, then one token per decode step after the first sampled token.
    assert after.computed_tokens_total - before.computed_tokens_total == 21 + 3
    # Fully cached prompt (a multiple of the block size): only its last token is recomputed.
    full = system[:1024]
    run(engine, [full], params, ids=["c0"])
    before = engine.get_stats()
    c = run(engine, [full], params, ids=["c1"])["c1"]
    after = engine.get_stats()
    assert after.computed_tokens_total - before.computed_tokens_total == 1 + 3
    assert c.num_cached_tokens == 1023
    off = make_engine(tiny_llama, False, block_size=16, num_kv_blocks=200, max_model_len=1200,
                      max_num_batched_tokens=2048)
    ref = run(off, [system + suffix, full], params, ids=["b", "c1"])
    assert ref["b"].outputs[0].token_ids == b.outputs[0].token_ids
    assert ref["c1"].outputs[0].token_ids == c.outputs[0].token_ids
    assert_no_leak(engine)


def test_eviction_and_preemption_under_memory_pressure_keep_outputs_right(tiny_llama):
    prompts = shared_prefix_workload(seed=3, n=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        # 24 blocks of 4 tokens: far less than the workload's total, so cached blocks get evicted
        # and running sequences preempted (and recomputed, partly from the cache).
        engine = make_engine(tiny_llama, caching, num_kv_blocks=24, max_num_batched_tokens=32)
        outs[caching] = {k: v.outputs[0].token_ids for k, v in run(engine, prompts, params).items()}
        stats = engine.get_stats()
        assert stats.num_preemptions_total > 0
        assert_no_leak(engine)
        if caching:
            assert stats.prefix_cache_hits_total > 0
            # Everything that stayed keyed is free and evictable: the cache holds no block hostage.
            assert engine.block_manager.num_free_blocks == 24
    assert outs[True] == outs[False]


def test_abort_mid_prefill_leaves_no_block_and_no_wrong_key(tiny_llama):
    engine = make_engine(tiny_llama, True, max_num_batched_tokens=8)
    prompt = list(range(10, 50))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("x", prompt, params)
    engine.step()
    engine.step()  # 16 of 40 tokens computed
    engine.abort_request("x")
    engine.step()
    assert_no_leak(engine)
    assert len(engine.block_manager.cached) == 4  # only the computed full blocks
    got = run(engine, [prompt], params)["r0"]
    assert got.num_cached_tokens == 16
    ref = run(make_engine(tiny_llama, False), [prompt], params)["r0"]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_cache_salt_isolates_tenants(tiny_llama):
    engine = make_engine(tiny_llama, True)
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0, max_tokens=2)
    run(engine, [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], params, ids=["a"])
    b = run(engine, [{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], params, ids=["b"])["b"]
    a2 = run(engine, [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], params, ids=["a2"])["a2"]
    assert b.num_cached_tokens == 0 and a2.num_cached_tokens == 19  # fully cached: last token recomputed
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("bad", {"prompt_token_ids": prompt, "cache_salt": 3}, params)
