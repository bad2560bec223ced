"""Which model families kvserve runs, and the per-family rules that more than one reader needs.

Pure (no torch): the runtime's ModelConfig and the capacity model that the operator imports both
take their answers from here, so they agree on a config they both read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MISTRAL_BIAS_RULE = ("MistralForCausalLM", "MixtralForCausalLM")

# A config written by hand (an operator spec's model.config) may give only model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM"}


def architecture_of(config: Mapping[str, Any]) -> str:
    """The first supported entry of ``architectures``; else its first entry; else the family of
    ``model_type``; else ""."""
    listed = list(config.get("architectures") or [])
    supported = next((a for a in listed if a in SUPPORTED_ARCHITECTURES), None)
    if supported is not None:
        return supported
    if listed:
        return str(listed[0])
    return _BY_MODEL_TYPE.get(str(config.get("model_type") or ""), "")


def attention_biases(arch: str, config: Mapping[str, Any]) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, o_proj has one), as transformers builds each family:
    Qwen2 always biases q/k/v and never o_proj; Qwen2-MoE the same unless ``qkv_bias`` is false;
    Mistral and Mixtral ignore ``attention_bias``; the others bias all four with it."""
    attention_bias = bool(config.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        return True, False
    if arch == "Qwen2MoeForCausalLM":
        return bool(config.get("qkv_bias", True)), False
    if arch in _MISTRAL_BIAS_RULE:
        return False, False
    return attention_bias, attention_bias
