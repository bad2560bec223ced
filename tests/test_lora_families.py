"""LoRA adapters on the LayerNorm/GELU families (BLOOM, Falcon in its ALiBi and rotary
architectures, MPT), in their own module names (query_key_value, dense, dense_h_to_4h,
dense_4h_to_h, word_embeddings; Wqkv, out_proj, ffn.up_proj, ffn.down_proj, wte): greedy output equal to transformers +
peft on the unmerged adapters, two adapters and the base model in one batch; decode steps with
adapters run in the CPU's native decode stack (ALiBi and rotary Falcon layers), which adds them;
BLOOM at TP=2 (its head-interleaved q|k|v split by heads across ranks); an adapter of another
family refused before anything is registered."""

from __future__ import annotations

import json

import pytest

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import assert_outputs_match_peft, build_lora_adapters, peft_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26]]
NAMES = ["a", "b", None]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)

BLOOM_NAMES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "word_embeddings")
MPT_NAMES = ("Wqkv", "out_proj", "up_proj", "down_proj", "wte")
ROPE_FALCON = dict(alibi=False, parallel_attn=True, bias=False)
CASES = {  # id: (tiny model family, its overrides, PEFT's module names)
    "bloom": ("bloom", {}, BLOOM_NAMES),
    "mpt": ("mpt", {}, MPT_NAMES),
    # Falcon-RW: ALiBi, a KV head per head ([q_h, k_h, v_h] per head), sequential layers, biases.
    "falcon-rw": ("falcon", {}, BLOOM_NAMES),
    # Falcon-7B: rotary, multi-query ([all q; k; v]), attention and MLP in parallel.
    "falcon-7b": ("falcon", dict(ROPE_FALCON, multi_query=True), BLOOM_NAMES),
    # Falcon-40B's new decoder architecture: grouped KV ([q_g..., k_g, v_g] per group), two norms.
    "falcon-40b": ("falcon", dict(ROPE_FALCON, multi_query=True, new_decoder_architecture=True, num_kv_heads=2),
                   BLOOM_NAMES),
}


def _adapters(base, root, modules, seed):
    """"a" on all four modules, the token embedding and the (tied) LM head; "b" of another rank on
    the fused q|k|v and the MLP's output."""
    return dict(zip("ab", build_lora_adapters(base, {
        root / "a": dict(r=8, seed=seed, std=0.2, target_modules=[*modules, "lm_head"]),
        root / "b": dict(r=4, seed=seed + 1, std=0.3, target_modules=[modules[0], modules[3]]),
    })))


def _requests(adapters):
    return [None if n is None else LoRARequest(n, 1 + (n == "b"), str(adapters[n])) for n in NAMES]


@pytest.mark.parametrize("case", list(CASES))
def test_family_adapters_match_peft(tiny_model_factory, tmp_path, monkeypatch, case):
    from kvserve.kernels.cpu import native

    family, overrides, modules = CASES[case]
    base = tiny_model_factory(family, **overrides)
    adapters = _adapters(base, tmp_path, modules, seed=41)
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    stack_loras = []
    if native.available():
        real_run = native.DecoderStack.run

        def run(self, *args, **kw):
            stack_loras.append(args[6] if len(args) > 6 else kw.get("lora"))
            return real_run(self, *args, **kw)

        monkeypatch.setattr(native.DecoderStack, "run", run)
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             dtype="float32", device="cpu") as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=_requests(adapters))
    # Tokens and logprobs as peft's; each adapter visibly changes its answer (one silently
    # dropped cannot pass).
    assert_outputs_match_peft(outs, pm, NAMES, PROMPTS, MAX_TOKENS, adapter_matters=True)
    if native.available():
        # decode steps with adapters ran in the native stack, which added them
        assert any(lora is not None for lora in stack_loras)


def test_bloom_tensor_parallel_2_matches_peft(tiny_model_factory, tmp_path):
    """TP=2 (gloo): BLOOM's q|k|v rows are per head; after the load's reordering each rank takes
    its heads' rows of q, k and v, and of the adapter's B (A whole); the row-parallel dense and
    dense_4h_to_h take their columns of A."""
    base = tiny_model_factory("bloom")
    adapters = _adapters(base, tmp_path, BLOOM_NAMES, seed=51)
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             tensor_parallel_size=2, device="cpu") as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=_requests(adapters))
    assert_outputs_match_peft(outs, pm, NAMES, PROMPTS, MAX_TOKENS)


def test_an_adapter_of_another_family_is_refused(tiny_model_factory, tmp_path):
    """An MPT adapter (or a Llama one) on a BLOOM model: a ValueError naming the module, nothing
    registered, nothing queued."""
    mpt = build_lora_adapters(tiny_model_factory("mpt"), {tmp_path / "mpt": dict(r=4, target_modules=list(MPT_NAMES))})[0]
    llama = build_lora_adapters(tiny_model_factory("llama"), {tmp_path / "llama": dict(r=4, target_modules=["q_proj"])})[0]
    with LLM(str(tiny_model_factory("bloom")), enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=32,
             block_size=4) as llm:
        engine = llm.engine
        # Its base model is a local directory here: told by the config.
        with pytest.raises(ValueError, match="base model mismatch: .* has model_type 'mpt', this model 'bloom'"):
            engine.add_lora(LoRARequest("mpt", 1, str(mpt)))
        # A hub id (or nothing) as the base model: told by the module names.
        for path in (mpt, llama):
            cfg = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "org/model"}))
        with pytest.raises(ValueError, match=r"transformer\.blocks\.0\.attn.*not a module of this BloomForCausalLM"):
            engine.add_lora(LoRARequest("mpt", 1, str(mpt)))
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*not a module of this "
                                             r"BloomForCausalLM model.*another architecture"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("llama", 2, str(llama)))
        assert engine.list_loras() == set() and not engine.has_unfinished_requests()
