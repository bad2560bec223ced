"""LoRA adapters at pipeline parallelism (two stages, gloo): each stage wraps its own layers under
their global indices, the embedding's adapters run on the first stage and the LM head's on the
last (tied embeddings: the last stage's copy of the table), and rank 0 checks an adapter against
every stage's modules before any stage loads it. Oracle: transformers + peft."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import ALL_MODULES, build_lora_adapter, peft_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [40, 41, 42]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _reference(pm, name, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        if name is None:
            with pm.disable_adapter():
                out = pm.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        else:
            pm.set_adapter(name)
            out = pm.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def _spy_overlaps(worker) -> list:
    """Records each launch of a step with adapters while an earlier micro-batch is in flight:
    (the adapter slots it reads, those the in-flight ones read)."""
    launch, land = worker.launch, worker.land
    in_flight: list = []
    seen: list = []

    def spy_launch(step):
        used = frozenset() if step.lora is None else frozenset(s for s, _, _ in step.lora.layout.segments)
        if used and in_flight:
            seen.append((used, list(in_flight)))
        handle = launch(step)
        in_flight.append(used)
        return handle

    def spy_land(handle):
        in_flight.pop(0)
        return land(handle)

    worker.launch, worker.land = spy_launch, spy_land
    return seen


def test_pp2_adapters_match_peft_and_a_bad_one_is_refused_on_rank_0(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama", tie_word_embeddings=True)  # 2 layers: one per stage
    adapters = {
        "all": build_lora_adapter(base, tmp_path / "all", r=8, seed=41, std=0.2,
                                  target_modules=[*ALL_MODULES, "embed_tokens", "lm_head"]),
        "late": build_lora_adapter(base, tmp_path / "late", r=4, seed=42, std=0.3, layers_to_transform=[1]),
    }
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    # A module of the second stage's layer with the wrong shape: only rank 0's check of every
    # stage's modules can see it before the adapter is registered.
    bad = tmp_path / "bad"
    build_lora_adapter(base, bad, r=4, seed=43, target_modules=["down_proj"])
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.1.mlp.down_proj.lora_B" in k)
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, bad / "adapter_model.safetensors")

    names = ["all", None, "late", "all"]
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             pipeline_parallel_size=2, device="cpu") as llm:
        with pytest.raises(ValueError, match=r"base model mismatch: model\.layers\.1\.mlp\.down_proj"):
            llm.engine.add_lora(LoRARequest("bad", 9, str(bad)))
        # Two micro-batches in flight, each with its own adapter layout and slot loads.
        assert llm.engine.executor.max_concurrent_batches == 2
        overlaps = _spy_overlaps(llm.engine.executor.driver_worker)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
        assert llm.engine.list_loras() == {1, 2}
        assert llm.engine.block_manager.num_used_blocks == 0
    assert any(any(other and other != used for other in others) for used, others in overlaps), overlaps
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]
    base_out = [_reference(pm, None, p) for p in PROMPTS]
    assert [_reference(pm, n, p) for n, p in zip(names, PROMPTS)] != base_out  # the adapters matter
