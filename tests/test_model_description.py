"""One model description: config.json is read once (ModelShape, then ModelConfig on top of it),
each family rule is written once, and the weight formats are one torch-free registry whose
config classes the runtime's linear methods extend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.runtime.architectures import SUPPORTED_ARCHITECTURES, architecture_of, attention_biases
from kvserve.runtime.capacity import ModelShape
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.weight_formats import (
    CHECKPOINT_FORMATS,
    FORMATS,
    LOAD_TIME_FORMATS,
    WEIGHT_FORMATS,
    format_name,
    resolve_format,
    weight_format,
)

BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256}


def _config(arch: str, **extra):
    return {"architectures": [arch], **BASE, **extra}


# ---------------------------------------------------------------------------- torch-free imports


TORCH_FREE_SCRIPT = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from kvserve.runtime.capacity import ModelShape, plan_capacity, weight_format
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.weight_formats import resolve_format
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.agent import app, model_info
from kvserve.operator import autoscaler, cli, handlers, spec, status
config = json.loads(sys.argv[1])
cfg = ModelConfig.from_dict(config)
fmt = weight_format(resolve_format(None, config), 2, 64, config["quantization_config"])
plan = plan_capacity(cfg.shape, dtype_size=2, block_size=16, tp=2, gpu_memory_bytes=2**34, weight_format=fmt)
print(json.dumps([cfg.architecture, cfg.all_layers_sliding, fmt.name, plan.kv_tokens > 0,
                  sorted(m for m in sys.modules if m.startswith("torch"))]))
"""


def test_the_capacity_model_config_and_formats_import_without_torch():
    """The operator and the agent sidecar carry no torch: what they import of the runtime (and the
    engine options they validate) must not pull it in (checked in a fresh interpreter where
    importing torch fails)."""
    config = _config("MistralForCausalLM", sliding_window=32,
                     quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32})
    done = subprocess.run([sys.executable, "-c", TORCH_FREE_SCRIPT, json.dumps(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["MistralForCausalLM", True, "awq", True, ["torch"]]


# ---------------------------------------------------------------------------- one description


CONFIGS = [
    _config("LlamaForCausalLM"),
    _config("LlamaForCausalLM", attention_bias=True, tie_word_embeddings=True),
    _config("MistralForCausalLM", sliding_window=16, attention_bias=True),
    _config("Qwen2ForCausalLM"),
    _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=2),
    _config("Gemma2ForCausalLM", sliding_window=16, head_dim=16),
    _config("Gemma3ForCausalLM", sliding_window=16, head_dim=16, sliding_window_pattern=2),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["architectures"][0])
def test_model_config_builds_on_the_capacity_shape(config):
    """ModelConfig does not read the shape's fields again: its sizes, bias, tied embeddings and
    layer kinds are the shape's, so the operator plans exactly the model the runtime builds."""
    cfg = ModelConfig.from_dict(config)
    shape = ModelShape.from_hf_config(config)
    assert cfg.shape == shape
    assert (cfg.qkv_bias, cfg.tie_word_embeddings, cfg.sliding_window) == (
        shape.attention_bias, shape.tie_word_embeddings, shape.sliding_window)
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [shape.layer_window(i) for i in range(4)]
    assert cfg.all_layers_sliding == (shape.kv_release_window is not None)


@given(arch=st.sampled_from(["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                               "Gemma2ForCausalLM", "Gemma3ForCausalLM"]),
       attention_bias=st.booleans(), tied=st.booleans(), window=st.one_of(st.none(), st.integers(1, 64)),
       use_sliding_window=st.booleans(), max_window_layers=st.integers(0, 4))
def test_any_config_gives_one_shape(arch, attention_bias, tied, window, use_sliding_window, max_window_layers):
    config = _config(arch, attention_bias=attention_bias, tie_word_embeddings=tied, sliding_window=window,
                     use_sliding_window=use_sliding_window, max_window_layers=max_window_layers, head_dim=16)
    try:
        cfg = ModelConfig.from_dict(config)
    except ValueError:  # (Gemma without a window) the shape refuses it with the same message
        with pytest.raises(ValueError, match="sliding_window is null"):
            ModelShape.from_hf_config(config)
        return
    assert cfg.shape == ModelShape.from_hf_config(config)
    assert (cfg.qkv_bias, cfg.o_proj_bias) == attention_biases(arch, config)
    assert cfg.all_layers_sliding == (cfg.shape.num_sliding_layers == 4)


@pytest.mark.parametrize("arch, extra, biases", [
    ("LlamaForCausalLM", {}, (False, False)),
    ("LlamaForCausalLM", {"attention_bias": True}, (True, True)),
    ("Qwen2ForCausalLM", {}, (True, False)),
    ("Qwen2ForCausalLM", {"attention_bias": True}, (True, False)),
    ("Qwen2MoeForCausalLM", {}, (True, False)),
    ("Qwen2MoeForCausalLM", {"qkv_bias": False, "attention_bias": True}, (False, False)),
    ("MistralForCausalLM", {"attention_bias": True}, (False, False)),
    ("MixtralForCausalLM", {"attention_bias": True}, (False, False)),
    ("Qwen3ForCausalLM", {"attention_bias": True}, (True, True)),
])
def test_one_attention_bias_rule(arch, extra, biases):
    assert attention_biases(arch, extra) == biases


def test_the_bias_rule_reaches_the_model_and_the_plan():
    qwen2 = _config("Qwen2ForCausalLM")
    cfg = ModelConfig.from_dict(qwen2)
    assert (cfg.qkv_bias, cfg.o_proj_bias) == (True, False)
    # A hand-written operator config may name only the model type: same family, same bias.
    assert ModelShape.from_hf_config({"model_type": "qwen2", **BASE}).attention_bias
    assert not ModelShape.from_hf_config({"model_type": "llama", **BASE}).attention_bias


@pytest.mark.parametrize("config, arch", [
    ({"architectures": ["Foo", "Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"architectures": ["FooForCausalLM"]}, "FooForCausalLM"),
    ({"model_type": "mistral"}, "MistralForCausalLM"),
    ({"model_type": "unknown"}, ""),
    ({}, ""),
])
def test_architecture_of(config, arch):
    assert architecture_of(config) == arch


@pytest.mark.parametrize("types, every", [
    (["sliding_attention"] * 4, True),
    (["sliding_attention"] * 3 + ["full_attention"], False),
    (["full_attention"] * 4, False),
])
def test_every_layer_sliding_is_one_rule(types, every):
    config = _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, layer_types=types)
    cfg, shape = ModelConfig.from_dict(config), ModelShape.from_hf_config(config)
    assert cfg.all_layers_sliding == shape.all_layers_sliding == every
    assert shape.kv_release_window == (16 if every else None)
    assert shape.num_sliding_layers == types.count("sliding_attention")


def test_model_config_dtype_is_a_name_until_torch_asks():
    import torch

    cfg = ModelConfig.from_dict(_config("LlamaForCausalLM", torch_dtype="bfloat16"))
    assert cfg.dtype_name == "bfloat16" and cfg.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model config: dtype 'int4' is not supported"):
        ModelConfig.from_dict(_config("LlamaForCausalLM", torch_dtype="int4"))


# ---------------------------------------------------------------------------- weight formats


def test_registry_lists_follow_the_config_classes():
    assert WEIGHT_FORMATS == ("int8", "int4", "awq", "gptq", "compressed-tensors", "fp8", "gguf", "bitsandbytes")
    assert CHECKPOINT_FORMATS == ("awq", "gptq", "compressed-tensors", "fp8", "gguf", "bitsandbytes")
    assert LOAD_TIME_FORMATS == ("int8", "int4", "fp8")


@pytest.mark.parametrize("name", WEIGHT_FORMATS)
def test_the_runtime_config_classes_extend_the_registry(name):
    """The linear methods import the torch-free class and add only the torch half: parsing and
    bytes per weight are written once."""
    from kvserve.runtime.models.quantization import _config_class

    runtime_class = _config_class(name)
    assert issubclass(runtime_class, FORMATS[name]) and runtime_class.name == name
    for own in ("from_config", "weight_format", "describe", "quantizes_vocab", "__init__"):
        assert own not in vars(runtime_class), f"{runtime_class.__name__} redefines {own}"


QUANT_CONFIGS = [
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}),
    ("gptq", {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": True}),
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": -1}),
    ("fp8", {"quant_method": "fp8", "activation_scheme": "static"}),
    ("compressed-tensors", {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}),
    ("gguf", {"quant_method": "gguf", "tensor_types": {"model.layers.0.mlp.up_proj.weight": "Q8_0",
                                                       "model.embed_tokens.weight": "Q4_K"}}),
]


@pytest.mark.parametrize("name, qc", QUANT_CONFIGS, ids=[n for n, _ in QUANT_CONFIGS])
def test_the_plan_and_the_loader_read_one_parse(name, qc):
    from kvserve.runtime.models.quantization import resolve_quantization

    loaded = resolve_quantization(None, {"quantization_config": qc})
    assert loaded.name == name
    assert weight_format(name, 2, 576, qc) == loaded.weight_format(2, 576)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 3}, "quantization_config.bits: awq supports 4, got 3"),
    ({"quant_method": "gptq", "group_size": 20}, "quantization_config.group_size: gptq needs -1 or a multiple of 16"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "needs at least one group"),
])
def test_planning_refuses_what_the_loader_refuses(qc, match):
    with pytest.raises(ValueError, match=match):
        weight_format(qc["quant_method"], 2, 4096, qc)


def test_planning_without_a_checkpoint_config_uses_each_formats_defaults():
    assert weight_format("compressed-tensors", 2, 4096).linear_bytes == pytest.approx(0.5 + 4 / 128)
    gguf = weight_format("gguf", 2, 4096)  # no tensor types known yet: planned dequantized
    assert (gguf.name, gguf.linear_bytes, gguf.vocab_bytes) == ("gguf", 2, 2)


@given(st.sampled_from(WEIGHT_FORMATS), st.lists(st.booleans(), min_size=20, max_size=20))
def test_format_names_ignore_case_and_underscores(name, upper):
    spelled = "".join(c.upper() if u else c for c, u in zip(name, upper)).replace("-", "_")
    assert format_name(spelled) == name


@pytest.mark.parametrize("value", ["q4_k_m", "int3", "", "none"])
def test_unknown_format_names_the_field(value):
    with pytest.raises(ValueError, match=rf"^quantization: unknown format {value!r}; supported: int8, int4"):
        format_name(value)
    with pytest.raises(ValueError, match=r"^quantization: unknown format"):
        resolve_format(value, {})
    with pytest.raises(ValueError, match=r"^quantization: unknown format"):
        weight_format(value, 2)


def test_every_supported_architecture_has_a_family_for_hand_written_configs():
    from kvserve.runtime.architectures import _BY_MODEL_TYPE

    assert sorted(_BY_MODEL_TYPE.values()) == sorted(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_counts_hybrid_kv_groups_at_every_tp_degree(tp):
    """The runtime keeps one pool per layer kind at every TP degree, so the plan's sequences at a
    long context count the local layers' window bound at TP 2 as at TP 1."""
    from kvserve.runtime.capacity import kv_tokens_held, plan_capacity

    gemma = ModelShape.from_hf_config(_config("Gemma2ForCausalLM", sliding_window=64, head_dim=16))
    assert gemma.num_sliding_layers == 2
    plan = plan_capacity(gemma, dtype_size=2, block_size=16, tp=tp, gpu_memory_bytes=2**30,
                         activation_reserve_bytes=0, context_len=4096)
    one_table = plan.kv_tokens // kv_tokens_held(gemma, 4096, block_size=16, max_step_tokens=2048,
                                                 kv_cache_groups=False)
    assert plan.max_sequences_at_context_len > one_table
