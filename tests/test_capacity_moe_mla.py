"""The capacity model for mixture-of-experts and MLA models, against hand-computed numbers from
the published configs (DeepSeek-V3, DeepSeek-V2-Lite, Mixtral-8x7B, Qwen3-30B-A3B)."""

import pytest

from kvserve.runtime.capacity import (
    GiB,
    ModelShape,
    active_parameters,
    kv_bytes_per_token,
    plan_capacity,
    weight_bytes_per_gpu,
)

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 27,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400, "topk_method": "greedy",
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 32,
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
}


def test_deepseek_v3_latent_kv_and_all_experts_resident():
    shape = ModelShape.from_hf_config(DEEPSEEK_V3)
    assert shape.mla is not None and shape.moe is not None
    assert shape.moe.moe_layers == tuple(range(3, 61)) and shape.moe.shared_intermediate_size == 2048
    # One latent of 512 + 64 values per token and layer: 61 x 576 x 2 bytes, whatever the TP degree
    # (every rank keeps the whole latent).
    assert kv_bytes_per_token(shape, 2) == 61 * 576 * 2 == 70272
    assert kv_bytes_per_token(shape, 2, tp=8) == 70272
    assert shape.kv_cache_layout(8) == (1, 1, 576)
    # 671B parameters without the multi-token-prediction layer, 37B active per token.
    assert weight_bytes_per_gpu(shape, 1) / 1e9 == pytest.approx(671, rel=0.01)
    assert active_parameters(shape) / 1e9 == pytest.approx(37.5, rel=0.02)
    # Heads and every intermediate size (18432 = 2^11 x 9, 2048) divide up to 128 ranks.
    assert shape.valid_tp_degrees(256) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_deepseek_v2_lite_numbers():
    shape = ModelShape.from_hf_config(DEEPSEEK_V2_LITE)
    assert kv_bytes_per_token(shape, 2) == 27 * 576 * 2
    assert weight_bytes_per_gpu(shape, 1) / 1e9 == pytest.approx(15.7, rel=0.01)  # "16B total"
    assert active_parameters(shape) / 1e9 == pytest.approx(2.66, rel=0.05)  # "2.4B activated" + embeddings


def test_mla_cuts_kv_bytes_by_more_than_an_order_of_magnitude():
    shape = ModelShape.from_hf_config(DEEPSEEK_V3)
    m = shape.mla
    # The same model with per-head K (nope + rope) and V cached: what MLA avoids.
    mha = 61 * 128 * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    assert mha / kv_bytes_per_token(shape, 2) > 70


def test_mixtral_8x7b_numbers_and_tp():
    shape = ModelShape.from_hf_config(MIXTRAL_8X7B)
    assert shape.moe.expert_intermediate_size == 14336 and shape.moe.moe_layers == tuple(range(32))
    assert kv_bytes_per_token(shape, 2) == 2 * 32 * 8 * 128 * 2
    assert weight_bytes_per_gpu(shape, 1) / 1e9 == pytest.approx(46.7, rel=0.01)
    assert active_parameters(shape) / 1e9 == pytest.approx(12.9, rel=0.01)
    # Experts are split by their intermediate dimension: half of every expert per rank at TP 2.
    assert weight_bytes_per_gpu(shape, 2, tp=2) == pytest.approx(weight_bytes_per_gpu(shape, 2) / 2, rel=0.01)
    assert shape.valid_tp_degrees(64) == [1, 2, 4, 8, 16, 32]


def test_qwen3_moe_numbers():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert shape.moe.num_experts == 128 and shape.moe.shared_intermediate_size == 0
    assert weight_bytes_per_gpu(shape, 1) / 1e9 == pytest.approx(30.5, rel=0.01)
    assert active_parameters(shape) / 1e9 == pytest.approx(3.3, rel=0.03)


def test_tp_must_divide_expert_intermediate_sizes():
    shape = ModelShape.from_hf_config({**MIXTRAL_8X7B, "intermediate_size": 1000})  # 1000 = 2^3 x 125
    assert shape.valid_tp_degrees(32) == [1, 2, 4, 8]
    assert "expert intermediate size 1000" in shape.tp_error(16)
    shared = ModelShape.from_hf_config({**DEEPSEEK_V2_LITE, "n_shared_experts": 3, "moe_intermediate_size": 1408})
    assert shared.moe.shared_intermediate_size == 4224 and shared.valid_tp_degrees(64) == [1, 2, 4, 8, 16]
    dense = ModelShape.from_hf_config({**DEEPSEEK_V2_LITE, "intermediate_size": 10946})  # first layer dense
    assert "dense intermediate size 10946" in dense.tp_error(4)


def test_mla_kv_capacity_does_not_grow_with_tp_but_weights_shrink():
    shape = ModelShape.from_hf_config(DEEPSEEK_V2_LITE)
    plans = [plan_capacity(shape, dtype_size=2, block_size=16, tp=tp, gpu_memory_bytes=80 * GiB) for tp in (1, 2, 4)]
    assert len({p.kv_bytes_per_token_per_gpu for p in plans}) == 1
    assert plans[0].weight_bytes_per_gpu > plans[1].weight_bytes_per_gpu > plans[2].weight_bytes_per_gpu
    assert plans[0].kv_tokens < plans[1].kv_tokens < plans[2].kv_tokens  # freed weight memory only


@pytest.mark.parametrize("config,field", [
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": None}, "num_experts_per_tok"),
    ({**DEEPSEEK_V3, "moe_layer_freq": 2}, "moe_layer_freq"),
    ({**DEEPSEEK_V3, "kv_lora_rank": 0}, "kv_lora_rank"),
    ({**QWEN3_30B_A3B, "moe_intermediate_size": "big"}, "moe_intermediate_size"),
])
def test_bad_moe_and_mla_fields_are_named(config, field):
    with pytest.raises(ValueError, match=field):
        ModelShape.from_hf_config(config)
