"""Attention backends: how a layer writes new K/V into the paged cache and attends over it."""

from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
