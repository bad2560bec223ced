"""The layer operations that the model code calls: the one place that picks Triton or torch.

Model code calls these functions and never a kernel directly, so the engine can run the Triton
kernels on CUDA, the native C kernels (kernels/cpu) on float32 CPU tensors, and the pure-torch
twins everywhere else (or be forced either way for tests). The twins follow Hugging Face's
numerics (norms in float32, cast back) so that the torch path matches transformers token for
token; the native kernels compute the same expressions in the same order except for the order of
the sums inside a norm (rotary is bit-identical).

Mode (``set_kernel_mode`` or the ``KVSERVE_KERNELS`` environment variable; the call wins):
  - ``auto`` (default): Triton for CUDA tensors when triton imports, the native kernels for
    float32 CPU tensors when they build (``KVSERVE_CPU_KERNELS=0`` turns them off), torch otherwise;
  - ``torch``: always the twins;
  - ``triton``: always the kernels (CPU tensors then need TRITON_INTERPRET=1);
  - ``native``: the native CPU kernels wherever they apply (float32 CPU tensors), the twins elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from kvserve.kernels import reference
from kvserve.kernels.triton_utils import triton_available

KERNEL_MODES = ("auto", "torch", "triton", "native")
ENV_VAR = "KVSERVE_KERNELS"

_mode_override: str | None = None


def _validate(mode: str, source: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{source}: unknown kernel mode {mode!r}; expected one of {', '.join(KERNEL_MODES)}")
    return mode


def set_kernel_mode(mode: str | None) -> None:
    """Forces "torch" or "triton", or "auto"; None goes back to the KVSERVE_KERNELS variable."""
    global _mode_override
    _mode_override = None if mode is None else _validate(mode, "set_kernel_mode")


def get_kernel_mode() -> str:
    if _mode_override is not None:
        return _mode_override
    return _validate(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """Runs a block under one kernel mode and restores the previous setting afterwards."""
    global _mode_override
    previous = _mode_override
    set_kernel_mode(mode)
    try:
        yield
    finally:
        _mode_override = previous


def use_triton(t: torch.Tensor) -> bool:
    """Whether the ops called on tensor ``t`` go to the Triton kernels under the current mode."""
    mode = get_kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError(f"kernel mode 'triton' was requested ({ENV_VAR} or set_kernel_mode) "
                               "but triton cannot be imported; install kvserve[triton] or use 'torch'")
        return True
    return t.is_cuda and triton_available()


def use_native(t: torch.Tensor) -> bool:
    """Whether the ops called on tensor ``t`` go to the native CPU kernels under the current mode."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return False
    mode = get_kernel_mode()
    if mode not in ("auto", "native"):
        return False
    from kvserve.kernels.cpu import native

    if mode == "native" and not native.available():
        raise RuntimeError(f"kernel mode 'native' was requested but the native CPU kernels are unavailable: "
                           f"{native.status()}")
    return native.available()


def _native():
    from kvserve.kernels.cpu import native

    return native


def _layers():
    from kvserve.kernels import layers  # imports triton: only on the Triton path

    return layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and cast back to x's dtype."""
    if use_triton(x):
        return _layers().rms_norm(x, weight, eps)
    if use_native(x) and weight.dtype == torch.float32:
        return _native().rms_norm(x, weight, eps)
    return reference.rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the pre-norm residual stream in one pass."""
    if use_triton(x):
        return _layers().fused_add_rms_norm(x, residual, weight, eps)
    if use_native(x) and residual.dtype == weight.dtype == torch.float32:
        return _native().fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm_ref(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32, cast back once."""
    if use_triton(x):
        return _layers().gemma_rms_norm(x, weight, eps)
    return reference.gemma_rms_norm_ref(x, weight, eps)


def gemma_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (gemma_rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        return _layers().gemma_fused_add_rms_norm(x, residual, weight, eps)
    return reference.gemma_fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,  # int64 [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX style, as HF Llama does) rotary embedding on the first rotary_dim dims.

    Scaling schemes (linear, llama3, ...) are folded into the precomputed cos/sin table.
    """
    if use_triton(query):
        return _layers().rotary_embedding(positions, query, key, cos_sin_cache)
    if use_native(query) and _native().rotary_supported(query, key, cos_sin_cache):
        return _native().rotary_embedding(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding_ref(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension (the fused gate_up output)."""
    if use_triton(x):
        return _layers().silu_and_mul(x)
    if use_native(x):
        return _native().silu_and_mul(x)
    return reference.silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] (Gemma's MLP)."""
    if use_triton(x):
        return _layers().gelu_tanh_and_mul(x)
    return reference.gelu_tanh_and_mul_ref(x)


# The torch twins under their original names, for callers that reach for them directly.
_rms_norm_torch = reference.rms_norm_ref
_rotary_torch = reference.rotary_ref


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of one MoE layer for tokens x [T, H]: each token's top-k experts
    (w13 [E, 2I, H] gate|up, w2 [E, H, I]) weighted by topk_weights and summed. Triton: tokens
    sorted by expert and two grouped GEMMs (kernels.moe); torch: one matmul pair per expert."""
    if use_triton(x):
        from kvserve.kernels.moe import fused_moe as fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return reference.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def lora_sgmv(x: torch.Tensor, out: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, batch) -> torch.Tensor:
    """Adds the step's LoRA products to `out` in place (runtime/lora/layers.py's LoRABatch says
    which tokens use which slot): Triton's segmented shrink/expand kernels (kernels.lora) on CUDA,
    grouped torch matmuls on sorted segments elsewhere (kernels.reference.lora_sgmv_ref)."""
    if use_triton(x):
        from kvserve.kernels.lora import lora_sgmv as lora_sgmv_triton

        return lora_sgmv_triton(x, out, a_t, b_t, batch.token_idx, batch.seg_slot, batch.seg_start,
                                batch.seg_len, batch.max_seg_len)
    if a_t.dtype != x.dtype:
        # lora_dtype other than the model's: the products in the adapters' dtype (as PEFT computes
        # an adapter of another dtype), added to the model's output.
        delta = torch.zeros(out.shape, dtype=a_t.dtype, device=out.device)
        reference.lora_sgmv_ref(x.to(a_t.dtype), delta, a_t, b_t, batch.segments, batch.perm, batch.cols,
                                batch.padded, batch.out_parts)
        return out.add_(delta)
    return reference.lora_sgmv_ref(x, out, a_t, b_t, batch.segments, batch.perm, batch.cols, batch.padded,
                                   batch.out_parts)
