"""Our own torch implementations of supported Hugging Face decoder-only models."""

from kvserve.runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.runtime.models.llama import CausalLM
from kvserve.runtime.models.loader import load_model

__all__ = ["CausalLM", "ModelConfig", "SUPPORTED_ARCHITECTURES", "load_model"]
