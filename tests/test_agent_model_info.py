"""What the agent reports about its pod's model (`model` in /v1/signals, `kvserve agent model-info`).

Pure mapping from config.json, then the real SmolLM2-135M (its float32 HF directory and its Q4_1
GGUF, read by the GGUF reader in a child process), then a live agent whose model directory fills
after it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvserve.runtime.agent.model_info import compact_config, describe, read_model_info
from kvserve.runtime.capacity import ModelShape

KVSERVE = str(Path(sys.executable).parent / "kvserve")

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
         "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
         "vocab_size": 128256, "torch_dtype": "bfloat16", "id2label": {str(i): f"L{i}" for i in range(400)}}


def test_describe_a_llama_config():
    info = describe(LLAMA, weight_bytes=16_060_522_496, fmt="safetensors")
    assert {k: v for k, v in info.items() if k != "config"} == {
        "architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 14336,
        "vocab_size": 128256, "dtype": "bfloat16", "quantization": None, "weight_bytes": 16_060_522_496,
        "format": "safetensors"}
    # The config is passed on without bulky fields, and the shared capacity model reads it.
    assert "id2label" not in info["config"] and info["config"]["num_key_value_heads"] == 8
    assert ModelShape.from_hf_config(info["config"]).num_kv_heads == 8


@pytest.mark.parametrize("config,expected", [
    ({**LLAMA, "quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
    ({**LLAMA, "quantization_config": {"format": "float-quantized"}}, "float-quantized"),
    ({**LLAMA, "quantization_config": {}}, "unknown"),
])
def test_quantization_comes_from_quantization_config(config, expected):
    assert describe(config, weight_bytes=None, fmt="safetensors")["quantization"] == expected


def test_multimodal_configs_report_their_language_model():
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"num_hidden_layers": 34, "hidden_size": 2560, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "head_dim": 256, "torch_dtype": "bfloat16"}}
    info = describe(config, weight_bytes=None, fmt="safetensors")
    assert (info["num_layers"], info["num_kv_heads"], info["head_dim"], info["dtype"]) == (34, 4, 256, "bfloat16")


def test_compact_config_keeps_the_small_fields_within_its_budget():
    config = {f"k{i:04d}": "x" * 100 for i in range(400)}
    out = compact_config(config)
    assert len(json.dumps(out)) <= 16 * 1024 and list(out)[0] == "k0000"


def test_quantized_checkpoints_keep_what_planning_reads():
    """A quantization_config over the per-field budget (GPTQModel's `meta`, llm-compressor's long
    `ignore` lists, a GGUF file's per-tensor types) is reduced, not dropped: the operator plans a
    learned model with the same weight format as the checkpoint's own config."""
    from kvserve.runtime.capacity import weight_format

    fixtures = Path(__file__).parent / "fixtures" / "quant"
    gptq = json.loads((fixtures / "gptq-g32" / "config.json").read_text())
    ct = json.loads((fixtures / "ct-w4a16-g32" / "config.json").read_text())
    ct["quantization_config"]["ignore"] = [f"model.layers.{i}.mlp.gate" for i in range(200)]
    types = {f"model.layers.{i}.{m}.weight": "Q4_K" for i in range(80)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    types.update({f"model.layers.{i}.input_layernorm.weight": "F32" for i in range(80)})
    types.update({"model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q6_K"})
    gguf = {**LLAMA, "quantization_config": {"quant_method": "gguf", "tensor_types": types}}
    for name, config in (("gptq", gptq), ("compressed-tensors", ct), ("gguf", gguf)):
        assert len(json.dumps(config["quantization_config"])) > 1024, name
        learned = compact_config(config)
        qc = learned.get("quantization_config")
        assert qc is not None and qc["quant_method"] == name, name
        assert len(json.dumps(qc)) <= 1024, name
        assert weight_format(name, 2, 4096, qc) == weight_format(name, 2, 4096, config["quantization_config"]), name


def test_real_smollm2_hf_directory(smollm2):
    info = read_model_info(smollm2.hf_dir)
    assert (info["architecture"], info["num_layers"], info["num_attention_heads"], info["num_kv_heads"],
            info["head_dim"], info["hidden_size"], info["vocab_size"]) == ("LlamaForCausalLM", 30, 9, 3, 64, 576, 49152)
    assert info["format"] == "safetensors" and info["quantization"] is None
    # float32 weights: 4 bytes per parameter (tied embeddings stored once).
    shape = ModelShape.from_hf_config(info["config"])
    assert info["weight_bytes"] == pytest.approx(4 * 134_515_008, rel=0.01)
    assert shape.num_layers == 30


def test_real_smollm2_gguf_through_the_cli_child(smollm2, tmp_path):
    """A directory holding one GGUF (as `kvserve agent fetch` lays it out): the agent asks
    `kvserve agent model-info`, which reads the metadata with the runtime's GGUF reader."""
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    os.symlink(smollm2.gguf, model_dir / smollm2.gguf.name)
    info = read_model_info(model_dir)
    assert (info["architecture"], info["num_layers"], info["num_attention_heads"], info["num_kv_heads"]) \
        == ("LlamaForCausalLM", 30, 9, 3)
    assert info["format"] == "gguf" and info["quantization"] == "gguf-Q4_1"
    assert 60e6 < info["weight_bytes"] < smollm2.gguf.stat().st_size
    ModelShape.from_hf_config(info["config"])

    bad = subprocess.run([KVSERVE, "agent", "model-info", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("kvserve agent model-info: ")


async def test_agent_reports_the_model_once_the_directory_holds_it(tmp_path, tiny_llama):
    import shutil
    import socket

    model_dir = tmp_path / "models" / "tiny"
    model_dir.parent.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = subprocess.Popen([KVSERVE, "agent", "serve", "--engine-url", "http://127.0.0.1:9", "--engine", "kvserve",
                              "--host", "127.0.0.1", "--port", str(port), "--interval", "0.2",
                              "--model-dir", str(model_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as http:
            async def signals():
                for _ in range(200):
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/v1/signals") as r:
                            return await r.json()
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
                raise AssertionError("agent did not answer")

            first = await signals()
            assert first["model"] is None and first["model_error"] is None  # nothing fetched yet
            # Whole, as fetch places it (the pod's fetch step even finishes before the agent starts).
            shutil.copytree(tiny_llama, tmp_path / "staging")
            os.rename(tmp_path / "staging", model_dir)
            for _ in range(200):
                data = await signals()
                if data["model"]:
                    break
                await asyncio.sleep(0.1)
            model = data["model"]
            assert model["architecture"] == "LlamaForCausalLM" and model["format"] == "safetensors"
            assert model["weight_bytes"] > 0 and model["config"]["num_attention_heads"] == model["num_attention_heads"]
    finally:
        agent.terminate()
        agent.wait(10)
