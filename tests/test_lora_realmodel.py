"""LoRA on the real SmolLM2-135M-Instruct: four rank-16 PEFT adapters on every q/k/v/o/gate/up/down
(cached under build/smollm2-loras) and the base model in one batch, greedy output equal to
transformers + peft on the unmerged adapters."""

from __future__ import annotations

import torch

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import ensure_smollm2_adapters, peft_model

QUESTIONS = ["Say hello.", "Name a color.", "What is the capital of France?", "What is 2+2?", "Tell me a fact."]
MAX_TOKENS = 12


def test_four_adapters_and_the_base_in_one_batch_match_peft(smollm2):
    dirs = ensure_smollm2_adapters(smollm2.hf_dir, 4)
    names = [f"a{i}" for i in range(4)]
    pm = peft_model(smollm2.hf_dir, {n: str(d) for n, d in zip(names, dirs)})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2.hf_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    order = ["a0", "a1", None, "a2", "a3"]

    def reference(name, prompt_ids):
        with torch.no_grad():
            x = torch.tensor([prompt_ids])
            if name is None:
                with pm.disable_adapter():
                    out = pm.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False)
            else:
                pm.set_adapter(name)
                out = pm.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, len(prompt_ids):].tolist()

    want = [reference(n, p) for n, p in zip(order, ids)]
    requests = {n: LoRARequest(n, i + 1, str(d)) for i, (n, d) in enumerate(zip(names, dirs))}
    with LLM(str(smollm2.hf_dir), enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=512,
             num_kv_blocks=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in order])
    got = [o.outputs[0].token_ids for o in outs]
    # Truncate at EOS as transformers' generate stops there.
    assert [g[:len(w)] for g, w in zip(got, want)] == want
    # The adapter visibly changes the answer (the first question, under a0, and without it).
    assert reference(None, ids[0])[:len(want[0])] != want[0]
