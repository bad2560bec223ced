"""LoRA on multi-head latent attention (runtime/lora/mla.py): DeepSeek V3's q_a/q_b_proj,
kv_a_proj_with_mqa, kv_b_proj (folded into the query and the output for decode, applied to the
context latents for prefill) and o_proj, and V2's single q_proj. Oracle: transformers + peft on
the unmerged adapters: greedy tokens equal and logprobs close, alone and mixed with the base model
in one batch, and over a prefix-cached context (the latents gathered from the cache)."""

from __future__ import annotations

import pytest

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import assert_outputs_match_peft, build_lora_adapters, peft_greedy, peft_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26]]
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
MLA_V3 = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _check(outs, pm, names, prompts):
    assert_outputs_match_peft(outs, pm, names, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def v3_setup(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("deepseek_v3")
    root = tmp_path_factory.mktemp("mla_loras")
    # "mla": every MLA projection; "latent": kv_b_proj alone (what decode folds into q and out).
    paths = build_lora_adapters(base, {root / "mla": dict(r=8, seed=1, std=0.15, target_modules=MLA_V3),
                                       root / "latent": dict(r=4, seed=2, std=0.2, target_modules=["kv_b_proj"])})
    adapters = dict(zip(("mla", "latent"), paths))
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128, block_size=4)
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    yield pm, llm, requests
    llm.close()


def test_mla_adapters_mixed_with_the_base_match_peft(v3_setup):
    pm, llm, requests = v3_setup
    names = ["mla", "latent", None]
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[requests.get(n) for n in names])
    _check(outs, pm, names, PROMPTS)
    # The adapters matter: each changes the greedy answer of its prompt.
    for name, prompt in zip(names[:2], PROMPTS):
        assert peft_greedy(pm, name, prompt, MAX_TOKENS)[0] != peft_greedy(pm, None, prompt, MAX_TOKENS)[0], name


def test_mla_adapter_over_a_cached_prefix_matches_peft(v3_setup):
    """A second prompt sharing a cached prefix: prefill up-projects latents gathered from the
    cache, through the adapter's kv_b_proj."""
    pm, llm, requests = v3_setup
    first = [PROMPTS[2] + [30, 31], PROMPTS[2] + [30, 31]]
    llm.generate(first, PARAMS, use_tqdm=False, lora_request=[requests["latent"], requests["mla"]])
    prompts = [first[0] + [40, 41, 42], first[1] + [50, 51]]
    names = ["latent", "mla"]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[requests[n] for n in names])
    assert all(o.num_cached_tokens > 0 for o in outs)
    _check(outs, pm, names, prompts)


def test_mla_without_q_lora_rank_takes_q_proj(tiny_model_factory, tmp_path):
    """DeepSeek V2 (no q_lora_rank): one q_proj, its rotary rows permuted like the base's."""
    base = tiny_model_factory("deepseek_v2")
    (path,) = build_lora_adapters(base, {tmp_path / "v2": dict(
        r=4, seed=3, std=0.2, target_modules=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])})
    pm = peft_model(base, {"v2": str(path)})
    names = ["v2", None]
    with LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False, lora_request=[LoRARequest("v2", 1, str(path)), None])
    _check(outs, pm, names, PROMPTS[:2])
