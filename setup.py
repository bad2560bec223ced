"""Maps the three top-level code folders into the one `kvserve` import namespace.

`kvserve` is an implicit namespace package and `operator/` has no `__init__.py`, so that running
Python from the repository root never shadows the standard library's `operator` module.
"""

from pathlib import Path

from setuptools import find_packages, setup

FOLDERS = {"runtime": "kvserve.runtime", "kernels": "kvserve.kernels", "operator": "kvserve.operator"}
# What tests, bench/ and scripts/ share (tiny models, the real model): a checkout's, not the image's.
if (Path(__file__).resolve().parent / "testing" / "__init__.py").is_file():
    FOLDERS["testing"] = "kvserve.testing"

package_dir = {}
packages = []
for folder, name in FOLDERS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(package_dir=package_dir, packages=packages)
