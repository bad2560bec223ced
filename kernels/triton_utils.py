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
import itertools
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


class InterpreterUnavailable(RuntimeError):
    """Triton's interpreter cannot run kernels with the installed Triton and NumPy."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run our kernels here, or None when it can.

    Triton 3.6's interpreter converts a loop bound (a 1-element array there) with int(), which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"; 1.25 to 2.3
    warned); Triton 3.7 squeezes the array first. Every kernel whose loop bounds are loaded values
    hits it."""
    import numpy
    import triton

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run with NumPy {numpy.__version__} (it calls "
                "int() on 1-element arrays, an error since NumPy 2.4): CPU interpretation of the kernels needs "
                "triton >= 3.7 or numpy < 2.4")
    return None


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


def _language_namespaces() -> tuple[list[dict], list[type]]:
    """What Triton's interpreter patches while it runs a kernel: the triton.language modules'
    namespaces (builtins such as tl.core.cast are swapped for numpy versions) and the classes whose
    methods it replaces (tensor, dtype, tensor descriptors)."""
    import sys

    import triton.language as tl

    modules = [vars(m) for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    classes = [c for c in vars(tl.core).values() if isinstance(c, type) and c.__module__ == tl.core.__name__]
    return modules, classes


@contextlib.contextmanager
def _restored_language():
    """Puts triton.language back exactly as it was once an interpreted launch returns.

    The interpreter undoes the patches of a launch, but not those it makes when an interpreted
    kernel calls another jit function (tl.max, tl.sum, a helper of ours): those stay, in Triton
    3.6 to 3.9 at least, so tl.core's builtins are left pointing at the numpy interpreter. Triton
    3.6's compiler then fails every later compile in the process ("'ir.value' object has no
    attribute 'dtype'"), which broke the CUDA kernel tests that ran after an interpreted one.
    Names the interpreter only adds to a module (its own globals, which the rewritten helpers it
    caches look up) are left: they shadow nothing."""
    modules, classes = _language_namespaces()
    module_state = [(ns, dict(ns)) for ns in modules]
    class_state = [(cls, dict(vars(cls))) for cls in classes]
    try:
        yield
    finally:
        for ns, before in module_state:
            for name, value in before.items():
                if ns.get(name, _MISSING) is not value:
                    ns[name] = value
        for cls, before in class_state:
            now = vars(cls)
            for name in [n for n in now if n not in before]:
                delattr(cls, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(cls, name, value)


_MISSING = object()


class _InterpretedLauncher:
    def __init__(self, kernel):
        self._kernel = _interpreted_version(kernel)
        self._globals = getattr(getattr(kernel, "fn", None), "__globals__", None)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _restored_language(), _interpretable_stdlib(self._globals):
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
    problem = interpreter_problem()
    if problem:
        raise InterpreterUnavailable(problem)
    return _InterpretedLauncher(kernel)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # float32 attention must stay float32: Triton's default would round dot inputs to TF32.
    return "ieee" if dtype == torch.float32 else "tf32"
