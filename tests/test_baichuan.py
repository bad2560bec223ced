"""Baichuan (remote code only: transformers has no class for it): Baichuan-13B (ALiBi inside
Llama-style layers: RMSNorm, SiLU-gated MLP, the fused `W_pack` q|k|v) and Baichuan-7B (the same
with RoPE; told apart as vLLM's loaders do by what the config carries: 7B's config has
max_position_embeddings, 13B's only model_max_length). The oracle is a float64 reimplementation of
the published modeling code, run on a tiny random checkpoint written here with safetensors and a
config.json naming `BaichuanForCausalLM`."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.models.mpt import alibi_slopes

H, HEADS, LAYERS, INTER, VOCAB = 96, 6, 2, 160, 512
PROMPT = [1, 40, 41, 42, 300, 17, 5, 9, 250, 12]


@pytest.fixture(scope="module", params=["13b-alibi", "7b-rope"])
def checkpoint(request, tmp_path_factory):
    from safetensors.torch import save_file

    from kvserve.testing.tinymodels import build_tokenizer

    path = tmp_path_factory.mktemp(request.param)
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape, std=0.05):
        return std * torch.randn(*shape, generator=gen)

    w = {"model.embed_tokens.weight": rnd(VOCAB, H, std=0.5), "model.norm.weight": 1 + rnd(H, std=0.1),
         "lm_head.weight": rnd(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.W_pack.weight": rnd(3 * H, H, std=0.15), p + "self_attn.o_proj.weight": rnd(H, H),
                  p + "mlp.gate_proj.weight": rnd(INTER, H), p + "mlp.up_proj.weight": rnd(INTER, H),
                  p + "mlp.down_proj.weight": rnd(H, INTER), p + "input_layernorm.weight": 1 + rnd(H, std=0.1),
                  p + "post_attention_layernorm.weight": 1 + rnd(H, std=0.1)})
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "auto_map": {},
              "hidden_size": H, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
              "intermediate_size": INTER, "vocab_size": VOCAB, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "torch_dtype": "float32", "model_max_length": 256}
    if request.param == "7b-rope":
        config["max_position_embeddings"] = 256
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer(VOCAB).save_pretrained(path)
    return path, w, request.param == "13b-alibi"


def reference_logits(w: dict, ids: list[int], alibi: bool) -> torch.Tensor:
    """float64 Baichuan forward over a whole sequence: [len, vocab]."""
    d = H // HEADS
    w = {k: v.double() for k, v in w.items()}
    n = len(ids)
    pos = torch.arange(n, dtype=torch.float64)

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))

    def rope(x):  # [n, heads, d], rotate-half, theta 10000
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)[:, None, :]
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * ang.cos() + half * ang.sin()

    h = w["model.embed_tokens.weight"][ids]
    causal = pos[None, :] > pos[:, None]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q, k, v = (x @ w[p + "self_attn.W_pack.weight"].T).view(n, 3, HEADS, d).unbind(1)
        if not alibi:
            q, k = rope(q), rope(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        if alibi:
            scores = scores + alibi_slopes(HEADS, 8.0).double()[:, None, None] * (pos[None, :] - pos[:, None])
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        h = h + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, H) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_config_maps_both_variants(checkpoint):
    from kvserve.runtime.model_config import ModelConfig

    path, _, alibi = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "BaichuanForCausalLM" and cfg.hidden_act == "silu"
    assert (cfg.alibi_bias_max is not None) == alibi and cfg.alibi_llama_layers == alibi
    assert cfg.max_position_embeddings == 256


def test_prefill_logits_and_greedy_decode_match_the_float64_reference(checkpoint):
    path, w, alibi = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    from kvserve.kernels.cpu import native

    with LLM(str(path), num_kv_blocks=32, block_size=8, dtype="float32", device="cpu") as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
        if native.available():  # decode steps ran in the one-call native stack (ALiBi slopes or RoPE)
            assert isinstance(llm.engine.model._native_stack, native.DecoderStack)
    ids = list(PROMPT)
    for token, lp in zip(out.token_ids, out.logprobs):
        logits = reference_logits(w, ids, alibi)[-1]
        want = int(logits.argmax())
        assert token == want
        torch.testing.assert_close(torch.tensor(lp[token].logprob, dtype=torch.float64),
                                   logits.log_softmax(-1)[want], rtol=0, atol=2e-4)
        ids.append(token)
