"""Picks the attention backend by name: "torch" (anywhere), "triton" (CUDA), or "auto" (the
device's Platform decides: runtime/executor/platform.py)."""

from __future__ import annotations

import torch

from kvserve.runtime.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def _triton_backend_class():
    from kvserve.runtime.attention.triton_backend import TritonAttentionBackend

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
    from kvserve.runtime.executor.platform import platform_for

    # "auto": the device's platform knows which kernels serve it.
    return get_attention_backend(platform_for(device).attention_backend_name(name), device)
