"""Tiny random-weight Hugging Face model directories, built on the fly for tests and benchmarks.

Weights are drawn at std 0.1 (not transformers' 0.02): at 0.02 a tiny model repeats one token
whatever its context, which would hide attention and cache bugs. Everything is seeded, so the same
(arch, overrides) always gives the same directory contents.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
         "deepseek_v2", "deepseek_v3", "phi3", "mpt", "bloom", "falcon")

INIT_STD = 0.1

# Small enough that a CPU forward takes milliseconds, big enough to exercise GQA (4 q / 2 kv heads).
_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=INIT_STD,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# "<|endoftext|>" is in the vocabulary because transformers loads any qwen2 directory with
# Qwen2Tokenizer, which adds it as unk: outside the vocabulary it would get id == vocab_size.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
                  "<|endoftext|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system keeps many requests in flight at
once and shares the memory of its key value cache between them. Once upon a time there was a
little model that wanted to answer every question it was asked, quickly and correctly.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France, and Berlin is the capital of Germany. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.
Kubernetes schedules pods onto nodes; an operator watches custom resources and reconciles them.
The weather is nice, the sun is shining, and the birds are singing in the trees near the river.
def add(a, b): return a + b  # code, punctuation: ()[]{}<>,.;:!?'"-_=+*/\\|@#$%^&~`
Tokens are merged into words, words into sentences, sentences into stories about cats and dogs.
Café, naïve, résumé, 東京, Привет, emoji 🙂 — multi-byte text must survive decoding intact.
"""


# Mixture-of-experts and MLA families: few, small experts (every expert is still exercised by a few
# dozen tokens) and latent sizes that differ from every other dimension, so a transposed or
# mis-split weight cannot go unnoticed.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, use_sliding_window=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True, use_sliding_window=False),
    "deepseek_v2": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=1.0),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def _config(arch: str, overrides: dict[str, Any]):
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch: unsupported {arch!r}; supported: {list(ARCHS)}")
    kwargs = dict(_DEFAULTS)
    if arch in ("mistral", "phi3"):
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    if arch in ("gemma2", "gemma3"):
        # Gemma's own defaults are for 2B+ models: a small window (so the test prompts are longer
        # than it), query_pre_attn_scalar != head_dim (so the scale is checked), tied embeddings.
        kwargs.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
                      hidden_activation="gelu_pytorch_tanh")
    kwargs.update(_FAMILY_DEFAULTS.get(arch, {}))
    kwargs.update(overrides)
    if arch == "mpt":  # MPT's own names; multi-head, tied, no biases, ALiBi, an MLP of 4 x d_model
        kwargs = dict(d_model=kwargs["hidden_size"], n_heads=kwargs["num_attention_heads"],
                      n_layers=kwargs["num_hidden_layers"], expansion_ratio=4,
                      max_seq_len=kwargs["max_position_embeddings"], vocab_size=kwargs["vocab_size"],
                      layer_norm_epsilon=kwargs.get("layer_norm_epsilon", 1e-5), initializer_range=INIT_STD,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_config=kwargs.get("attn_config"))
    if arch == "bloom":  # BLOOM's names; multi-head, tied, biases everywhere, ALiBi, an MLP of 4 x hidden
        kwargs = dict(hidden_size=kwargs["hidden_size"], n_head=kwargs["num_attention_heads"],
                      n_layer=kwargs["num_hidden_layers"], vocab_size=kwargs["vocab_size"],
                      layer_norm_epsilon=kwargs.get("layer_norm_epsilon", 1e-5), initializer_range=INIT_STD,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "falcon":  # by default the ALiBi variant (Falcon-RW): a KV head per head, sequential attention and MLP
        variant = {k: overrides[k] for k in ("alibi", "multi_query", "parallel_attn", "new_decoder_architecture", "bias",
                                             "num_kv_heads", "num_ln_in_parallel_attn") if k in overrides}
        kwargs = dict(hidden_size=kwargs["hidden_size"], num_attention_heads=kwargs["num_attention_heads"],
                      num_hidden_layers=kwargs["num_hidden_layers"], vocab_size=kwargs["vocab_size"], alibi=True,
                      multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True,
                      initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        kwargs.update(variant)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "mpt": transformers.MptConfig,
        "bloom": transformers.BloomConfig,
        "falcon": transformers.FalconConfig,
    }[arch]
    return cls(**kwargs)


def _model_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "mpt": transformers.MptForCausalLM,
        "bloom": transformers.BloomForCausalLM,
        "falcon": transformers.FalconForCausalLM,
    }[arch]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a small built-in corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines()
    tok.train_from_iterator([*lines] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path, arch: str = "llama", *, seed: int = 0, **config_overrides) -> pathlib.Path:
    """Writes a complete HF model directory (config, safetensors weights, generation config,
    tokenizer with chat template) to `path` and returns it as a Path.

    `config_overrides` go straight into the transformers config (e.g. num_key_value_heads=1,
    head_dim=24, tie_word_embeddings=True, rope_theta=..., rope_scaling={...}, vocab_size=509).
    The tokenizer never has more entries than vocab_size; the special ids are 0 pad, 1 bos, 2 eos.
    """
    import torch
    from transformers import GenerationConfig

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _config(arch, dict(config_overrides))
    if config.vocab_size < len(SPECIAL_TOKENS) + 260:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 260} for the byte-level tokenizer")

    # Each arch gets its own weights so that llama and mistral do not test the identical model. The
    # stride stays 4 (the arch count when seeds were first drawn) as ARCHS grows: tests pin models
    # by seed (a draft that must resemble its target), so existing (arch, seed) weights never change.
    seed = seed * 4 + ARCHS.index(arch)
    torch.manual_seed(seed)
    model = _model_class(arch)(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        gemma = arch.startswith("gemma")
        for name, p in model.named_parameters():
            if (name.endswith("norm.weight") or (arch == "mpt" and "norm_" in name)  # MPT: norm_1/2, norm_f
                    or name.endswith("ln_f.weight")):  # BLOOM's final norm
                # Norm gains around 1 with some spread, so q/k norms and final norm are not no-ops
                # (Gemma's norms scale by 1 + weight).
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # DeepSeek V3's routing bias starts at zero; a random one tests that it steers the
                # choice of experts but not their weights.
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        if config.tie_word_embeddings:
            model.tie_weights()
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False,
    ).save_pretrained(path)

    tokenizer = build_tokenizer(min(config.vocab_size, 512))
    tokenizer.save_pretrained(path)
    return path


def tiny_key(arch: str, overrides: dict[str, Any]) -> str:
    """A stable, filesystem-safe cache key for (arch, overrides)."""
    import hashlib

    blob = json.dumps({"arch": arch, **overrides}, sort_keys=True, default=str)
    return f"{arch}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"
