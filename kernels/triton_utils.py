"""Whether Triton is usable, and which form of a kernel to launch for a given device.

Triton decides at decoration time whether a ``@triton.jit`` function is compiled or interpreted
(from ``TRITON_INTERPRET``). Test modules may be imported in any order, so the choice is made
again at launch: CUDA tensors get the compiled kernel; CPU tensors get an interpreted copy of the
same Python function, but only when ``TRITON_INTERPRET=1`` is set, because the interpreter is
orders of magnitude slower and should never be picked up by accident.
"""

from __future__ import annotations

import functools
import os

import torch

_TRUE = {"1", "true", "yes", "on"}


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (it may still have no GPU driver to launch on)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


_interpreted: dict[int, object] = {}


def kernel_for(kernel, device: torch.device):
    """The launchable form of ``kernel`` (a ``@triton.jit`` function) for tensors on ``device``."""
    if device.type == "cuda":
        return kernel
    if not interpret_enabled():
        raise RuntimeError(
            f"Triton kernels need CUDA tensors; got tensors on {device.type}. To run them on CPU "
            "(slowly, for testing) set TRITON_INTERPRET=1, or use the torch kernels "
            "(kvserve.kernels.ops.set_kernel_mode('torch') or KVSERVE_KERNELS=torch)."
        )
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    wrapped = _interpreted.get(id(kernel))
    if wrapped is None:
        wrapped = _interpreted[id(kernel)] = InterpretedFunction(kernel.fn)
    return wrapped


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # float32 attention must stay float32: Triton's default would round dot inputs to TF32.
    return "ieee" if dtype == torch.float32 else "tf32"
