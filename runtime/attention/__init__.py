"""Attention backends: how a layer writes new K/V into the paged cache and attends over it."""

from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.runtime.attention.selector import get_attention_backend
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
