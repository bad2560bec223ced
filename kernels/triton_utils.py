"""Whether Triton is usable, and which form of a kernel to launch for a given device.

Triton decides at decoration time whether a ``@triton.jit`` function is compiled or interpreted
(from ``TRITON_INTERPRET``). Test modules may be imported in any order, so the choice is made
again at launch: CUDA tensors get the compiled kernel; CPU tensors get an interpreted copy of the
same Python function, but only when ``TRITON_INTERPRET=1`` is set, because the interpreter is
orders of magnitude slower and should never be picked up by accident.
"""

from __future__ import annotations

import contextlib
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


def _interpreted_version(fn):
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(fn, InterpretedFunction):
        return fn
    wrapped = _interpreted.get(id(fn))
    if wrapped is None:
        wrapped = _interpreted[id(fn)] = InterpretedFunction(fn.fn)
    return wrapped


@contextlib.contextmanager
def _interpretable_stdlib(kernel_globals: dict | None = None):
    """Swaps triton.language's own jit helpers (tl.sum, tl.max, tl.zeros, ...), and the jit
    helpers of the kernel's own module, for interpreted copies while a kernel is interpreted: when
    they were decorated without TRITON_INTERPRET they are compiled-only functions, which the
    interpreter cannot call."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    namespaces = [vars(tl), vars(standard)] + ([kernel_globals] if kernel_globals is not None else [])
    saved = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction):
                saved.append((namespace, name, value))
                namespace[name] = _interpreted_version(value)
    try:
        yield
    finally:
        for namespace, name, value in saved:
            namespace[name] = value


class _InterpretedLauncher:
    def __init__(self, kernel):
        self._kernel = _interpreted_version(kernel)
        self._globals = getattr(getattr(kernel, "fn", None), "__globals__", None)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpretable_stdlib(self._globals):
                return self._kernel[grid](*args, **kwargs)

        return launch


def kernel_for(kernel, device: torch.device):
    """The launchable form of ``kernel`` (a ``@triton.jit`` function) for tensors on ``device``:
    ``kernel_for(k, dev)[grid](*args, **meta)``."""
    if device.type == "cuda":
        return kernel
    if not interpret_enabled():
        raise RuntimeError(
            f"Triton kernels need CUDA tensors; got tensors on {device.type}. To run them on CPU "
            "(slowly, for testing) set TRITON_INTERPRET=1, or use the torch kernels "
            "(kvserve.kernels.ops.set_kernel_mode('torch') or KVSERVE_KERNELS=torch)."
        )
    return _InterpretedLauncher(kernel)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # float32 attention must stay float32: Triton's default would round dot inputs to TF32.
    return "ieee" if dtype == torch.float32 else "tf32"
