"""Phi-3's LongRoPE (rope_type "longrope": per-frequency short and long factors, an attention
factor) from a tiny random checkpoint and from its GGUF file (rope_factors_short/long tensors,
phi3.rope.scaling.*), against transformers' Phi3.

transformers picks the factors per forward from the sequence length (long past
original_max_position_embeddings, recomputing the cache when a sequence crosses it); kvserve picks
them once from max_model_len, as vLLM and llama.cpp do, so the two agree whenever max_model_len
and the sequence are on the same side of original_max_position_embeddings, which these tests
arrange (original 16)."""

from __future__ import annotations

import json

import ggufmodels as G
import pytest
import torch
from test_gguf_families import our_logits

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.gguf import model_config
from kvserve.runtime.model_config import ModelConfig

ORIGINAL = 16
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]  # head_dim 16: 8 frequencies
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 20.0]
PROMPT_SHORT = [1, 5, 77, 300, 12, 9, 400, 33]  # 8 prompt + 8 generated = 16 positions
PROMPT_LONG = [(7 * i + 3) % 500 for i in range(24)]


@pytest.fixture(scope="module")
def phi3(tiny_model_factory):
    return tiny_model_factory("phi3", max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": SHORT, "long_factor": LONG})


@pytest.fixture(scope="module")
def phi3_gguf(phi3, tmp_path_factory):
    return G.write_gguf(phi3, tmp_path_factory.mktemp("longrope") / "phi3-longrope-F32.gguf", "F32")


def _transformers_logits(hf_dir, prompt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0].float()


def _transformers_greedy(hf_dir, prompt, n):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    x = torch.tensor([prompt])
    return ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()


def test_config_reads_longrope_and_picks_factors_by_max_model_len(phi3, phi3_gguf):
    import math

    hf = ModelConfig.from_pretrained(phi3)
    scaling = hf.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["short_factor"] == tuple(SHORT)
    assert scaling["factor"] == 128 / ORIGINAL
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(ORIGINAL)))
    assert scaling["long"]  # the default context (128) is past the original 16
    assert not hf.for_max_model_len(ORIGINAL).rope_scaling["long"]
    assert hf.for_max_model_len(ORIGINAL + 1).rope_scaling["long"]
    gg = model_config(phi3_gguf).rope_scaling
    for key in ("short_factor", "long_factor", "attention_factor"):  # float32 in the file
        assert gg[key] == pytest.approx(scaling[key], rel=1e-6), key
    assert (gg["original_max_position_embeddings"], gg["long"]) == (ORIGINAL, True)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_match_transformers_with_short_and_long_factors(phi3, phi3_gguf, source):
    path = phi3 if source == "safetensors" else phi3_gguf
    cfg = ModelConfig.from_pretrained(phi3) if source == "safetensors" else model_config(phi3_gguf)
    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
    from kvserve.runtime.models import load_model

    for prompt, max_len in ((PROMPT_SHORT, ORIGINAL), (PROMPT_LONG, 128)):
        model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                           config=cfg.for_max_model_len(max_len))
        torch.testing.assert_close(our_logits(path, prompt, model=model), _transformers_logits(phi3, prompt),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("source, prompt, max_model_len", [
    ("safetensors", PROMPT_SHORT, ORIGINAL), ("safetensors", PROMPT_LONG, 128), ("gguf", PROMPT_SHORT, ORIGINAL)])
def test_engine_greedy_decoding(phi3, phi3_gguf, source, prompt, max_model_len):
    n = 8 if max_model_len == ORIGINAL else 6
    path = phi3 if source == "safetensors" else phi3_gguf
    with LLM(str(path), max_model_len=max_model_len, num_kv_blocks=32, block_size=8, dtype="float32") as llm:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == _transformers_greedy(phi3, prompt, n)


@pytest.mark.parametrize("change, message", [
    ({"short_factor": SHORT[:4]}, "short_factor"),
    ({"long_factor": [1.0] * 7 + [-1.0]}, "long_factor"),
    ({"original_max_position_embeddings": None}, "original_max_position_embeddings"),
])
def test_bad_longrope_config_is_refused_by_field(phi3, tmp_path, change, message):
    config = json.loads((phi3 / "config.json").read_text())
    params = {**config["rope_parameters"], **change}
    config = {**config, "rope_parameters": params}
    if "original_max_position_embeddings" in change:
        config["original_max_position_embeddings"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)
