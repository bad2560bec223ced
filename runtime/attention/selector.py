"""Picks the attention backend by name: "torch" (anywhere), "triton" (CUDA), or "auto"."""

from __future__ import annotations

import torch

from kvserve.runtime.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def _triton_backend_class():
    from kvserve.kernels.attention_backend import TritonAttentionBackend

    return TritonAttentionBackend


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: unknown {name!r}; supported: {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        from kvserve.runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        try:
            cls = _triton_backend_class()
        except ImportError as exc:
            raise ValueError(f"attention_backend 'triton' is not available: {exc}; use 'torch' or 'auto'") from exc
        return cls()
    if device.type == "cuda":
        try:
            return _triton_backend_class()()
        except ImportError:
            pass
    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
