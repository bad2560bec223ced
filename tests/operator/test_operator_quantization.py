"""spec.runtime.quantization and spec.runtime.kvCacheDtype: parsed and validated, passed to the
runtime as flags, and used by the TP plan (an AWQ 70B fits on fewer GPUs than its bfloat16)."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from kvserve.operator.autoscaler import valid_degrees
from kvserve.operator.manifests import runtime_command
from kvserve.operator.spec import SpecError, model_shape, parse_spec
from kvserve.runtime.capacity import (
    WEIGHT_FORMATS,
    GiB,
    ModelShape,
    dtype_bytes,
    plan_capacity,
    weight_bytes_per_gpu,
    weight_format,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _spec(runtime=None, config=LLAMA_70B, tensor=None):
    return parse_spec({"model": {"uri": "hf://org/m", "config": config}, "runtime": runtime or {},
                       "parallelism": {"tensor": tensor or {"min": 1, "max": 8, "initial": 2}}})


def test_quantization_and_kv_cache_dtype_parse_and_reach_the_runtime_flags():
    spec = _spec({"quantization": "awq", "kvCacheDtype": "fp8"})
    assert (spec.runtime.quantization, spec.runtime.kv_cache_dtype) == ("awq", "fp8")
    command = runtime_command("svc", spec, 2)
    assert command[command.index("--quantization") + 1] == "awq"
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8"
    plain = runtime_command("svc", _spec(), 2)
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain


@pytest.mark.parametrize("field, value, match", [
    ("quantization", "q4_k_m", "spec.runtime.quantization: unsupported value 'q4_k_m'; supported: int8, int4"),
    ("kvCacheDtype", "int8", "spec.runtime.kvCacheDtype: unsupported value 'int8'; supported: auto, fp8"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(SpecError, match=match):
        _spec({field: value})


def test_crd_schema_agrees_with_the_parser():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvserve.dev.yaml").read_text())
    runtime = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["runtime"]
    assert runtime["properties"]["quantization"]["enum"] == list(WEIGHT_FORMATS)
    assert runtime["properties"]["kvCacheDtype"]["enum"] == ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


def test_awq_70b_fits_fewer_gpus_than_bf16():
    bf16 = _spec()
    awq_by_spec = _spec({"quantization": "awq"})
    awq_by_config = _spec(config={**LLAMA_70B, "quantization_config": AWQ})
    shape = model_shape(bf16)
    # ~141 GB of bfloat16 weights need two 80 GiB GPUs; ~37 GB of AWQ fit one.
    assert valid_degrees(bf16, shape) == [2, 4, 8]
    assert valid_degrees(awq_by_spec, shape) == [1, 2, 4, 8]
    assert valid_degrees(awq_by_config, model_shape(awq_by_config)) == [1, 2, 4, 8]


def test_fp8_kv_cache_doubles_the_planned_tokens():
    shape = ModelShape.from_hf_config(LLAMA_70B)
    kw = dict(dtype_size=2, block_size=16, tp=4, gpu_memory_bytes=80 * GiB)
    assert plan_capacity(shape, kv_dtype_size=1, **kw).kv_tokens >= 2 * plan_capacity(shape, **kw).kv_tokens - 16


@pytest.mark.parametrize("name, qc, linear_bytes", [
    (None, None, 2.0),
    ("int8", None, 1 + 2 / 8192),
    ("int4", None, 0.5 + 4 / 128),
    ("awq", AWQ, 0.5 + 4 / 128),
    ("gptq", {"bits": 4, "group_size": 32}, 0.5 + 4 / 32),
    ("gptq", {"bits": 8, "group_size": 128}, 1 + 2 / 128),
    ("fp8", None, 1 + 4 / 8192),
    ("compressed-tensors", {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                "group_size": 64}}}}, 0.5 + 4 / 64),
    ("compressed-tensors", {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                "strategy": "channel"}}}}, 1 + 4 / 8192),
    # bitsandbytes: LLM.int8 kept as per-channel int8; NF4/FP4 kept packed with a float32 absmax per 64.
    ("bitsandbytes", {"load_in_8bit": True}, 1 + 2 / 8192),
    ("bitsandbytes", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, 0.5 + 4 / 64),
    ("bitsandbytes", None, 0.5 + 4 / 64),
])
def test_bytes_per_weight_of_every_format(name, qc, linear_bytes):
    fmt = weight_format(name, dtype_bytes("bfloat16"), 8192, qc)
    assert fmt.linear_bytes == pytest.approx(linear_bytes)
    shape = ModelShape.from_hf_config(LLAMA_70B)
    vocab = 2 * 128256 * 8192  # untied embedding + LM head
    norms = 80 * 2 * 8192 + 8192
    linear = weight_bytes_per_gpu(shape, 1) - vocab - norms
    want = linear * linear_bytes + vocab * fmt.vocab_bytes + norms * 2
    assert weight_bytes_per_gpu(shape, 2, 1, fmt) == pytest.approx(want, rel=1e-9)
    assert fmt.vocab_bytes == (fmt.linear_bytes if name in (None, "int8", "int4") else 2)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_load_time_quantization_is_refused_for_the_vllm_engine(name):
    """kvserve's load-time int8/int4 have no vLLM --quantization method of that name: a vLLM pod
    given one would crash-loop, so the spec is refused instead."""
    with pytest.raises(SpecError, match=f"spec.runtime.quantization: {name!r} is kvserve's load-time "
                                        f"quantization; vLLM has no such method"):
        _spec({"engine": "vllm", "quantization": name})
    for ok in ("awq", "gptq", "compressed-tensors", "fp8", "gguf", "bitsandbytes"):
        assert _spec({"engine": "vllm", "quantization": ok}).runtime.quantization == ok
