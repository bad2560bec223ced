"""Prepare a run of kvserve's GPU checks on a machine that has a GPU but no network and no kvserve.

Such a machine brings its own torch and Triton (versions that may differ from CI's) and nothing
else of ours. Three steps:

    python scripts/gpu_prepare.py prepare [--out build/gpu] [--python-version 3.12]
        here, with access to a package index: downloads, as wheels, every package the runtime
        and the tests import except torch, Triton and the NVIDIA libraries (the exact versions
        installed in this environment, dependencies included, so the set is closed), writes an
        import shim that makes ``kvserve`` importable from the working tree without installing
        it, and prints the commands below.
    python scripts/gpu_prepare.py install [--out build/gpu]
        there, offline: installs into OUT/site the wheels of the distributions the machine does
        not already have (its own torch, numpy, ... are kept), with pip --no-index --no-deps.
    python scripts/gpu_prepare.py commands [--out build/gpu]
        prints the ordered checks (docs/dev/GPU.md says why each comes where it does).

The shim is OUT/pythonpath/kvserve/__init__.py, whose ``__path__`` is the repository root: the
same mapping as setup.py's package_dir (kvserve.runtime -> runtime/, kvserve.kernels -> kernels/,
kvserve.operator -> operator/, kvserve.testing -> testing/), found through PYTHONPATH, with the
repository root itself never on sys.path (so operator/ never shadows the standard library).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The machine's own: the versions a GPU check is about, and gigabytes we must not ship.
NEVER_SHIPPED = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*|cuda-.*)$")
# Operator-only dependencies: no GPU check imports them.
OPERATOR_ONLY = {"kopf", "kubernetes-asyncio"}
# What the GPU checks need besides the runtime: pytest and the plugins conftest and pyproject use.
TEST_ROOTS = ["pytest", "pytest-timeout", "pytest-asyncio", "hypothesis"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def runtime_roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The runtime's direct dependencies (pyproject's [project] dependencies), by name."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [n for n in (_requirement_name(d) for d in deps) if n not in OPERATOR_ONLY]


def _marker_applies(req: str, python_version: str) -> bool:
    """Whether a Requires-Dist line applies without extras on the target (Linux x86-64, CPython
    `python_version`). Lines without a marker always do."""
    if ";" not in req:
        return True
    from packaging.requirements import Requirement

    marker = Requirement(req).marker
    env = {"python_version": python_version, "python_full_version": python_version + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}
    return marker is None or marker.evaluate(env)


def closure(roots: Iterable[str], requires: Callable[[str], list[str] | None], *,
            python_version: str) -> list[str]:
    """Every distribution reachable from `roots` through `requires` (a distribution's
    Requires-Dist lines, None if it is not installed), skipping NEVER_SHIPPED ones and their
    branches. Sorted canonical names."""
    seen: set[str] = set()
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or NEVER_SHIPPED.match(name):
            continue
        reqs = requires(name)
        if reqs is None:
            raise SystemExit(f"{name} is needed but not installed here: run `make install` first")
        seen.add(name)
        todo += [_requirement_name(r) for r in reqs if _marker_applies(r, python_version)]
    return sorted(seen)


def _installed_requires(name: str) -> list[str] | None:
    try:
        return metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return None


def write_shim(out: Path) -> Path:
    """OUT/pythonpath/kvserve/__init__.py: kvserve's children are the repository root's folders."""
    pkg = out / "pythonpath" / "kvserve"
    pkg.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(ROOT, pkg)
    (pkg / "__init__.py").write_text(
        '"""kvserve from a working tree, not installed (written by scripts/gpu_prepare.py): its\n'
        "subpackages are the repository root's folders, as setup.py's package_dir maps them.\"\"\"\n\n"
        "import os as _os\n\n"
        f"__path__ = [_os.path.normpath(_os.path.join(_os.path.dirname(__file__), {rel!r}))]\n")
    return out / "pythonpath"


def prepare(args) -> int:
    out = args.out
    names = closure(runtime_roots() + TEST_ROOTS, _installed_requires, python_version=args.python_version)
    pins = [f"{n}=={metadata.version(n)}" for n in names]
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    (out / "requirements.txt").write_text("".join(p + "\n" for p in pins))
    pythonpath = write_shim(out)
    if not args.no_download:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheels),
               "--python-version", args.python_version, "--implementation", "cp",
               *[f"--platform={p}" for p in args.platform], *pins]
        print("+", " ".join(cmd[:12]), f"... ({len(pins)} pinned distributions)", flush=True)
        subprocess.run(cmd, check=True)
        size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
        print(f"{len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {wheels}")
    print(f"import shim: {pythonpath}/kvserve/__init__.py\n")
    print_commands(out)
    return 0


def _wheel_distribution(wheel: Path) -> str:
    return canonical(wheel.name.split("-", 1)[0])


def wheels_to_install(wheels: Iterable[Path], have: Callable[[str], bool]) -> list[Path]:
    """The wheels whose distribution the machine does not have (its own versions win)."""
    return sorted(w for w in wheels if not have(_wheel_distribution(w)))


def _have(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def install(args) -> int:
    out = args.out
    todo = wheels_to_install((out / "wheels").glob("*.whl"), _have)
    if todo:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(out / "site"),
               "--upgrade", *map(str, todo)]
        subprocess.run(cmd, check=True)
    print(f"installed {len(todo)} wheels into {out / 'site'}; the machine's own kept for the others")
    print(f"export PYTHONPATH={out.resolve() / 'pythonpath'}:{out.resolve() / 'site'}")
    return 0


def commands(out: Path) -> list[str]:
    """The ordered GPU checks, from the repository root (docs/dev/GPU.md explains each)."""
    env = f"PYTHONPATH={out}/pythonpath:{out}/site"
    py = f"{env} python"
    return [
        f"python scripts/gpu_prepare.py install --out {out}",
        f"{py} -c 'import torch, triton, kvserve.runtime; print(torch.__version__, triton.__version__, "
        "torch.cuda.get_device_name())'",
        f"{py} -m pytest -x -q -p no:cacheprovider tests/kernels",
        f"{py} -m pytest -x -q -p no:cacheprovider -m gpu tests",
        f"{py} -m pytest -x -q -p no:cacheprovider tests/test_executor.py tests/test_quant_kernel_choice.py",
        f"{py} bench/kernel_timings.py --quick",
        f"{py} bench/kernel_sweep.py --out bench/results/kernel_sweep.json",
        f"{py} bench/gpu_fastpath.py --quick",
    ]


def print_commands(out: Path) -> None:
    print("On the GPU machine, from the repository root, in this order:")
    for i, line in enumerate(commands(out), 1):
        print(f"  {i}. {line}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["prepare", "install", "commands"])
    p.add_argument("--out", type=Path, default=Path("build/gpu"), help="where wheels, shim and site go")
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU machine's Python (binary wheels are per version)")
    p.add_argument("--platform", action="append", default=None,
                   help="wheel platform tags to accept (default: manylinux x86-64 tags and any)")
    p.add_argument("--no-download", action="store_true", help="write the shim and the pins only")
    args = p.parse_args(argv)
    args.platform = args.platform or ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                      "linux_x86_64", "any"]
    if args.step == "prepare":
        return prepare(args)
    if args.step == "install":
        return install(args)
    print_commands(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
