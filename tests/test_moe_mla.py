"""MoE routing and MLA pieces against transformers' own modules, and the config checks that
refuse variants this runtime does not implement (naming the field and what is supported)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.moe import select_experts


def _sorted(weights, ids):
    """(ids, weights) sorted by id per token: routers may return the top-k in any order."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


def _routing(tmp_path: pathlib.Path, hf_config) -> ModelConfig:
    d = tmp_path / hf_config.model_type
    d.mkdir(exist_ok=True)
    hf_config.save_pretrained(d)
    return ModelConfig.from_pretrained(d)


ROUTERS = {
    "mixtral": ("MixtralConfig", "modeling_mixtral", "MixtralTopKRouter",
                dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "modeling_qwen2_moe", "Qwen2MoeTopKRouter",
                  dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "modeling_qwen3_moe", "Qwen3MoeTopKRouter",
                  dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),
    "deepseek_v2-greedy": ("DeepseekV2Config", "modeling_deepseek_v2", "DeepseekV2TopkRouter",
                           dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
                                routed_scaling_factor=1.7)),
    "deepseek_v2-group": ("DeepseekV2Config", "modeling_deepseek_v2", "DeepseekV2TopkRouter",
                          dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                               n_group=4, topk_group=2, routed_scaling_factor=1.0)),
    "deepseek_v3": ("DeepseekV3Config", "modeling_deepseek_v3", "DeepseekV3TopkRouter",
                    dict(n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
                         norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_select_experts_matches_transformers_router(tmp_path, name):
    import importlib

    import transformers

    cfg_cls, module, router_cls, fields = ROUTERS[name]
    hf_cfg = getattr(transformers, cfg_cls)(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=4, vocab_size=300, **fields)
    hf_cfg.architectures = [cfg_cls.removesuffix("Config") + "ForCausalLM"]
    model_type = name.split("-")[0]
    router = getattr(importlib.import_module(f"transformers.models.{model_type}.{module}"), router_cls)(hf_cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape, generator=g))
    hidden = torch.randn(64, 32, generator=g)
    cfg = _routing(tmp_path, hf_cfg)
    with torch.no_grad():
        _, want_w, want_ids = router(hidden)
        logits = torch.nn.functional.linear(hidden, router.weight)
        bias = getattr(router, "e_score_correction_bias", None)
        got_w, got_ids = select_experts(logits, cfg.shape.moe.experts_per_token, cfg.routing, bias)
    want_ids, want_w = _sorted(want_w, want_ids)
    got_ids, got_w = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


def _write(tmp_path: pathlib.Path, arch: str, **changes) -> pathlib.Path:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}
    if arch.startswith("Deepseek"):
        base.update(model_type="deepseek_v3" if "V3" in arch else "deepseek_v2", kv_lora_rank=32,
                    q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
    else:
        base.update(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    base.update(architectures=[arch], **changes)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return tmp_path


@pytest.mark.parametrize("arch,changes,message", [
    ("DeepseekV3ForCausalLM", dict(scoring_func="softmax"), "scoring_func 'softmax'.*supported: 'sigmoid'"),
    ("DeepseekV2ForCausalLM", dict(scoring_func="sigmoid"), "scoring_func 'sigmoid'.*supported: 'softmax'"),
    ("DeepseekV3ForCausalLM", dict(topk_method="greedy"), "topk_method 'greedy'.*supported: 'noaux_tc'"),
    ("DeepseekV2ForCausalLM", dict(topk_method="noaux_tc"),
     "topk_method 'noaux_tc'.*supported: 'greedy', 'group_limited_greedy'"),
    ("DeepseekV2ForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob true.*supported: false"),
    ("DeepseekV3ForCausalLM", dict(n_group=3, topk_group=1), "n_group 3 must divide the 8 routed experts"),
    ("DeepseekV3ForCausalLM", dict(n_group=2, topk_group=3), "topk_group 3 must be in"),
    ("DeepseekV3ForCausalLM", dict(n_group=8, topk_group=2), "noaux_tc.*two best experts"),
    ("DeepseekV3ForCausalLM", dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 exceeds"),
    ("DeepseekV3ForCausalLM", dict(attention_bias=True), "attention_bias true.*supported: false"),
    ("DeepseekV2ForCausalLM", dict(kv_lora_rank=None), "needs kv_lora_rank"),
    ("DeepseekV3ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq 2.*supported: 1"),
    ("MixtralForCausalLM", dict(num_local_experts=0), "positive expert count"),
    ("MixtralForCausalLM", dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_moe_and_mla_variants_are_named(tmp_path, arch, changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(_write(tmp_path, arch, **changes))


def test_mla_softmax_scale_and_rotary_dim_follow_transformers(tmp_path):
    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    cfg = ModelConfig.from_pretrained(_write(tmp_path, "DeepseekV2ForCausalLM", rope_parameters=rope))
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    assert cfg.rotary_dim == 8 and cfg.rope_interleave
    assert cfg.attention_scale() == pytest.approx(yarn_apply_mscale(rope, 24**-0.5), rel=1e-12)
    v3 = ModelConfig.from_pretrained(_write(tmp_path, "DeepseekV3ForCausalLM", rope_interleave=False))
    assert not v3.rope_interleave and v3.attention_scale() == pytest.approx(24**-0.5)


# ----------------------------------------------------------------- quantized experts and MLA


def _fake_quantized_moe_hf(model_dir, quantization):
    """transformers' model with every weight our quantized model quantizes replaced by its
    dequantized int8/int4 values: each expert's matrices (stored 3-D, [E, out, in]), attention and
    dense/shared MLP projections, the vocabulary; not the router, the shared-expert gate or MLA's
    kv_b_proj, which stay in full precision."""
    from transformers import AutoModelForCausalLM

    from kvserve.runtime.models.quantization.int4 import group_size_for
    from kvserve.runtime.models.quantization.packed import quantize_int4, quantize_int8

    def fake(w):
        if quantization == "int8":
            q, s = quantize_int8(w, w.shape[1])
            return q.float() * s
        g = group_size_for(w.shape[1])
        q, s, o = quantize_int4(w, g)
        return (q.float().view(w.shape[0], -1, g) * s[..., None] + o[..., None]).reshape(w.shape)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    keep = ("mlp.gate.weight", "shared_expert_gate.weight", "kv_b_proj.weight")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(keep) or p.dim() < 2:
                continue
            if p.dim() == 3:
                for e in range(p.shape[0]):
                    p[e].copy_(fake(p[e].clone()))
            else:
                p.copy_(fake(p.data.clone()))
    return hf


@pytest.mark.parametrize("arch,quantization", [("mixtral", "int8"), ("qwen3_moe", "int4"),
                                               ("deepseek_v3", "int8")])
def test_quantized_experts_and_mla_match_transformers_on_dequantized_weights(tiny_model_factory, arch,
                                                                             quantization):
    from test_models import PagedCache, _hf_logits, _prompts

    from kvserve.kernels import ops
    from kvserve.runtime.attention import TorchAttentionBackend
    from kvserve.runtime.models import load_model
    from kvserve.runtime.models.moe import QuantizedExperts
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    model_dir = tiny_model_factory(arch)
    hf = _fake_quantized_moe_hf(model_dir, quantization)
    set_cpu_packed(False)  # the exact dequantize-then-matmul twin (quant's tests cover the packed kernels)
    try:
        model = load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                           quantization=quantization)
    finally:
        set_cpu_packed(None)
    moe_layer = model.layers[model.config.shape.moe.moe_layers[0]].mlp
    assert isinstance(moe_layer.experts, QuantizedExperts)
    assert moe_layer.experts.down[0].quant_method.name == quantization
    assert not hasattr(moe_layer.experts.gate_up[0], "weight")  # no full-precision copy kept
    prompt = _prompts(512, [13])[0]
    cache = PagedCache(model, num_blocks=16)
    got = cache.step(model, [(0, prompt)])
    torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=2e-4, rtol=0)
    # one decode step too (MLA: the absorbed path, with kv_b_proj in full precision)
    nxt = cache.step(model, [(0, [7])])
    torch.testing.assert_close(nxt, _hf_logits(hf, prompt + [7])[-1:], atol=2e-4, rtol=0)
    # The path a CUDA graph captures (no routing counts read back) agrees with the routed one and
    # traces whole: a .tolist() would stop fullgraph.
    experts, n = moe_layer.experts, model.config.shape.moe.experts_per_token
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, model.config.shape.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:n] for _ in range(3)])
    weights = torch.rand(3, n, generator=g)
    set_cpu_packed(False)  # the twins (the GPU's path); the native CPU kernels are not traceable
    try:
        with ops.kernel_mode("torch"):
            dense = torch.compile(experts.forward, fullgraph=True, backend="eager")(x, weights, ids)
    finally:
        set_cpu_packed(None)
        torch._dynamo.reset()
    torch.testing.assert_close(dense, experts(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_prequantized_deepseek_checkpoint_with_interleaved_rope_is_refused(tiny_model_factory):
    """A packed format's tensors cannot take the row permutation of the interleaved rotary dims."""
    from kvserve.runtime.attention import TorchAttentionBackend
    from kvserve.runtime.models import load_model
    from kvserve.runtime.models.quantization.base import LinearMethod, QuantizationConfig, sharded_param

    class PackedMethod(LinearMethod):
        name = "packed-test"

        def create_weights(self, layer, spec):
            sharded_param(layer, "qweight", spec, (spec.out_features, spec.in_features // 8), torch.int32,
                          out_dim=0, in_dim=1, in_div=8)

    class PackedConfig(QuantizationConfig):
        name = "packed-test"

        def get_linear_method(self, spec):
            return PackedMethod()

    with pytest.raises(ValueError, match="quantization: a checkpoint quantized as 'packed-test' is not supported "
                                         "for DeepseekV2ForCausalLM"):
        load_model(tiny_model_factory("deepseek_v2"), dtype=torch.float32, device="cpu",
                   attention_backend=TorchAttentionBackend(), quantization=PackedConfig())


def test_tp_that_splits_an_expert_unevenly_is_refused_before_any_worker(tiny_model_factory):
    from kvserve.runtime import LLM

    model_dir = tiny_model_factory("mixtral", intermediate_size=130)  # Mixtral's expert size
    with pytest.raises(ValueError, match="tensor_parallel_size: tensor_parallel_size 4 does not divide the "
                                         "model's expert intermediate size 130"):
        LLM(str(model_dir), tensor_parallel_size=4, device="cpu")


def test_mla_latent_pool_with_prefix_hits_and_forked_samples(tiny_model_factory, monkeypatch):
    """Prefix-cache hits and n > 1 forks (copy-on-write of a shared partial block) on the latent
    pool: every greedy completion equals transformers' continuation of its prompt."""
    from test_engine_parity import hf_greedy

    import kvserve.runtime.executor.worker as model_runner
    from kvserve.runtime import LLM, SamplingParams

    copied = []
    real_copy = model_runner.copy_blocks
    monkeypatch.setattr(model_runner, "copy_blocks", lambda caches, pairs: (copied.extend(pairs),
                                                                             real_copy(caches, pairs)))
    model_dir = tiny_model_factory("deepseek_v2")
    prefix = list(range(10, 31))  # 5 full blocks of 4 and one partial
    prompts = [prefix + [40, 41], prefix + [50], prefix]
    want = hf_greedy(model_dir, prompts, [6, 6, 6])
    with LLM(str(model_dir), block_size=4, num_kv_blocks=64) as llm:
        llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prefix
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
        assert llm.engine.get_stats().prefix_cache_hits_total > 0
    assert copied, "the workload must exercise copy-on-write"
    for out, expected in zip(outs, want):
        assert [list(c.token_ids) for c in out.outputs] == [expected, expected]
