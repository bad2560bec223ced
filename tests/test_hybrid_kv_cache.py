"""KV cache groups for models mixing local and global layers (Gemma 2/3, Qwen2 with
max_window_layers): one block table and pool per group, so the sliding-window layers hold about
window + one step of blocks per sequence while the full-attention layers hold the context.

The coordinator is tested pure (atomic failure, no leak, prefix hits every group can serve);
the engine against transformers' greedy output with prompts several windows long, packed,
chunked, preempted, prefix-cached and forked (n > 1, copy-on-write), and by its block accounting.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_parity import hf_greedy  # noqa: E402  (tests/ is on sys.path via conftest)

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.capacity import ModelShape, kv_bytes_per_token, kv_tokens_held, plan_capacity
from kvserve.runtime.engine.block_manager import FREED, BlockManager, NoFreeBlocksError
from kvserve.runtime.engine.kv_cache_groups import (
    KVCacheCoordinator,
    KVCacheGroup,
    hybrid_group_blocks,
    kv_cache_groups,
)
from kvserve.runtime.engine.prefix_cache import block_hashes

WINDOW = 8
BLOCK = 4
GROUPS = (KVCacheGroup(None, (1, 3)), KVCacheGroup(WINDOW, (0, 2)))


# -- groups and sizing, pure -----------------------------------------------------------------------
@pytest.mark.parametrize("windows,expected", [
    ([None, None], [(None, (0, 1))]),
    ([8, 8, 8], [(8, (0, 1, 2))]),
    ([8, None, 8, None], [(None, (1, 3)), (8, (0, 2))]),
    ([4, 16, None, 4], [(None, (2,)), (16, (1,)), (4, (0, 3))]),  # full first, then widest window
])
def test_groups_by_window(windows, expected):
    assert [(g.window, g.layers) for g in kv_cache_groups(windows)] == expected


def test_group_blocks_are_split_by_what_a_max_length_sequence_holds():
    # 1024 tokens: the full group holds 256 blocks, the window group ceil((8 - 1 + 16) / 4) + 1 = 7.
    blocks = hybrid_group_blocks(GROUPS, budget_blocks=1000, block_size=BLOCK, max_model_len=1024,
                                 max_step_tokens=16)
    sequences = 1000 * 4 / (2 * 256 + 2 * 7)
    assert blocks[1] == int(sequences * 7) and blocks[0] == (1000 * 4 - 2 * blocks[1]) // 2
    assert blocks[0] >= int(sequences * 256)
    # A budget below one max-length sequence: the window group still holds one sequence's bound.
    assert hybrid_group_blocks(GROUPS, budget_blocks=10, block_size=BLOCK, max_model_len=1024,
                               max_step_tokens=16) == [(10 * 4 - 2 * 7) // 2, 7]
    # A context no longer than the window: both groups need the same, the split is even.
    assert hybrid_group_blocks(GROUPS, budget_blocks=100, block_size=BLOCK, max_model_len=8,
                               max_step_tokens=16) == [100, 100]


# -- the coordinator, pure -------------------------------------------------------------------------
def _state(co: KVCacheCoordinator):
    return [(dict((s, list(t)) for s, t in m.block_tables.items()), list(m.ref_counts), list(m._free))
            for m in co.managers]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 20)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(full_blocks=st.integers(2, 30), window_blocks=st.integers(2, 12), block_size=st.integers(1, 6),
       window=st.integers(1, 12), ops=OPS)
def test_allocation_is_atomic_and_nothing_leaks(full_blocks, window_blocks, block_size, window, ops):
    groups = (KVCacheGroup(None, (0,)), KVCacheGroup(window, (1,)))
    co = KVCacheCoordinator(groups, [full_blocks, window_blocks], block_size)
    full, local = co.managers
    computed: dict[int, int] = {}
    for op, a, b in ops:
        if op == "grow":
            co.release_behind_window(a, computed.get(a, 0))
            if co.can_allocate(a, computed.get(a, 0), b):
                copies = co.allocate_slots(a, computed.get(a, 0), b)
                assert all(g in (0, 1) for g, _, _ in copies)
                computed[a] = computed.get(a, 0) + b
                # The full group holds the context; the window group about one window and the step.
                assert len(full.get_block_table(a)) == full.blocks_for_tokens(computed[a])
                held = [x for x in local.get_block_table(a) if x != FREED]
                assert len(held) <= local.max_blocks_held(computed[a], b)
            else:
                before = _state(co)
                with pytest.raises(NoFreeBlocksError):
                    co.allocate_slots(a, computed.get(a, 0), b)
                assert _state(co) == before, "a failed allocation changed a group"
        elif op == "fork" and a != b and a in co.block_tables and b not in co.block_tables:
            co.fork(a, b)
            computed[b] = computed[a]
        elif op == "free":  # also what preemption does
            co.free(a)
            computed.pop(a, None)
        co.check_invariants()
        assert 0 <= co.usage <= 1
        # kv_cache_usage_perc is the fuller group's fraction, in the reference group's blocks.
        if co.num_used_blocks:
            assert abs(co.num_used_blocks / co.num_blocks - co.usage) <= 0.5 / co.num_blocks + 1e-9 \
                or co.num_used_blocks == 1
        assert (co.num_used_blocks == 0) == all(m.num_used_blocks == 0 for m in co.managers)
    for seq in list(co.block_tables):
        co.free(seq)
    co.check_invariants()
    assert full.num_free_blocks == full_blocks and local.num_free_blocks == window_blocks
    assert co.num_used_blocks == 0


def test_prefix_hit_is_the_longest_every_group_serves():
    co = KVCacheCoordinator(GROUPS, [12, 12], BLOCK, enable_caching=True)
    assert [co.blocks_for_tokens(n) for n in (1, BLOCK, BLOCK + 1)] == [1, 1, 2]  # as BlockManager's
    full, local = co.managers
    tokens = list(range(100, 140))  # 10 blocks
    hashes = block_hashes(tokens, BLOCK)
    co.allocate_slots(1, 0, len(tokens))
    co.register(1, hashes)
    co.release_behind_window(1, len(tokens))  # the window group gives back blocks 0..7 (still keyed)
    assert local.get_block_table(1)[:8] == [FREED] * 8 and len(full.get_block_table(1)) == 10
    co.free(1)
    hit = co.lookup(hashes)
    assert len(hit) == 10 and hit.per_group[0] == full.lookup(hashes)
    assert hit.per_group[1][:8] == [FREED] * 8 and FREED not in hit.per_group[1][8:]
    # The window group reuses its unkeyed blocks first, then the oldest keyed: 0..7 (given back
    # behind the window), then 9, 8 (freed tail first). Taking 11 evicts the hit's own window.
    for seq in range(100, 111):
        local.allocate_slots(seq, 0, BLOCK)
    assert len(full.lookup(hashes)) == 10 and len(local.lookup(hashes)) == 0
    assert len(co.lookup(hashes)) == 0  # the full group alone cannot serve it
    for seq in range(100, 111):
        local.free(seq)
    # Give the window group its blocks back for the first 3 blocks: the hit is what both serve.
    co.allocate_slots(3, 0, 12)
    co.register(3, hashes[:3])
    co.free(3)
    hit = co.lookup(hashes)
    assert len(hit) == 3 and hit.per_group[0] == full.lookup(hashes)[:3]
    assert co.can_allocate_with_prefix(hit, len(hit) * BLOCK - 1, 1)
    co.take_prefix(2, hit)
    co.allocate_slots(2, len(hit) * BLOCK - 1, 1)
    co.check_invariants()
    co.free(2)
    co.check_invariants()
    assert co.num_used_blocks == 0


# -- capacity model --------------------------------------------------------------------------------
def test_capacity_model_bounds_the_local_layers():
    # Gemma 2 9B-like: 42 layers alternating local (4096) / global, 8 KV heads of 256.
    config = dict(architectures=["Gemma2ForCausalLM"], hidden_size=3584, num_hidden_layers=42,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14336,
                  vocab_size=256000, sliding_window=4096)
    shape = ModelShape.from_hf_config(config)
    held = kv_tokens_held(shape, 32768, block_size=16, max_step_tokens=2048)
    # Half the layers hold 32768 slots, half about 4096 + 2048: the per-layer average.
    local = -(-(4096 - 1 + 2048) // 16) * 16 + 16
    assert held == -(-(21 * 32768 + 21 * local) // 42)
    plan = plan_capacity(shape, dtype_size=2, block_size=16, tp=1, gpu_memory_bytes=80 * 1024**3,
                         context_len=32768)
    whole = plan.kv_cache_bytes_per_gpu // (kv_bytes_per_token(shape, 2) * 32768)
    assert plan.max_sequences_at_context_len > 1.5 * whole  # vs every layer holding the context
    # With the window at least as long as the context, nothing changes.
    assert kv_tokens_held(shape, 4000, block_size=16, max_step_tokens=2048) == 4000


# -- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[
    ("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5, num_hidden_layers=4)),
    ("gemma3", dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_scaling={"rope_type": "linear", "factor": 4.0})),
], ids=["gemma2", "gemma3"])
def gemma(request, tiny_model_factory):
    arch, overrides = request.param
    return tiny_model_factory(arch, sliding_window=WINDOW, max_position_embeddings=512, **overrides)


def _run(engine: LLMEngine, prompts, params):
    """Steps the engine to the end; returns each request's samples and each group's peak blocks."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    managers = engine.block_manager.managers
    peaks, done = [0] * len(managers), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.block_manager.check_invariants()
        peaks = [max(p, m.num_used_blocks) for p, m in zip(peaks, managers)]
    assert engine.block_manager.num_used_blocks == 0, "a block leaked"
    return [done[str(i)] for i in range(len(prompts))], peaks


def test_a_long_context_holds_one_window_on_the_local_layers(gemma):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(150)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=512)
    engine = LLMEngine.from_args(model=str(gemma), **kw)
    assert [g.window for g in engine.kv_groups] == [None, WINDOW]
    (got,), (full_peak, local_peak) = _run(engine, [prompt], [params])
    assert got[0] == hf_greedy(gemma, [prompt], [20])[0]
    full, local = engine.block_manager.managers
    # 168 tokens with K/V between steps need 42 blocks in the full group; the local group holds
    # the window before a step plus the step.
    assert full_peak == 42
    assert local_peak <= local.max_blocks_held(169, 16) == 7
    # Without the hybrid manager every layer holds the context.
    one = LLMEngine.from_args(model=str(gemma), disable_hybrid_kv_cache_manager=True, **kw)
    assert one.kv_groups is None and isinstance(one.block_manager, BlockManager)
    # Speculative decoding's steps take one table per sequence: groups are off there.
    spec = LLMEngine.from_args(model=str(gemma), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                               **kw)
    assert spec.kv_groups is None and isinstance(spec.block_manager, BlockManager)


def test_parity_packed_chunked_preempted_prefix_cached_and_forked(gemma):
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(37)]  # several windows long
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 45))] for _ in range(6)]
    max_tokens = [6 + 3 * (i % 4) for i in range(len(prompts))]
    expected = hf_greedy(gemma, prompts, max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, n=2 if i % 3 == 0 else 1)
              for i, n in enumerate(max_tokens)]
    engine = LLMEngine.from_args(model=str(gemma), block_size=BLOCK, num_kv_blocks=24, max_num_batched_tokens=16,
                                 max_num_seqs=10, enable_prefix_caching=True, max_model_len=512)
    assert engine.kv_groups is not None
    (first,), _ = _run(engine, prompts[:1], params[:1])  # so that the others find its blocks cached
    got, peaks = _run(engine, prompts, params)
    for samples, want in zip([first] + got[1:], expected):
        for sample in samples:  # greedy: every sample of an n > 1 request is the same
            assert sample == want
    stats = engine.get_stats()
    assert stats.prefix_cache_hits_total > 0
    assert stats.num_preemptions_total > 0
    assert max(peaks) <= 24


def test_byte_budget_is_split_by_group_need(gemma):
    budget = 1 << 20
    engine = LLMEngine.from_args(model=str(gemma), block_size=BLOCK, kv_cache_memory_bytes=budget,
                                 max_num_batched_tokens=16, max_model_len=512)
    full_blocks, local_blocks = engine.kv_group_blocks
    shape = engine.model_config.shape
    # 512 tokens: 128 blocks in the full group, 7 in the window group; the pools add up to the budget.
    assert full_blocks / local_blocks == pytest.approx(128 / 7, rel=0.05)
    held = sum(pool.numel() * pool.element_size() for layer in engine.kv_caches for pool in layer)
    assert budget - kv_bytes_per_token(shape, 4) * BLOCK * 2 < held <= budget
    # The pool holds more than a single block table would (every layer at full length).
    single = LLMEngine.from_args(model=str(gemma), block_size=BLOCK, kv_cache_memory_bytes=budget,
                                 max_num_batched_tokens=16, max_model_len=512, disable_hybrid_kv_cache_manager=True)
    assert full_blocks > 1.5 * single.num_kv_blocks
    stats = engine.get_stats()
    assert stats.kv_blocks_total == full_blocks and stats.kv_blocks_used == 0


def test_the_cli_flag_reaches_the_engine():
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.server.main import engine_kwargs

    args = build_parser().parse_args(["serve", "/m", "--disable-hybrid-kv-cache-manager"])
    assert engine_kwargs(args)["disable_hybrid_kv_cache_manager"] is True
    assert "disable_hybrid_kv_cache_manager" not in engine_kwargs(build_parser().parse_args(["serve", "/m"]))
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        LLMEngine.from_args(model="/m", disable_hybrid_kv_cache_manager="yes")
