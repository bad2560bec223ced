"""The capacity model with sliding windows: what is bounded by the window (every layer local:
Mistral) and what is not (Gemma's and Qwen2's mixed layers), in agreement with the block manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.capacity import (
    GiB,
    ModelShape,
    kv_bytes_per_context_token,
    kv_bytes_per_token,
    kv_tokens_held,
    plan_capacity,
)
from kvserve.runtime.engine.block_manager import BlockManager

# Real models' configs (the fields that matter here).
MISTRAL_7B_V01 = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
                      max_position_embeddings=32768)
GEMMA2_9B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584,
                 intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, vocab_size=256000, sliding_window=4096, tie_word_embeddings=True)
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
                 intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, vocab_size=262144, sliding_window=512, sliding_window_pattern=6)


def test_every_layer_local_bounds_what_a_long_context_holds():
    shape = ModelShape.from_hf_config(MISTRAL_7B_V01)
    assert shape.kv_release_window == 4096 and shape.num_sliding_layers == 32
    # A 32k-token sequence holds 4095 + 2048 tokens, rounded to blocks (+1 for alignment).
    held = kv_tokens_held(shape, 32768, block_size=16, max_step_tokens=2048)
    assert held == (-(-(4095 + 2048) // 16) + 1) * 16 == 6160
    assert kv_tokens_held(shape, 1000, block_size=16, max_step_tokens=2048) == 1008  # inside the window
    per_token = kv_bytes_per_context_token(shape, 2, 32768)
    assert per_token == pytest.approx(kv_bytes_per_token(shape, 2) * 6160 / 32768)
    plan = plan_capacity(shape, dtype_size=2, block_size=16, tp=1, gpu_memory_bytes=80 * GiB,
                         context_len=32768, max_step_tokens=2048)
    assert plan.max_sequences_at_context_len == plan.kv_tokens // 6160
    # Without the window the same pool holds 32768 / 6160 = 5.3x fewer of those sequences.
    no_window = ModelShape.from_hf_config({**MISTRAL_7B_V01, "sliding_window": None})
    assert no_window.kv_release_window is None
    full = plan_capacity(no_window, dtype_size=2, block_size=16, tp=1, gpu_memory_bytes=80 * GiB,
                         context_len=32768, max_step_tokens=2048)
    assert full.kv_tokens == plan.kv_tokens  # the pool's slots are the same
    assert full.max_sequences_at_context_len == plan.kv_tokens // 32768
    assert plan.max_sequences_at_context_len >= 5 * full.max_sequences_at_context_len


@pytest.mark.parametrize("config,local", [(GEMMA2_9B, 21), (GEMMA3_1B, 22)])
def test_mixed_local_global_layers_bound_only_the_local_layers(config, local):
    shape = ModelShape.from_hf_config(config)
    assert shape.sliding_window == config["sliding_window"] and shape.num_sliding_layers == local
    assert shape.kv_release_window is None  # one table for all layers would free nothing
    # With KV cache groups (the runtime's default at TP 1) the local layers hold their window.
    bound = (-(-(config["sliding_window"] - 1 + 2048) // 16) + 1) * 16
    layers = config["num_hidden_layers"]
    held = kv_tokens_held(shape, 100_000, block_size=16, max_step_tokens=2048)
    assert held == -(-((layers - local) * 100_000 + local * bound) // layers)
    assert kv_bytes_per_context_token(shape, 2, 100_000) == pytest.approx(kv_bytes_per_token(shape, 2) * held / 100_000)
    # One block table for every layer (tensor parallelism, or the hybrid manager disabled).
    assert kv_tokens_held(shape, 100_000, block_size=16, max_step_tokens=2048, kv_cache_groups=False) == 100_000


def test_qwen2_window_only_with_use_sliding_window():
    base = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                sliding_window=32, max_window_layers=0)
    assert ModelShape.from_hf_config(base).num_sliding_layers == 0
    every = ModelShape.from_hf_config({**base, "use_sliding_window": True})
    assert every.kv_release_window == 32
    some = ModelShape.from_hf_config({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert some.num_sliding_layers == 2 and some.kv_release_window is None


def test_a_bad_window_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="sliding_window"):
        ModelShape.from_hf_config({**MISTRAL_7B_V01, "sliding_window": -5})


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 300), context=st.integers(1, 3000), block=st.integers(1, 64), step=st.integers(1, 512))
def test_capacity_model_and_block_manager_agree(window, context, block, step):
    shape = ModelShape.from_hf_config({**MISTRAL_7B_V01, "sliding_window": window})
    bm = BlockManager(1, block, sliding_window=window)
    assert kv_tokens_held(shape, context, block_size=block, max_step_tokens=step) == \
        bm.max_blocks_held(context, step) * block
