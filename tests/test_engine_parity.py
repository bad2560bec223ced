"""Greedy outputs of the whole engine equal transformers' generate, token for token.

Every supported architecture and the config options they allow, with 16+ prompts of varied
lengths in one call, a per-step token budget small enough that prompts are chunked, and a KV pool
small enough that requests are preempted and recomputed (asserted).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams

NUM_PROMPTS = 18




def workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [1, 2, 3, 40, 37, 5, 8, 13, 21, 34, 9, 17, 28, 4, 11, 25, 6, 31][:NUM_PROMPTS]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    max_tokens = [4 + (i * 5) % 9 for i in range(NUM_PROMPTS)]  # 4..12
    return prompts, max_tokens


def hf_greedy(model_dir, prompts, max_tokens):
    """transformers' own generate, one unpadded prompt at a time, cut after the first EOS."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    out = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
            for i, t in enumerate(g):
                if t in eos:
                    g = g[: i + 1]
                    break
            out.append(g)
    return out


def run_engine(model_dir, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(model_dir), **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


# Budget 16 < the longest prompts (40): they are prefilled in chunks. 20 blocks of 4 = 80 tokens
# cannot hold the 18 requests at once: preemptions must happen.
SQUEEZED = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=16)

CONFIGS = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("mistral", {}, id="mistral"),
    pytest.param("qwen2", {}, id="qwen2-bias"),
    pytest.param("qwen3", {}, id="qwen3-qknorm"),
    pytest.param("llama", dict(num_key_value_heads=1), id="llama-mqa"),
    pytest.param("llama", dict(head_dim=32), id="llama-headdim32"),
    pytest.param("qwen2", dict(tie_word_embeddings=True, vocab_size=509), id="qwen2-tied-oddvocab"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), id="llama-rope-linear"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16},
                               rope_theta=50000.0), id="llama-rope-llama3"),
    pytest.param("mistral", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                 tie_word_embeddings=True), id="mistral-gqa4-headdim24-tied"),
    # Sliding windows (7, 8) shorter than most prompts (up to 40 tokens) and than the chunks (16).
    pytest.param("mistral", dict(sliding_window=7), id="mistral-window7"),
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
                 id="qwen2-window7-layer1"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5),
                 id="gemma2-window8-softcaps"),
    pytest.param("gemma3", dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"],
                                rope_scaling={"rope_type": "linear", "factor": 4.0}), id="gemma3-window8-local-rope"),
    # Mixture of experts (testing/tinymodels.py holds each family's small expert layout).
    pytest.param("mixtral", {}, id="mixtral-top2of4"),
    pytest.param("qwen2_moe", {}, id="qwen2moe-gated-shared-expert"),
    pytest.param("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2, num_hidden_layers=3),
                 id="qwen2moe-normtopk-sparse-step"),
    pytest.param("qwen3_moe", dict(mlp_only_layers=[0]), id="qwen3moe-qknorm-mlp-only-layer"),
    # DeepSeek: MLA (latent cache, absorbed decode, up-projected prefill) + MoE with shared experts.
    pytest.param("deepseek_v2", {}, id="deepseekv2-mla-greedy"),
    pytest.param("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                     routed_scaling_factor=1.5, q_lora_rank=40),
                 id="deepseekv2-group-limited-qlora"),
    pytest.param("deepseek_v3", {}, id="deepseekv3-noaux-tc"),
    pytest.param("deepseek_v3", dict(rope_interleave=False, first_k_dense_replace=0,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                   "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}),
                 id="deepseekv3-yarn-mscale-no-interleave"),
]


@pytest.mark.parametrize("arch,overrides", CONFIGS)
def test_greedy_parity_chunked_and_preempted(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    vocab = min(overrides.get("vocab_size", 512), 512)
    prompts, max_tokens = workload(vocab)
    expected = hf_greedy(model_dir, prompts, max_tokens)
    squeezed = dict(SQUEEZED)
    if arch == "mistral" and overrides.get("sliding_window"):
        # Every layer is local: sequences hold only their window, so preemption needs a smaller pool.
        squeezed["num_kv_blocks"] = 10
    got, engine = run_engine(model_dir, prompts, max_tokens, **squeezed)
    assert max(len(p) for p in prompts) > SQUEEZED["max_num_batched_tokens"]  # chunked prefill
    assert engine.get_stats().num_preemptions_total > 0
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0


def test_greedy_parity_roomy_single_step_prefill(tiny_llama):
    prompts, max_tokens = workload(512, seed=1)
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    got, engine = run_engine(tiny_llama, prompts, max_tokens, block_size=16, num_kv_blocks=256)
    assert engine.get_stats().num_preemptions_total == 0
    assert got == expected


def _random_config(seed: int) -> tuple[str, dict]:
    """A config drawn from what these families allow, not one of the enumerated cases."""
    rng = random.Random(seed)
    arch = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    kv_heads = rng.choice([1, 2, 4])
    heads = kv_heads * rng.choice([1, 2, 3])
    overrides = dict(num_attention_heads=heads, num_key_value_heads=kv_heads,
                     # transformers wants hidden_size % heads == 0 even with an explicit head_dim
                     hidden_size=heads * rng.choice([8, 16, 24]), head_dim=rng.choice([8, 16, 24, 32]),
                     intermediate_size=rng.choice([64, 160]), num_hidden_layers=rng.choice([1, 2, 3]),
                     tie_word_embeddings=rng.random() < 0.5, vocab_size=rng.choice([400, 512]),
                     rope_theta=rng.choice([10000.0, 1e6]))
    if rng.random() < 0.5:
        overrides["rope_scaling"] = {"rope_type": "linear", "factor": rng.choice([2.0, 4.0])}
    return arch, overrides


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_greedy_parity_on_drawn_configs(tiny_model_factory, seed):
    arch, overrides = _random_config(seed)
    model_dir = tiny_model_factory(arch, **overrides)
    prompts, max_tokens = workload(overrides["vocab_size"], seed=seed)
    expected = hf_greedy(model_dir, prompts, max_tokens)
    got, engine = run_engine(model_dir, prompts, max_tokens, **SQUEEZED)
    assert got == expected, (arch, overrides)
    assert engine.block_manager.num_used_blocks == 0
