"""An interpreted launch leaves triton.language as it found it, so that kernels compiled later in the
same process (a GPU machine runs both kinds in one pytest worker) see the real language.

Triton's interpreter patches triton.language while it runs a kernel; it undoes the patches of the
launch itself, but not those made when the kernel calls another jit function (tl.max, tl.sum), and
with Triton 3.6 every later compile then failed ("'ir.value' object has no attribute 'dtype'").
The compile check needs no GPU: Triton compiles for a named target (sm_90 here) on any machine.
"""

from __future__ import annotations

import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kvserve.kernels import layers  # noqa: E402
from kvserve.kernels.attention import paged_prefill_attention  # noqa: E402
from kvserve.kernels.triton_utils import InterpreterUnavailable, interpreter_problem, kernel_for  # noqa: E402


def _language_state():
    import triton.language as tl

    modules = {name: dict(vars(m)) for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))}
    classes = {c.__qualname__: dict(vars(c)) for c in vars(tl.core).values()
               if isinstance(c, type) and c.__module__ == tl.core.__name__}
    return modules, classes


def _interpreted_launches():
    """A layer kernel (calls tl.sum) and prefill attention (tl.max, tl.sum), on CPU tensors."""
    x = torch.randn(3, 64)
    layers.rms_norm(x, torch.ones(64), 1e-6)
    cache = torch.randn(3, 16, 1, 16)
    paged_prefill_attention(torch.randn(5, 2, 16), cache, cache.clone(), torch.tensor([0, 5], dtype=torch.int32),
                            torch.tensor([20], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32), 0.25)


@pytest.fixture
def _needs_the_interpreter():
    if interpreter_problem():
        pytest.skip(interpreter_problem())


@pytest.mark.usefixtures("_needs_the_interpreter")
def test_an_interpreted_launch_leaves_triton_language_exactly_as_it_found_it():
    from triton.runtime import interpreter

    modules, classes = _language_state()
    _interpreted_launches()
    modules_after, classes_after = _language_state()
    for name, before in modules.items():
        after = modules_after[name]
        changed = sorted(k for k, v in before.items() if after.get(k) is not v)
        assert not changed, f"{name}: {changed} left patched by the interpreter"
        # The interpreter adds its own globals to the modules of the jit functions it rewrites
        # (its cached rewrites look them up there), and a first import adds a package's submodule:
        # neither shadows anything that was there.
        added = {k for k in set(after) - set(before)
                 if k not in vars(interpreter) and getattr(after[k], "__name__", None) != f"{name}.{k}"}
        assert not added, f"{name}: {sorted(added)} added"
    assert classes_after == classes


def _compile_for_hopper(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature={"X": "*bf16", "OUT": "*bf16", "stride_x": "i32", "stride_o": "i32",
                                          "N": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.mark.usefixtures("_needs_the_interpreter")
def test_kernels_still_compile_for_hopper_after_an_interpreted_launch(monkeypatch, tmp_path):
    # Compile for real each time, not from Triton's cache.
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = layers._silu_and_mul_kernel
    if not isinstance(kernel, triton.runtime.jit.JITFunction) or type(kernel).__name__ == "InterpretedFunction":
        pytest.skip("the kernels were decorated under TRITON_INTERPRET=1: there is nothing compiled to check")
    try:
        _compile_for_hopper(kernel)
    except Exception as e:  # no CUDA backend or ptxas in this Triton build
        pytest.skip(f"Triton cannot compile for sm_90 here: {e!r:.200}")
    _interpreted_launches()
    assert "ptx" in _compile_for_hopper(kernel).asm


def test_cuda_tensors_get_the_compiled_kernel_and_cpu_tensors_an_interpreted_copy():
    kernel = layers._silu_and_mul_kernel
    assert kernel_for(kernel, torch.device("cuda")) is kernel
    if interpreter_problem():
        with pytest.raises(InterpreterUnavailable, match="triton >= 3.7"):
            kernel_for(kernel, torch.device("cpu"))
    else:
        assert kernel_for(kernel, torch.device("cpu")) is not kernel
