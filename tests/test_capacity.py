"""The shared capacity model: table tests against hand-computed numbers and its invariants."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.runtime.capacity import (
    GiB,
    ModelShape,
    blocks_for_budget,
    dtype_bytes,
    kv_bytes_per_token,
    plan_capacity,
    weight_bytes_per_gpu,
)

LLAMA3_8B = {
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_llama3_8b_numbers_match_hand_computation():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    assert shape.head_dim == 128
    # 2 (K,V) x 32 layers x 8 kv heads x 128 dims x 2 bytes = 128 KiB per token
    assert kv_bytes_per_token(shape, 2) == 131072
    assert kv_bytes_per_token(shape, 2, tp=2) == 65536
    # about 8.03B parameters in bf16
    assert weight_bytes_per_gpu(shape, 2) / 1e9 == pytest.approx(16.06, rel=0.01)


def test_kv_heads_replicate_when_fewer_than_ranks():
    shape = ModelShape.from_hf_config({**LLAMA3_8B, "num_key_value_heads": 2})
    assert kv_bytes_per_token(shape, 2, tp=4) == kv_bytes_per_token(shape, 2, tp=2)


def test_capacity_grows_with_tp_on_80gb():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    tokens = [plan_capacity(shape, dtype_size=2, block_size=16, tp=tp, gpu_memory_bytes=80 * GiB).kv_tokens
              for tp in (1, 2, 4, 8)]
    assert tokens == sorted(tokens) and tokens[0] < tokens[1]
    assert all(t % 16 == 0 for t in tokens)


def test_tp_validity():
    shape = ModelShape.from_hf_config({**LLAMA3_8B, "num_attention_heads": 12, "num_key_value_heads": 4,
                                       "hidden_size": 768})
    assert shape.valid_tp_degrees(16) == [1, 2, 4]
    with pytest.raises(ValueError, match="does not divide the model's 12 attention heads"):
        shape.check_tp(8)


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("float13")


@given(budget=st.integers(0, 10**12), block_size=st.sampled_from([8, 16, 32]), tp=st.sampled_from([1, 2, 4]))
def test_blocks_never_exceed_budget(budget, block_size, tp):
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    blocks = blocks_for_budget(budget, shape, 2, block_size, tp)
    assert blocks * block_size * kv_bytes_per_token(shape, 2, tp) <= budget
    assert (blocks + 1) * block_size * kv_bytes_per_token(shape, 2, tp) > budget
