"""GGUF files of every family the runtime serves from safetensors (Gemma 2/3, Mistral, Mixtral,
Qwen2/3-MoE, DeepSeek V2/V3, Phi-3), written the way llama.cpp's converter lays them out
(tests/ggufmodels.py), at Q8_0, Q4_K and Q6_K: logits against transformers on the weights the
file encodes, and against transformers' own GGUF loading where it reads the family; the config
each file's metadata maps to; greedy decoding through the engine."""

from __future__ import annotations

import pathlib

import ggufmodels as G
import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
from kvserve.runtime.gguf import model_config
from kvserve.runtime.models import load_model

# Row lengths of 256 wherever the K types should apply (they quantize 256-value super-blocks);
# rows that do not split fall back to Q8_0 / F16 as llama.cpp's quantizer does (DeepSeek's latent).
_BASE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    # Two layers: a local (window 8 < the prompt) and a global one.
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64),
    # llama.cpp fixes Gemma 3's pattern (every sixth layer global): six layers hold both kinds.
    "gemma3": dict(head_dim=64, query_pre_attn_scalar=64, num_hidden_layers=6, rope_theta=20000.0),
    "mistral": {},
    "mixtral": {},
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
    "qwen3_moe": dict(moe_intermediate_size=256, head_dim=64),
    "deepseek_v2": dict(moe_intermediate_size=256, v_head_dim=64, num_key_value_heads=4),
    "deepseek_v3": dict(moe_intermediate_size=256, v_head_dim=64, q_lora_rank=256, num_key_value_heads=4),
    "phi3": dict(sliding_window=8),
}
HF_ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mistral": "LlamaForCausalLM",
           "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
           "phi3": "Phi3ForCausalLM"}
KINDS = ["Q8_0", "Q4_K", "Q6_K"]
PROMPT = [1, 5, 77, 300, 12, 9, 400, 33, 250, 7, 64, 128]


class Files:
    """(family, kind) -> (GGUF path, the HF state dict it encodes), built once per session."""

    def __init__(self, root: pathlib.Path, tiny):
        self.root, self.tiny, self.built = root, tiny, {}

    def hf_dir(self, family: str) -> pathlib.Path:
        return self.tiny(family, **{**_BASE, **FAMILIES[family]})

    def __call__(self, family: str, kind: str) -> tuple[pathlib.Path, pathlib.Path]:
        """(the GGUF file, an HF directory of the weights it encodes under checkpoint names, which
        transformers then lays out its own way, e.g. fusing experts)."""
        import shutil

        from safetensors.torch import save_file

        if (family, kind) not in self.built:
            twin: dict = {}
            hf = self.hf_dir(family)
            path = G.write_gguf(hf, self.root / f"{family}-{kind}.gguf", kind, twin=twin)
            oracle = self.root / f"{family}-{kind}-encoded"
            oracle.mkdir()
            for f in ("config.json", "generation_config.json"):
                shutil.copyfile(hf / f, oracle / f)
            save_file({k: v.contiguous() for k, v in twin.items()}, str(oracle / "model.safetensors"))
            self.built[family, kind] = path, oracle
        return self.built[family, kind]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_factory) -> Files:
    return Files(tmp_path_factory.mktemp("gguf-families"), tiny_model_factory)


@pytest.fixture
def exact_cpu_matmuls():
    """int4 layers by dequantize-then-matmul in float32 (not torch's bfloat16 packed kernel)."""
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    set_cpu_packed(False)
    yield
    set_cpu_packed(None)


def our_logits(path, prompt=PROMPT, model=None) -> torch.Tensor:
    if model is None:
        model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    n, block = len(prompt), 16
    blocks = -(-n // block)
    pools = 1 if model.config.shape.mla is not None else 2  # MLA caches one latent pool per layer
    kv = [tuple(torch.zeros(model.kv_cache_shape(blocks, block)) for _ in range(pools)) for _ in model.layers]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), kv, meta))


def oracle_logits(oracle_dir: pathlib.Path, prompt=PROMPT) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(oracle_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_on_the_weights_the_file_encodes(files, family, kind, exact_cpu_matmuls):
    path, oracle = files(family, kind)
    ours = our_logits(path)
    ref = oracle_logits(oracle)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


def test_mistral_matches_transformers_own_gguf_loading(files, exact_cpu_matmuls):
    """transformers reads the file itself (its own name mapping, Q/K un-permutation and
    dequantizers): an oracle independent of this test's writer. (transformers 5.24 also reads
    Gemma 2/3 and Qwen2/3-MoE files, but leaves soft-capping, query_pre_attn_scalar, Gemma 3's
    local RoPE base and the MoE expert sizes at its config defaults, which only real checkpoints
    match; for those, files from llama.cpp's own converter were checked against the HF
    directories while writing this, and the writer's layout against the converter's.)"""
    family = "mistral"
    from transformers import AutoModelForCausalLM

    path, _ = files(family, "Q4_K")
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(our_logits(path), want, rtol=1e-5, atol=1e-4)


def test_metadata_maps_onto_the_model_description(files):
    """What each file's metadata becomes: the family, its window and soft-capping, experts and
    routing, MLA sizes; the same shape the HF directory gives."""
    from kvserve.runtime.model_config import ModelConfig

    for family in FAMILIES:
        path, _ = files(family, "Q8_0")
        cfg, hf = model_config(path), ModelConfig.from_pretrained(files.hf_dir(family))
        assert cfg.architecture == HF_ARCH[family], family
        if family == "mistral":  # GGUF has no sliding window for Mistral (nor does llama.cpp)
            continue
        assert cfg.shape.layer_types == hf.shape.layer_types and cfg.sliding_window == hf.sliding_window, family
        assert cfg.shape.moe == hf.shape.moe and cfg.shape.mla == hf.shape.mla, family
        assert cfg.routing == hf.routing, family
        assert (cfg.rope_theta, cfg.local_rope) == (hf.rope_theta, hf.local_rope), family
        assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
            hf.query_pre_attn_scalar, hf.attn_logit_softcapping, hf.final_logit_softcapping), family
        assert cfg.hidden_act == hf.hidden_act and cfg.tie_word_embeddings == hf.tie_word_embeddings, family


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "deepseek_v2", "phi3"])
def test_engine_greedy_decoding_from_gguf(files, family, exact_cpu_matmuls):
    """Through the engine (paged KV cache, decode steps, the int4 / int8 layers the file keeps):
    greedy tokens equal the oracle's generate on the weights the file encodes."""
    from transformers import AutoModelForCausalLM

    path, oracle = files(family, "Q4_K")
    prompt = [1, 300, 17, 5, 9, 250, 12, 40, 41, 42]
    with LLM(str(path), max_model_len=128, num_kv_blocks=32, block_size=8, dtype="float32") as llm:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32)
    x = torch.tensor([prompt])
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want
