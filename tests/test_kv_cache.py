"""KV pool sizing (explicit blocks, byte budget, CPU default) and allocation shapes."""

import pytest
import torch

from kvserve.runtime.capacity import ModelShape, kv_bytes_per_token
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.kv_cache import allocate_kv_cache, copy_blocks, determine_num_blocks

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=512)
CPU = torch.device("cpu")


def test_explicit_block_count_wins():
    cfg = EngineConfig(model="m", num_kv_blocks=7, kv_cache_memory_bytes=1 << 30)
    assert determine_num_blocks(cfg, SHAPE, torch.float32, CPU) == 7


def test_byte_budget_uses_the_capacity_model():
    per_token = kv_bytes_per_token(SHAPE, 4)  # 2 x 2 layers x 2 heads x 16 x 4 bytes = 512
    assert per_token == 512
    cfg = EngineConfig(model="m", block_size=16, kv_cache_memory_bytes=512 * 16 * 10 + 100)
    assert determine_num_blocks(cfg, SHAPE, torch.float32, CPU) == 10
    assert determine_num_blocks(cfg, SHAPE, torch.bfloat16, CPU) == 20


def test_cpu_default_and_too_small_budget():
    cfg = EngineConfig(model="m", block_size=16)
    assert determine_num_blocks(cfg, SHAPE, torch.float32, CPU) == EngineConfig.DEFAULT_CPU_KV_BYTES // (512 * 16)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        determine_num_blocks(EngineConfig(model="m", kv_cache_memory_bytes=100), SHAPE, torch.float32, CPU)


def test_pools_shape_and_copy_on_write_copies():
    caches = allocate_kv_cache(SHAPE, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 16) and not k.any()
    caches[1][0][2] = 3.0
    copy_blocks(caches, [(2, 4)])
    assert torch.equal(caches[1][0][4], caches[1][0][2]) and not caches[1][0][3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_large_cpu_pools_are_lazily_zeroed_maps_that_read_and_write_like_zeros(dtype):
    from kvserve.runtime.kv_cache import LAZY_ZERO_BYTES, zeroed

    shape = (LAZY_ZERO_BYTES // 64 + 1, 16, 2, 2)  # just above the threshold, any dtype
    pool = zeroed(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % 4096 == 0  # page-aligned (the native kernels' vector loads)
    assert not pool.float().any()
    pool[3, 1] = 2
    assert pool.float().sum() == 2 * 4 and not pool[4].float().any()
    small = zeroed((2, 16, 2, 2), dtype, "cpu")  # below it: an ordinary tensor
    assert not small.float().any()


def test_held_release_closes_many_workers_with_one_collection():
    from kvserve.runtime.executor.platform import held_release, release_is_held

    class Counting:  # the one method held_release calls
        calls = 0

        def release_memory(self):
            Counting.calls += 1

    platform = Counting()
    with held_release(platform):
        with held_release(platform):
            assert release_is_held()
        assert Counting.calls == 0
    assert Counting.calls == 1 and not release_is_held()
