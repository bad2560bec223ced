"""ALiBi models and bitsandbytes 4-bit checkpoints served by `kvserve serve` to the official
openai client: greedy completions (token-id prompts) equal the offline engine's. BLOOM decodes
through the native ALiBi stack; the NF4 checkpoint is held packed."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams

PROMPT = [1, 40, 41, 42, 300, 17, 5, 9]


def _nf4(tiny_model_factory, root):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=qc, device_map="cpu",
                                                 dtype=torch.float32)
    model.save_pretrained(root / "nf4")
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(root / "nf4")
    return root / "nf4"


@pytest.mark.parametrize("family", ["bloom", "nf4"])
def test_served_greedy_completion_equals_the_offline_engine(tiny_model_factory, tmp_path, family):
    import openai
    from server_helpers import http, wait_until

    from kvserve.runtime.server.main import ServerThread

    path = (_nf4(tiny_model_factory, tmp_path) if family == "nf4"
            else tiny_model_factory("bloom", num_attention_heads=6, hidden_size=96))
    srv = ServerThread([str(path), "--served-model-name", "m", "--num-kv-blocks", "64", "--max-model-len", "256",
                        "--dtype", "float32", "--port", "0"])
    srv.start()
    try:
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        got = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        assert srv.stop() == 0
    with LLM(str(path), num_kv_blocks=64, dtype="float32", device="cpu") as llm:
        want = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == 8
