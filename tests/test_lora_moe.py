"""LoRA on mixture-of-experts layers (runtime/lora/moe.py): the routed experts' fused parameters
as PEFT adapts them (`target_parameters`: mlp.experts.gate_up_proj / down_proj, one A and B per
expert), and the shared experts' projections. Oracle: transformers + peft on the unmerged
adapters (greedy tokens equal, logprobs close), mixed with the base model in one batch, on tiny
Mixtral and Qwen2-MoE (with its gated shared expert); bad expert adapters refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import assert_outputs_match_peft, build_lora_adapters, peft_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26]]
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _check(outs, pm, names, prompts):
    assert_outputs_match_peft(outs, pm, names, prompts, MAX_TOKENS, adapter_matters=True)


def test_mixtral_expert_adapters_mixed_with_the_base_match_peft(tiny_model_factory, tmp_path):
    base = tiny_model_factory("mixtral")
    # PEFT wants every adapter of one model to target the same parameters; ranks may differ.
    a, b = build_lora_adapters(base, {
        tmp_path / "a": dict(r=8, seed=1, std=0.15, target_modules=["q_proj"], target_parameters=EXPERTS),
        tmp_path / "b": dict(r=4, seed=2, std=0.2, target_modules=["q_proj"], target_parameters=EXPERTS)})
    pm = peft_model(base, {"a": str(a), "b": str(b)})
    names = ["a", "b", None]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), None])
        _check(outs, pm, names, PROMPTS)
        # Refusals name the problem: an expert rank above max_lora_rank, an unsupported parameter.
        big, odd = build_lora_adapters(base, {
            tmp_path / "big": dict(r=16, seed=3, target_modules=[], target_parameters=EXPERTS),
            tmp_path / "odd": dict(r=4, seed=4, target_modules=["q_proj"])})
        with pytest.raises(ValueError, match=r"experts.* has rank 16, above max_lora_rank 8"):
            llm.engine.add_lora(LoRARequest("big", 3, str(big)))
        cfg_path = odd / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({**cfg, "target_parameters": ["mlp.gate.weight"]}))
        with pytest.raises(ValueError, match="target parameter 'mlp.gate.weight' is not supported"):
            llm.engine.add_lora(LoRARequest("odd", 4, str(odd)))


def test_qwen2_moe_shared_and_routed_expert_adapters_match_peft(tiny_model_factory, tmp_path):
    base = tiny_model_factory("qwen2_moe")
    (path,) = build_lora_adapters(base, {tmp_path / "moe": dict(
        r=8, seed=5, std=0.15, target_modules=["k_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=EXPERTS)})
    from safetensors.torch import load_file

    keys = load_file(str(path / "adapter_model.safetensors"))
    assert any("shared_expert.gate_proj.lora_A" in k for k in keys)  # the shared expert is adapted too
    pm = peft_model(base, {"moe": str(path)})
    names = ["moe", None, "moe"]
    with LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[LoRARequest("moe", 1, str(path)) if n else None for n in names])
        _check(outs, pm, names, PROMPTS)
        # Another model's experts (Mixtral's sizes) are a base-model mismatch, not a crash.
        other = tmp_path / "other"
        shutil.copytree(path, other)
        tensors = {k: v for k, v in keys.items()}
        for k in [k for k in tensors if ".experts.lora_A" in k]:
            tensors[k] = torch.zeros(tensors[k].shape[0], tensors[k].shape[1] + 1)
        from safetensors.torch import save_file

        save_file(tensors, str(other / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match="base model mismatch: .*experts"):
            llm.engine.add_lora(LoRARequest("other", 2, str(other)))


def test_deepseek_v3_mla_and_expert_adapters_at_tensor_parallel_2_match_peft(tiny_model_factory, tmp_path):
    """DeepSeek V3 whole: MLA projections (kv_b_proj folded into the absorbed decode), the dense
    first layer's MLP and the routed experts (PEFT turns gate/up/down_proj into expert
    parameters, gate_up at twice the rank), split over TP=2 (gloo) like their base layers."""
    base = tiny_model_factory("deepseek_v3")
    (path,) = build_lora_adapters(base, {tmp_path / "ds": dict(
        r=4, seed=6, std=0.15, target_parameters=EXPERTS,
        target_modules=["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"])})
    pm = peft_model(base, {"ds": str(path)})
    names = ["ds", None]
    with LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             tensor_parallel_size=2, device="cpu") as llm:
        outs = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False,
                            lora_request=[LoRARequest("ds", 1, str(path)), None])
    _check(outs, pm, names, PROMPTS[:2])


def test_int8_experts_with_adapters_match_peft_on_the_dequantized_model(tiny_model_factory, tmp_path):
    """Quantized experts (one int8 linear pair per expert) with expert adapters in full precision
    beside them. Oracle: peft on transformers with the same dequantized weights (the router stays
    full precision, as in kvserve)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvserve.runtime.models.quantization.packed import quantize_int8

    base = tiny_model_factory("mixtral")
    (path,) = build_lora_adapters(base, {tmp_path / "q": dict(r=8, seed=7, std=0.15, target_modules=["q_proj"],
                                                               target_parameters=EXPERTS)})
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                continue
            for w in [p.data] if p.dim() == 2 else list(p.data) if p.dim() == 3 else []:
                q, s = quantize_int8(w, w.shape[1])
                w.copy_(q.float() * s)
    pm = PeftModel.from_pretrained(hf, str(path), adapter_name="q").eval()
    names = ["q", None]
    with LLM(str(base), quantization="int8", enable_lora=True, max_lora_rank=8, num_kv_blocks=64,
             block_size=4) as llm:
        outs = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False, lora_request=[LoRARequest("q", 1, str(path)), None])
    _check(outs, pm, names, PROMPTS[:2])
