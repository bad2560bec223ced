"""scripts/gpu_prepare.py: the wheel set is the closed dependency set of the runtime and the test
tools minus torch/Triton/NVIDIA (the GPU machine's own), the import shim maps kvserve onto the
working tree as setup.py does (checked in a Python without site-packages), and install keeps
what the machine already has."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_prepare", ROOT / "scripts" / "gpu_prepare.py")
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)

REQUIRES = {
    "transformers": ["numpy>=1.17", "tokenizers<0.24", "torch>=2.6; extra == 'torch'"],
    "xgrammar": ["torch>=1.10.0", "numpy", 'triton; platform_system == "Linux"', "pydantic"],
    "pydantic": ["pydantic-core==2.50.5", "tomli; python_version < '3.11'"],
    "numpy": [], "tokenizers": ["huggingface_hub"], "huggingface-hub": [], "pydantic-core": [],
    "torch": ["sympy"], "sympy": [],
}


def test_the_wheel_set_is_closed_and_leaves_the_machines_torch_alone():
    got = gp.closure(["transformers", "xgrammar", "torch"], REQUIRES.get, python_version="3.12")
    assert got == ["huggingface-hub", "numpy", "pydantic", "pydantic-core", "tokenizers", "transformers", "xgrammar"]
    with pytest.raises(SystemExit, match="missing-thing is needed"):
        gp.closure(["missing_thing"], REQUIRES.get, python_version="3.12")
    roots = gp.runtime_roots()
    assert "transformers" in roots and "xgrammar" in roots and "kopf" not in roots


def test_install_keeps_what_the_machine_has(tmp_path):
    wheels = [tmp_path / "numpy-2.1.0-cp312-cp312-manylinux_2_17_x86_64.whl",
              tmp_path / "typing_extensions-4.16.0-py3-none-any.whl",
              tmp_path / "pytest_timeout-2.3.1-py3-none-any.whl"]
    have = {"numpy", "typing-extensions"}
    assert gp.wheels_to_install(wheels, have.__contains__) == [wheels[2]]


def test_the_shim_maps_kvserve_onto_the_working_tree(tmp_path):
    path = gp.write_shim(tmp_path)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kvserve.runtime.capacity as c, operator; "
            "print(c.__file__); print(operator.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(path)], capture_output=True, text=True, check=True)
    capacity, operator_file = out.stdout.split()
    assert Path(capacity) == ROOT / "runtime" / "capacity" / "__init__.py"
    assert not Path(operator_file).is_relative_to(ROOT)  # the standard library's, never operator/


def test_the_checks_run_tests_before_benchmarks():
    lines = gp.commands(Path("build/gpu"))
    assert "install" in lines[0]
    kernels = next(i for i, line in enumerate(lines) if "tests/kernels" in line)
    bench = next(i for i, line in enumerate(lines) if "bench/" in line)
    assert kernels < bench
