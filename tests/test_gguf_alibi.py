"""GGUF files of the ALiBi families (MPT, BLOOM), written the way llama.cpp's converter writes them
(tests/ggufmodels.py write_alibi_gguf), at F16, Q8_0, Q4_K and Q6_K: logits against transformers on the
weights the file encodes, BLOOM's also against transformers' own GGUF loading (an oracle that
regroups q|k|v itself), the config the metadata maps to, greedy decoding through the engine, and
what is refused (MPT's grouped KV heads, an MLP width other than 4 x hidden, a Falcon KV head count
that does not divide the heads). Falcon's GGUF files are tests/test_falcon.py's."""

from __future__ import annotations

import pathlib
import shutil

import ggufmodels as G
import pytest
import torch
from test_gguf_families import PROMPT, oracle_logits, our_logits

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.gguf import model_config

# Rows of 256 so that Q4_K applies to every matrix (it quantizes 256-value super-blocks).
SIZES = dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=2)
FAMILIES = {"mpt": dict(attn_config={"alibi": True, "alibi_bias_max": 8, "clip_qkv": 0.5}), "bloom": {}}
KINDS = ["F16", "Q8_0", "Q4_K", "Q6_K"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_factory):
    root = tmp_path_factory.mktemp("gguf-alibi")
    built: dict = {}

    def get(family: str, kind: str) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        """(GGUF file, HF directory of the weights it encodes, the original HF directory)."""
        from safetensors.torch import save_file

        if (family, kind) not in built:
            hf = tiny_model_factory(family, **SIZES, **FAMILIES[family])
            twin: dict = {}
            path = G.write_alibi_gguf(hf, root / f"{family}-{kind}.gguf", kind, twin=twin)
            oracle = root / f"{family}-{kind}-encoded"
            oracle.mkdir()
            shutil.copyfile(hf / "config.json", oracle / "config.json")
            save_file({k: v.contiguous() for k, v in twin.items()}, str(oracle / "model.safetensors"))
            built[family, kind] = path, oracle, hf
        return built[family, kind]

    return get


@pytest.fixture
def exact_cpu_matmuls():
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    set_cpu_packed(False)
    yield
    set_cpu_packed(None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_alibi_family_matches_transformers_on_the_weights_the_file_encodes(files, family, kind, exact_cpu_matmuls):
    path, oracle, _ = files(family, kind)
    torch.testing.assert_close(our_logits(path), oracle_logits(oracle), rtol=1e-5, atol=1e-4)


def test_bloom_matches_transformers_own_gguf_loading(files, exact_cpu_matmuls):
    from transformers import AutoModelForCausalLM

    path, _, _ = files("bloom", "Q4_K")
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(our_logits(path), want, rtol=1e-5, atol=1e-4)


def test_alibi_metadata_maps_onto_the_model_description(files):
    from kvserve.runtime.model_config import ModelConfig

    for family in FAMILIES:
        path, _, hf_dir = files(family, "F16")
        cfg, hf = model_config(path), ModelConfig.from_pretrained(hf_dir)
        assert cfg.architecture == hf.architecture
        for field in ("alibi_bias_max", "alibi_scale", "norm_bias", "embed_norm", "clip_qkv", "hidden_act",
                      "mlp_bias", "tie_word_embeddings"):
            assert getattr(cfg, field) == getattr(hf, field), (family, field)
        assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # GGUF stores float32
        assert cfg.shape == hf.shape, family


def test_engine_greedy_decoding_from_mpt_gguf(files, exact_cpu_matmuls):
    """Through the engine (paged KV cache, ALiBi decode, the int4 layers the file keeps, the
    tokenizer converted from the file): greedy tokens equal transformers' generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, oracle, hf_dir = files("mpt", "Q4_K")
    prompt = [1, 300, 17, 5, 9, 250, 12, 40, 41, 42]
    with LLM(str(path), max_model_len=128, num_kv_blocks=32, block_size=8, dtype="float32") as llm:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        text = "def add(a, b): return a + b  # héllo"
        assert llm.get_tokenizer().encode(text) == AutoTokenizer.from_pretrained(hf_dir).encode(text)
    ref = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32)
    x = torch.tensor([prompt])
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want


def _minimal(path: pathlib.Path, arch: str, **keys) -> pathlib.Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(keys.pop("ffn", 128))
    w.add_head_count(4)
    w.add_head_count_kv(keys.pop("kv_heads", 4))
    w.add_context_length(64)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, keys, message", [
    ("falcon", {"kv_heads": 3}, "does not divide"),
    ("mpt", {"kv_heads": 2}, "head_count_kv"),
    ("bloom", {"ffn": 100}, "feed_forward_length"),
])
def test_what_is_refused(tmp_path, arch, keys, message):
    with pytest.raises(ValueError, match=message):
        model_config(_minimal(tmp_path / f"{arch}.gguf", arch, **keys))
