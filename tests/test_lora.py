"""LoRA adapters in the engine (runtime/lora/): greedy output per adapter equal to transformers +
peft on the unmerged adapter, alone and in one batch mixing adapters and the base model; bad
adapters refused with a ValueError naming the problem; the prefix cache kept apart per adapter;
preemption, speculative decoding and structured outputs with an adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve.runtime import LLM, LoRARequest, SamplingParams
from kvserve.testing.adapters import ALL_MODULES, build_lora_adapter, peft_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [40, 41, 42], [7, 7, 8, 9, 30, 31]]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _adapters(base, root, family_seed=0):
    """Four adapters that differ in every way the loader handles: ranks, modules, rsLoRA, patterns."""
    return {
        "all8": build_lora_adapter(base, root / "all8", r=8, seed=family_seed + 1, std=0.1),
        "qv4": build_lora_adapter(base, root / "qv4", r=4, seed=family_seed + 2, std=0.15,
                                  target_modules=["q_proj", "v_proj", "down_proj"]),
        "rs": build_lora_adapter(base, root / "rs", r=8, lora_alpha=4, seed=family_seed + 3, std=0.1,
                                 use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
        "pattern": build_lora_adapter(base, root / "pattern", r=8, seed=family_seed + 4, std=0.1,
                                      layers_to_transform=[1], rank_pattern={"o_proj": 2},
                                      alpha_pattern={"up_proj": 3}),
    }


def _reference(pm, name, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        if name is None:
            with pm.disable_adapter():
                out = pm.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        else:
            pm.set_adapter(name)
            out = pm.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama_setup(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama")
    adapters = _adapters(base, tmp_path_factory.mktemp("loras"))
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=128, block_size=4)
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    yield base, adapters, pm, llm, requests
    llm.close()


def test_mixed_batch_of_four_adapters_and_the_base_matches_peft(llama_setup):
    base, adapters, pm, llm, requests = llama_setup
    names = ["all8", "qv4", None, "rs", "pattern"]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                        lora_request=[None if n is None else requests[n] for n in names])
    got = [o.outputs[0].token_ids for o in outs]
    want = [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]
    assert got == want
    # The adapters matter: every adapter changes at least one of these greedy answers.
    base_out = [_reference(pm, None, p) for p in PROMPTS]
    for name in adapters:
        assert [_reference(pm, name, p) for p in PROMPTS] != base_out, name
    assert outs[0].lora_request == requests["all8"] and outs[2].lora_request is None


def test_native_decode_stack_adds_adapters_like_the_per_op_path(llama_setup):
    """Decode steps with adapters run in the CPU's native decode stack (adapters added after each
    base matmul in C); the per-op path (the torch wrappers) is its oracle: same tokens, logprobs
    equal up to float32 summation order."""
    from kvserve.kernels.cpu import native

    if not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    _, _, _, llm, requests = llama_setup
    names = ["all8", "qv4", None, "rs", "pattern", "all8"]
    prompts = PROMPTS + [[3, 4, 5]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    lora = [None if n is None else requests[n] for n in names]
    model = llm.engine.model
    llm.generate(prompts[:1], params, use_tqdm=False)  # the stack is built at the first decode step
    stack = model._native_stack
    assert stack is not None and stack.lora_slots is not None
    calls = []
    real_run = stack.run

    def counting_run(*args, **kw):
        calls.append(args[-1] if len(args) > 6 else kw.get("lora"))
        return real_run(*args, **kw)

    stack.run = counting_run
    try:
        native_outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    finally:
        del stack.run
    assert any(c is not None for c in calls)  # steps with adapters took the stack
    model._native_stack = None
    try:
        per_op = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    finally:
        model._native_stack = stack
    for a, b in zip(native_outs, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            for t in da:
                assert da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4)


@pytest.mark.parametrize("name", ["all8", "pattern"])
def test_one_adapter_alone_matches_peft(llama_setup, name):
    _, _, pm, llm, requests = llama_setup
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests[name])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, name, p) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3", "mistral"])
def test_other_families_match_peft(tiny_model_factory, tmp_path, arch):
    base = tiny_model_factory(arch)
    adapters = {"a": build_lora_adapter(base, tmp_path / "a", r=8, seed=11, std=0.1),
                "b": build_lora_adapter(base, tmp_path / "b", r=4, seed=12, std=0.1,
                                        target_modules=["q_proj", "k_proj", "up_proj", "down_proj"])}
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    names = ["a", "b", None]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                            lora_request=[LoRARequest("a", 1, str(adapters["a"])),
                                          LoRARequest("b", 2, str(adapters["b"])), None])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


def test_phi3_fused_projections_match_peft(tiny_model_factory, tmp_path):
    """Phi-3 checkpoints fuse qkv_proj and gate_up_proj (kvserve splits them at load); PEFT adapts
    the fused modules: each part takes A whole and its rows of B."""
    base = tiny_model_factory("phi3")
    adapters = {"fused": build_lora_adapter(base, tmp_path / "fused", r=8, seed=31, std=0.1,
                                            target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                "qkv": build_lora_adapter(base, tmp_path / "qkv", r=4, seed=32, std=0.15, target_modules=["qkv_proj"])}
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    names = ["fused", "qkv", None]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                            lora_request=[LoRARequest("fused", 1, str(adapters["fused"])),
                                          LoRARequest("qkv", 2, str(adapters["qkv"])), None])
    want = [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0] != want[2] and want[1] != want[2]  # the adapters change the output


def test_moe_model_adapts_attention(tiny_model_factory, tmp_path):
    """MoE families: the attention projections take adapters (experts: test_lora_moe.py)."""
    base = tiny_model_factory("qwen2_moe")
    attn = build_lora_adapter(base, tmp_path / "attn", r=4, seed=21, std=0.15,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    pm = peft_model(base, {"attn": str(attn)})
    with LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(attn)))
        assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, "attn", p) for p in PROMPTS[:2]]


# -- the engine's adapter API and its errors -------------------------------------------------------
def test_add_list_remove_and_errors_name_the_problem(llama_setup, tiny_model_factory, tmp_path):
    base, adapters, _, llm, requests = llama_setup
    engine = llm.engine
    before = engine.list_loras()  # the tests before this one loaded some (or none, run alone)
    extra = LoRARequest("extra", 40, str(adapters["all8"]))
    assert engine.add_lora(extra) is True
    assert engine.add_lora(extra) is False  # the same adapter again
    assert 40 in engine.list_loras()
    with pytest.raises(ValueError, match="lora_int_id: 40 is already used"):
        engine.add_lora(LoRARequest("other", 40, str(adapters["qv4"])))
    with pytest.raises(ValueError, match="lora_name: 'extra' is already loaded"):
        engine.add_lora(LoRARequest("extra", 41, str(adapters["qv4"])))
    assert engine.remove_lora(40) is True and engine.remove_lora(40) is False
    assert 40 not in engine.list_loras()

    big = build_lora_adapter(base, tmp_path / "big", r=16, seed=5)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        engine.add_lora(LoRARequest("big", 50, str(big)))
    saved = tmp_path / "saved"
    shutil.copytree(adapters["qv4"], saved)
    cfg = json.loads((saved / "adapter_config.json").read_text())
    (saved / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\] is not supported .* target_modules"):
        engine.add_lora(LoRARequest("saved", 51, str(saved)))
    other_base = tiny_model_factory("llama", hidden_size=96)
    mismatch = build_lora_adapter(other_base, tmp_path / "mismatch", r=4, seed=7)
    with pytest.raises(ValueError, match="base model mismatch"):
        engine.add_lora(LoRARequest("mismatch", 52, str(mismatch)))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("empty", 53, str(tmp_path)))
    broken = tmp_path / "broken"
    shutil.copytree(adapters["qv4"], broken)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter weights"):
        engine.add_lora(LoRARequest("broken", 54, str(broken)))
    dora = tmp_path / "dora"
    shutil.copytree(adapters["qv4"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        engine.add_lora(LoRARequest("dora", 55, str(dora)))
    # A bad adapter on a request queues nothing.
    with pytest.raises(ValueError, match="above max_lora_rank"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 50, str(big)))
    assert not engine.has_unfinished_requests()
    assert engine.list_loras() == before
    with pytest.raises(ValueError, match="lora_int_id: must be an integer >= 1"):
        LoRARequest("zero", 0, str(big))


def test_embedding_and_lm_head_adapters_match_peft(llama_setup, tmp_path):
    """PEFT target_modules with embed_tokens and lm_head (untied head here; tied at PP=2 in
    test_lora_pipeline.py), mixed in one batch with a layers-only adapter and the base model;
    PEFT's saved copy of the base embedding is skipped, one of another vocabulary size refused."""
    from safetensors.torch import load_file, save_file

    base, adapters, _, llm, _ = llama_setup
    built = {"ev": build_lora_adapter(base, tmp_path / "ev", r=8, seed=11, std=0.3,
                                      target_modules=["embed_tokens", "lm_head", "q_proj"]),
             "e": build_lora_adapter(base, tmp_path / "e", r=4, seed=12, std=0.3, target_modules=["embed_tokens"]),
             "h": build_lora_adapter(base, tmp_path / "h", r=4, seed=13, std=0.3, target_modules=["lm_head", "v_proj"])}
    pm = peft_model(base, {**{k: str(v) for k, v in built.items()}, "all8": str(adapters["all8"])})
    requests = {name: LoRARequest(name, 60 + i, str(path)) for i, (name, path) in enumerate(built.items())}
    requests["all8"] = LoRARequest("all8", 1, str(adapters["all8"]))
    names = ["ev", None, "e", "h", "all8"]
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
        assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]
        for name in built:  # each changes the answer
            assert _reference(pm, name, PROMPTS[0]) != _reference(pm, None, PROMPTS[0]), name
        resized = tmp_path / "resized"
        shutil.copytree(built["e"], resized)
        tensors = load_file(resized / "adapter_model.safetensors")
        key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
        tensors[key] = torch.cat([tensors[key], tensors[key][:8]])
        save_file(tensors, resized / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="saves embed_tokens of shape .* resized vocabulary"):
            llm.engine.add_lora(LoRARequest("resized", 70, str(resized)))
    finally:
        for r in list(requests.values())[:3]:
            llm.engine.remove_lora(r.lora_int_id)


def test_remove_refuses_an_adapter_in_use(llama_setup):
    _, _, _, llm, requests = llama_setup
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY, lora_request=requests["qv4"])
    stats = engine.get_stats()
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters, stats.max_lora) == (["qv4"], [], 4)
    engine.step()
    assert engine.get_stats().running_lora_adapters == ["qv4"]
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.remove_lora(requests["qv4"].lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()


def test_lora_request_needs_enable_lora(tiny_model_factory, llama_setup):
    _, adapters, _, _, _ = llama_setup
    with LLM(str(tiny_model_factory("llama")), num_kv_blocks=32, block_size=4) as llm:
        with pytest.raises(ValueError, match="not enabled"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("a", 1, str(adapters["all8"])))
        assert llm.engine.list_loras() == set()
    with pytest.raises(ValueError, match="max_cpu_loras: must be >= max_loras"):
        LLM(str(tiny_model_factory("llama")), enable_lora=True, max_loras=4, max_cpu_loras=2)


# -- the rest of the engine with adapters ---------------------------------------------------------
def test_prefix_cache_is_keyed_by_adapter(llama_setup):
    _, _, pm, llm, requests = llama_setup
    prompt = list(range(50, 70))  # five full blocks of 4
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["all8"])[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["qv4"])[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["all8"])[0]
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert again.num_cached_tokens >= 16
    assert other.outputs[0].token_ids == _reference(pm, "qv4", prompt)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == _reference(pm, "all8", prompt)


def test_preemption_with_adapters_keeps_outputs(llama_setup):
    base, adapters, pm, _, requests = llama_setup
    names = ["all8", "qv4", "rs", None, "pattern"]
    # 10 blocks of 4 tokens cannot hold five sequences of ~16 tokens: some are preempted.
    with LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=10, block_size=4,
             enable_prefix_caching=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


def test_ngram_speculative_decoding_with_an_adapter(llama_setup):
    base, _, pm, _, requests = llama_setup
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        prompts = [[5, 6, 7, 5, 6, 7, 5, 6], PROMPTS[1]]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[requests["all8"], requests["qv4"]])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, "all8", prompts[0]),
                                                      _reference(pm, "qv4", prompts[1])]


def test_draft_model_speculative_decoding_with_an_adapter(llama_setup):
    """The draft model proposes without the adapter (it is the base model here); verification runs
    the adapter, so greedy output is the adapter's exactly, only acceptance is lower."""
    base, _, pm, _, requests = llama_setup
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             speculative_config={"method": "draft_model", "model": str(base), "num_speculative_tokens": 3}) as llm:
        names = ["all8", None, "qv4"]
        outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


def test_fp8_base_weights_with_an_adapter_match_peft_on_the_dequantized_model(llama_setup):
    """Load-time FP8 base (weight-only on the CPU, per-channel scales) with an adapter in full
    precision beside it. Oracle: peft on transformers whose projections hold the same FP8 values."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvserve.runtime.models.quantization.fp8 import quantize_fp8_per_channel

    base, adapters, _, _, requests = llama_setup
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and name.endswith("proj.weight"):
                q, scale = quantize_fp8_per_channel(p.data)
                p.copy_(q.float() * scale[:, None])
    pm = PeftModel.from_pretrained(hf, str(adapters["all8"]), adapter_name="all8").eval()
    names = ["all8", None]
    with LLM(str(base), quantization="fp8", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
             block_size=4) as llm:
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", dict(num_key_value_heads=1))])
def test_tensor_parallel_2_matches_peft(tiny_model_factory, tmp_path, arch, overrides):
    """TP=2 (gloo): A and B sharded with their base layer (column-parallel q|k|v and gate|up take
    their rows of B; row-parallel o and down their columns of A, summed in the one all-reduce;
    the embedding's and head's adapters whole on every rank);
    with one KV head both ranks keep a copy of k/v and of their B rows."""
    base = tiny_model_factory(arch, **overrides)
    # "a" adapts the embedding and the LM head too: each rank adds their whole products after the
    # base layer's all-reduce / all-gather.
    adapters = {"a": build_lora_adapter(base, tmp_path / "a", r=8, seed=31, std=0.1,
                                        target_modules=[*ALL_MODULES, "embed_tokens", "lm_head"]),
                "b": build_lora_adapter(base, tmp_path / "b", r=4, seed=32, std=0.15,
                                        target_modules=["k_proj", "v_proj", "o_proj", "down_proj"])}
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    names = ["a", None, "b", "a"]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=4,
             tensor_parallel_size=2, device="cpu") as llm:
        outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else LoRARequest(n, 1 + (n == "b"), str(adapters[n]))
                                          for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


def test_int8_base_weights_with_adapters_match_peft_on_the_dequantized_model(tiny_model_factory, llama_setup):
    """Quantized base (load-time int8, every linear and the vocabulary): the adapters run in full
    precision beside it. Oracle: peft on transformers with the same dequantized int8 weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvserve.runtime.models.quantization.packed import quantize_int8

    base, adapters, _, _, requests = llama_setup
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                q, s = quantize_int8(p.data, p.shape[1])
                p.copy_(q.float() * s)
    pm = PeftModel.from_pretrained(hf, str(adapters["all8"]), adapter_name="all8")
    pm.load_adapter(str(adapters["rs"]), adapter_name="rs")
    pm.eval()
    names = ["all8", None, "rs"]
    with LLM(str(base), quantization="int8", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
             block_size=4) as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]


def test_structured_output_with_an_adapter(llama_setup):
    _, _, _, llm, requests = llama_setup
    choices = ["yes", "no", "maybe later"]
    params = SamplingParams(max_tokens=16, temperature=0, structured_outputs={"choice": choices})
    outs = llm.generate(["Is it?", "Or not?"], params, use_tqdm=False, lora_request=[requests["all8"], None])
    assert all(o.outputs[0].text in choices for o in outs)


def test_bfloat16_adapters_on_a_float32_model_match_peft_on_rounded_weights(tiny_model_factory, tmp_path):
    """lora_dtype="bfloat16" (vLLM's --lora-dtype): the slots hold bfloat16 (half the bytes a decode
    step reads), the native decode stack widens them as it reads. Oracle: peft with the adapters'
    weights rounded to bfloat16 (scalings 16/8 and 16/4 are powers of two: rounding B before or
    after scaling is the same)."""
    base = tiny_model_factory("llama")
    adapters = {"a": build_lora_adapter(base, tmp_path / "a", r=8, seed=51, std=0.1,
                                        target_modules=[*ALL_MODULES, "embed_tokens", "lm_head"]),
                "b": build_lora_adapter(base, tmp_path / "b", r=4, seed=52, std=0.15)}
    pm = peft_model(base, {k: str(v) for k, v in adapters.items()})
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(p.to(torch.bfloat16).float())
    names = ["a", None, "b", "a"]
    with LLM(str(base), enable_lora=True, lora_dtype="bfloat16", max_loras=2, max_lora_rank=8, num_kv_blocks=64,
             block_size=4) as llm:
        outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else LoRARequest(n, 1 + (n == "b"), str(adapters[n]))
                                          for n in names])
        model = llm.engine.executor.driver_worker.model
        assert model.layers[0].self_attn.qkv_proj.a_t.dtype == torch.bfloat16
        assert model._native_stack.lora_slots is not None  # decode steps took the native stack
    assert [o.outputs[0].token_ids for o in outs] == [_reference(pm, n, p) for n, p in zip(names, PROMPTS)]
    # float16 slots: the native stack does not read them, so adapter steps take the per-op path.
    with LLM(str(base), enable_lora=True, lora_dtype="float16", max_loras=1, max_lora_rank=8, num_kv_blocks=32,
             block_size=4) as llm:
        half = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[LoRARequest("b", 2, str(adapters["b"])),
                                                                               None])
        assert llm.engine.executor.driver_worker.model._native_stack.lora_slots is None
    assert half[1].outputs[0].token_ids == outs[1].outputs[0].token_ids  # the base model, unchanged
    assert half[0].outputs[0].token_ids != half[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_dtype"):
        LLM(str(base), enable_lora=True, lora_dtype="int8")
