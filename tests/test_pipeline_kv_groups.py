"""KV cache groups (Gemma's local and global layers) at pipeline_parallel_size > 1
(runtime/executor/pipeline_kv_groups.py): each stage pools its own layers by group, rank 0 keeps
one block table per group, so the window group really holds fewer blocks, and PP=2 greedy output
equals PP=1's with the groups (itself checked against transformers in test_hybrid_kv_cache.py),
with the KV offload tier (file) and swap space under the groups, a stage holding no layer of a
group included.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.engine.kv_cache_groups import KVCacheGroup
from kvserve.runtime.executor.pipeline_kv_groups import UNBOUNDED, local_groups, stage_block_bytes, stage_group_blocks

WINDOW, BLOCK = 8, 4
GROUPS = (KVCacheGroup(None, (1,)), KVCacheGroup(WINDOW, (0, 2)))


@pytest.mark.parametrize("start,end,expected", [
    (0, 3, [(None, (1,)), (WINDOW, (0, 2))]),
    (0, 1, [(None, ()), (WINDOW, (0,))]),  # only a local layer
    (1, 3, [(None, (0,)), (WINDOW, (1,))]),
    (2, 3, [(None, ()), (WINDOW, (0,))]),
])
def test_local_groups_renumber_the_stage_layers(start, end, expected):
    assert [(g.window, g.layers) for g in local_groups(GROUPS, start, end)] == expected


@pytest.mark.parametrize("groups,ranges,expected", [
    (GROUPS, [(0, 2), (2, 3)], [1, 1]),  # stage 1 holds no full layer: stage 0's counts
    (GROUPS, [(0, 1), (1, 3)], [1, 1]),
    (GROUPS, [(0, 3)], [1, 2]),
    (None, [(0, 2), (2, 3)], [2]),  # one table: the stage with the most layers
])
def test_offloaded_block_bytes_count_the_largest_stage_share(groups, ranges, expected):
    assert stage_block_bytes(groups, ranges, 100) == [100 * n for n in expected]


def test_a_stage_bounds_only_the_groups_it_holds():
    from kvserve.runtime.capacity.pipeline import layer_shape
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=512, max_position_embeddings=512))
    kw = dict(max_model_len=512, max_step_tokens=16)
    explicit = EngineConfig(model="/m", num_kv_blocks=20, block_size=BLOCK)
    assert stage_group_blocks(explicit, layer_shape(cfg.shape, 0, 1), torch.float32, torch.device("cpu"), GROUPS,
                              0, 1, budget_bytes=None, **kw) == [UNBOUNDED, 20]
    budget = EngineConfig(model="/m", block_size=BLOCK)
    per_block = 2 * 2 * 16 * 4 * BLOCK  # K and V, 2 KV heads of 16 floats, one layer
    only_local = stage_group_blocks(budget, layer_shape(cfg.shape, 0, 1), torch.float32, torch.device("cpu"),
                                    GROUPS, 0, 1, budget_bytes=100 * per_block, **kw)
    assert only_local == [UNBOUNDED, 100]  # its whole budget for its one group
    both = stage_group_blocks(budget, layer_shape(cfg.shape, 1, 3), torch.float32, torch.device("cpu"), GROUPS,
                              1, 3, budget_bytes=200 * per_block, **kw)
    assert both[1] < both[0] < 200 * 2  # split by need: the full layer's share is far larger


@pytest.fixture(scope="module")
def gemma3(tiny_model_factory):
    return tiny_model_factory("gemma3", sliding_window=WINDOW, max_position_embeddings=512, num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    managers = engine.block_manager.managers
    peaks, done = [0] * len(managers), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        engine.block_manager.check_invariants()
        peaks = [max(p, m.num_used_blocks) for p, m in zip(peaks, managers)]
    assert engine.block_manager.num_used_blocks == 0, "a block leaked"
    return [done[str(i)] for i in range(len(prompts))], peaks


def test_pp2_with_groups_equals_pp1(gemma3, tmp_path):
    from kvserve.runtime.executor.pipeline_worker import stage_ranges

    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # several windows long, prefix-cached
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=BLOCK, max_num_batched_tokens=16, max_model_len=512, enable_prefix_caching=True,
              kv_cache_memory_bytes=48 * 1024)
    with LLMEngine.from_args(model=str(gemma3), **kw) as one:
        want, _ = _run(one, prompts, params)
    # The file tier and swap space under the groups: every stage saves and loads its own layers
    # of each group's blocks (stage 1 holds no full-attention layer: a marker per block).
    offload = dict(kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path), swap_space=0.001)
    with LLMEngine.from_args(model=str(gemma3), pipeline_parallel_size=2, **kw, **offload) as two:
        assert [g.window for g in two.kv_groups] == [None, WINDOW]
        ranges = stage_ranges(two.executor.config, two.model_config)
        # Some stage holds only sliding-window layers (3 layers: local, global, local).
        assert any(not g.layers for s, e in ranges for g in local_groups(two.kv_groups, s, e))
        full_blocks, local_blocks = two.kv_group_blocks
        assert local_blocks < full_blocks / 4  # the window pool really is smaller
        # Rank 0's stage pools each of its layers with its own group's block count.
        windows = [two.model_config.layer_window(i) for i in range(*ranges[0])]
        assert [layer[0].shape[0] for layer in two.kv_caches] == [
            local_blocks if w is not None else full_blocks for w in windows]
        layer = sum(p[0].numel() * p.element_size() for p in two.kv_caches[0])
        assert two.executor.offloader.block_bytes == [layer, layer]
        assert two.executor.offload_block_bytes == [layer, layer]  # the tier's budget counts these
        got, _ = _run(two, prompts, params)
        again, _ = _run(two, prompts, params)  # returning: prefixes evicted from the pool come from the tier
        stats = two.get_stats()
    assert got == want and again == want
    assert stats.prefix_cache_hits_total > 0 and stats.num_preemptions_total > 0
    assert stats.kv_offload_hit_tokens_total > 0 and stats.kv_offload_failed_loads_total == 0
    # Every stage holds every key (one namespace per stage); stage 1's full-group files are markers.
    names = [{p.name for p in d.glob("*.kvb")} for d in sorted(p for p in tmp_path.iterdir() if p.is_dir())]
    assert len(names) == 2 and names[0] == names[1] and {n[:2] for n in names[0]} == {"00", "01"}


def test_capacity_plan_at_pp2_counts_each_stage_with_its_groups():
    """The capacity model at PP: sequences of a context length are the fewest any stage holds,
    each stage counting its own layers' groups (a local layer keeps its window, not the context)."""
    from kvserve.runtime.capacity import ModelShape, plan_capacity

    # Gemma 2 9B-like: 42 layers alternating local (4096) / global.
    shape = ModelShape.from_hf_config(dict(
        architectures=["Gemma2ForCausalLM"], hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000, sliding_window=4096))
    kw = dict(dtype_size=2, block_size=16, tp=1, gpu_memory_bytes=40 * 1024**3, context_len=32768)
    plan = plan_capacity(shape, pp=2, **kw)
    assert plan.context_tokens == plan.max_sequences_at_context_len * 32768
    # Groups at PP: more sequences than every layer holding the context on the same budget.
    whole = plan.kv_cache_bytes_per_gpu // (plan.kv_bytes_per_token_per_gpu * 32768)
    assert plan.max_sequences_at_context_len > 1.5 * whole
    # And about twice what one 40 GB GPU holds at PP=1 (the weights and KV split over two).
    one = plan_capacity(shape, pp=1, **kw)
    assert plan.max_sequences_at_context_len > 1.5 * one.max_sequences_at_context_len
