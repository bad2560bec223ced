"""The kernel tests run the Triton kernels compiled on a GPU when there is one (the `device`
fixture), else on CPU under Triton's interpreter, and every buffer a kernel allocates starts as NaN
so that an element it forgets to write shows up. The few tests that interpret on CPU tensors
whatever the machine are skipped, with the reason, where the installed Triton's interpreter
cannot run (tests/conftest.py's pytest_pyfunc_call)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(autouse=True)
def _nan_poisoned_allocations(monkeypatch):
    """Every float buffer the kernels allocate (outputs, split partials) starts as NaN, so an
    element a kernel forgets to write shows up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests run their kernels: compiled on a GPU when one is present, else on
    the CPU under the interpreter. Inputs are built on the CPU (seeded) and moved here, and the
    twins run on the same device."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
