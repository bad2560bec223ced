"""torch.compile over the Triton attention backend: the launchers are custom ops
(kernels/custom_ops.py), so a dynamic-shape compile traces each launch as one opaque call and
does not recompile per decode step although the split count differs from step to step (on a GPU
it does: the device is made to report an H100's 132 SMs here). The compiled function runs the
real kernels (interpreter) and must agree with the eager call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_attention import Batch, _assert_close  # noqa: E402

from kvserve.kernels import attention  # noqa: E402
from kvserve.runtime.attention.backend import AttentionMetadata  # noqa: E402
from kvserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # more sizes than dynamo's recompile limit (8)


def _step(backend, query, key, value, k_cache, v_cache, qsl, seq_lens, tables, slots, max_seq_len, decode):
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
                             max_query_len=1 if decode else 64, max_seq_len=max_seq_len, is_decode_only=decode)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    return backend.attend(query, key, value, k_cache, v_cache, meta, 0.25) * 2


def test_compiled_backend_does_not_recompile_per_split_count(monkeypatch):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    monkeypatch.setattr(attention, "device_sms", lambda device: 132)
    # Batch n decodes under a max_seq_len of n * 128: n splits of 32 on an H100.
    splits = {attention.decode_num_splits(132, n, 1, 128 * n, 128) for n in BUCKETS}
    assert len(splits) > 8, splits  # what made dynamo give up before the launchers were ops
    counter = CompileCounter()
    backend = TritonAttentionBackend()
    compiled = torch.compile(lambda *a: _step(backend, *a), backend=counter, dynamic=True, fullgraph=True)
    settled = None
    # This test's block tables happen to be as wide as other sizes: duck sizing would recompile for that.
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        for i, n in enumerate(BUCKETS):
            if i == 2:
                # By now dynamo has seen a batch of 1 (specialised), then marked the sizes and the
                # ints dynamic; from here on nothing may recompile whatever the split count.
                settled = counter.frame_count
            b = Batch([(5 + 3 * i, 1) for i in range(n)], dtype=torch.float32, head_dim=16, block_size=16, heads=2,
                      kv_heads=1, seed=n)
            empty = torch.zeros(0, 1, 16)  # nothing to write: the step's K/V are already cached
            slots = torch.zeros(0, dtype=torch.long)
            args = (b.query, empty, empty, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                    slots, 128 * n, True)
            _assert_close(compiled(*args), b.expected() * 2, torch.float32)
    assert counter.frame_count == settled <= 2, f"{counter.frame_count} compiles for {len(BUCKETS)} steps"


def test_compiled_prefill_writes_the_cache_and_matches_eager():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    backend = TritonAttentionBackend()
    compiled = torch.compile(lambda *a: _step(backend, *a), backend=counter, dynamic=True, fullgraph=True)
    for seed, specs in enumerate(([(0, 9), (4, 3)], [(0, 20)], [(2, 5), (0, 1), (0, 7)])):
        b = Batch(specs, dtype=torch.float32, head_dim=16, block_size=16, heads=2, kv_heads=1, seed=seed)
        new = torch.cat([torch.arange(s, s + q) + sum(c + qq for c, qq in specs[:i])
                         for i, (s, q) in enumerate(specs)])
        slots = b.all_slots[new]
        key, value = b.keys[new], b.values[new]
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        k_cache.view(-1, 1, 16)[slots] = float("nan")  # the op must write these back
        v_cache.view(-1, 1, 16)[slots] = float("nan")
        out = compiled(b.query, key, value, k_cache, v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                       slots, max(c + q for c, q in specs), False)
        _assert_close(out, b.expected() * 2, torch.float32)
        torch.testing.assert_close(k_cache, b.k_cache, equal_nan=True)
    assert counter.frame_count <= 3
