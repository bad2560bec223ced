"""Falcon with rotary embeddings and attention in parallel with the MLP: Falcon-7B's layout
(multi-query, one LayerNorm), Falcon-40B's new decoder architecture (grouped KV heads, one
LayerNorm per branch, or one shared), and a multi-head variant with biases. The tests compare
logits with transformers' Falcon, greedy decoding through the engine, GGUF files in llama.cpp's
converter layout (q|k|v regrouped, ln_mlp as attn_norm_2) against transformers on the weights they
encode, and Falcon-7B's file against transformers' own GGUF loading. Falcon-RW (ALiBi) is
tests/test_alibi.py's."""

from __future__ import annotations

import shutil

import ggufmodels as G
import pytest
import torch
from test_alibi_native import assert_native_stack_matches_per_op
from test_gguf_families import PROMPT, oracle_logits, our_logits

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.model_config import ModelConfig

ROPE = dict(alibi=False, parallel_attn=True, bias=False, num_attention_heads=4, hidden_size=64)
VARIANTS = {
    "7b": dict(multi_query=True, new_decoder_architecture=False),
    "40b": dict(multi_query=True, new_decoder_architecture=True, num_kv_heads=2),
    "40b-one-norm": dict(multi_query=True, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "mha-bias": dict(multi_query=False, new_decoder_architecture=False, bias=True),
}


@pytest.fixture(scope="module")
def falcon(tiny_model_factory):
    return lambda variant: tiny_model_factory("falcon", **{**ROPE, **VARIANTS[variant]})


@pytest.fixture(scope="module")
def gguf_files(falcon, tmp_path_factory):
    from safetensors.torch import save_file

    root, built = tmp_path_factory.mktemp("falcon-gguf"), {}

    def get(variant: str, kind: str):
        if (variant, kind) not in built:
            hf, twin = falcon(variant), {}
            path = G.write_falcon_gguf(hf, root / f"{variant}-{kind}.gguf", kind, twin=twin)
            oracle = root / f"{variant}-{kind}-encoded"
            oracle.mkdir()
            shutil.copyfile(hf / "config.json", oracle / "config.json")
            save_file({k: v.contiguous() for k, v in twin.items()}, str(oracle / "model.safetensors"))
            built[variant, kind] = path, oracle
        return built[variant, kind]

    return get


@pytest.fixture
def exact_cpu_matmuls():
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    set_cpu_packed(False)
    yield
    set_cpu_packed(None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(falcon, variant):
    cfg = ModelConfig.from_pretrained(falcon(variant))
    kv = {"7b": 1, "40b": 2, "40b-one-norm": 2, "mha-bias": 4}[variant]
    assert (cfg.falcon_parallel, cfg.falcon_two_norms, cfg.shape.num_kv_heads) == (True, variant == "40b", kv)
    torch.testing.assert_close(our_logits(falcon(variant)), oracle_logits(falcon(variant)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant, kind", [("7b", "Q8_0"), ("40b", "F16"), ("40b-one-norm", "Q8_0"),
                                           ("mha-bias", "F16")])
def test_gguf_matches_transformers_on_the_weights_the_file_encodes(gguf_files, variant, kind, exact_cpu_matmuls):
    path, oracle = gguf_files(variant, kind)
    torch.testing.assert_close(our_logits(path), oracle_logits(oracle), rtol=1e-5, atol=1e-4)


def test_gguf_matches_transformers_own_gguf_loading(gguf_files):
    from transformers import AutoModelForCausalLM

    path, _ = gguf_files("7b", "F16")
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(our_logits(path), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_engine_greedy_decoding(falcon, gguf_files, source, exact_cpu_matmuls):
    from transformers import AutoModelForCausalLM

    variant = "7b" if source == "safetensors" else "40b"
    path = falcon(variant) if source == "safetensors" else gguf_files(variant, "Q8_0")[0]
    oracle = falcon(variant) if source == "safetensors" else gguf_files(variant, "Q8_0")[1]
    prompt = [1, 300, 17, 5, 9, 250, 12, 40, 41, 42]
    with LLM(str(path), max_model_len=128, num_kv_blocks=32, block_size=8, dtype="float32") as llm:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32)
    x = torch.tensor([prompt])
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want


def test_sequential_rotary_falcon_is_refused(falcon):
    config = ModelConfig.from_pretrained(falcon("7b")).hf_config
    with pytest.raises(ValueError, match="parallel_attn false"):
        ModelConfig.from_dict({**config, "parallel_attn": False})
    with pytest.raises(ValueError, match="num_ln_in_parallel_attn 3"):
        ModelConfig.from_dict({**config, "new_decoder_architecture": True, "num_ln_in_parallel_attn": 3})


@pytest.mark.parametrize("variant", ["7b", "40b", "7b-71-heads"])
def test_native_stack_runs_parallel_layers_like_the_per_op_path(falcon, tiny_model_factory, variant):
    """Decode steps through the one-call native stack give the per-op path's tokens and logprobs
    (to float rounding: the stack's LayerNorms and GELU are C, the per-op path's torch): one
    shared norm, two norms, and Falcon-7B's 71 query heads on its one KV head."""
    from kvserve.kernels.cpu import native

    if not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    path = (tiny_model_factory("falcon", **{**ROPE, **VARIANTS["7b"], "num_attention_heads": 71, "hidden_size": 568})
            if variant == "7b-71-heads" else falcon(variant))
    assert_native_stack_matches_per_op(path, max_tokens=10)


@pytest.mark.parametrize("variant", ["7b", "40b"])
def test_tensor_parallel_greedy_matches_one_rank_and_transformers(falcon, variant):
    """tensor_parallel_size 2 (gloo): Falcon-7B's single KV head is replicated on both ranks,
    Falcon-40B's two KV groups are split one per rank with their q|k|v rows; greedy output equals
    one rank's and transformers'."""
    from transformers import AutoModelForCausalLM

    path = falcon(variant)
    prompts = [[1, 300, 17, 5, 9, 250, 12, 40, 41, 42], [1, 7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(max_model_len=128, num_kv_blocks=64, block_size=8, dtype="float32", device="cpu")
    with LLM(str(path), tensor_parallel_size=2, **kw) as two:
        got = [list(o.outputs[0].token_ids)
               for o in two.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with LLM(str(path), **kw) as one:
        want = [list(o.outputs[0].token_ids)
                for o in one.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == want
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for prompt, tokens in zip(prompts, got):
        x = torch.tensor([prompt])
        oracle = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == oracle
