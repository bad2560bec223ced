"""The container image's recipe against the code and manifests it must agree with.

No Docker engine runs here or on CI, so the image itself is never built in tests. What can be
checked is checked for real: the wheel that the Dockerfile's first stage builds (`pip wheel .`,
the same command) holds every module of the three code folders and both console scripts, and the
Dockerfile's user, ports, cache variables and torch pin agree with the operator's manifests, the
kustomize base, the Helm chart and the Makefile.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from kvserve.operator import cli as operator_cli
from kvserve.operator import manifests as M

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
FOLDERS = {"runtime": "kvserve/runtime", "kernels": "kvserve/kernels", "operator": "kvserve/operator"}


def instructions(keyword: str) -> list[str]:
    """Arguments of every `KEYWORD ...` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(keyword + " ")]


def test_the_image_copies_exactly_the_folders_setup_py_packages():
    copied = {src for args in instructions("COPY") if "--from" not in args for src in args.split()[:-1]}
    assert copied == {"pyproject.toml", "setup.py", "README.md", *FOLDERS}


def test_dockerignore_lets_every_copied_path_through():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"  # everything else is opt-in, so .venv, build/ and .git never ship
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert {"pyproject.toml", "setup.py", "README.md", *FOLDERS} <= allowed


def test_image_user_matches_every_security_context():
    (user,) = instructions("USER")
    uid, gid = (int(x) for x in user.split(":"))
    assert uid == gid == M.NONROOT_UID
    assert f"--uid {uid}" in DOCKERFILE and f"--gid {gid}" in DOCKERFILE  # a named user, not a bare uid
    deployment = yaml.safe_load((ROOT / "manifests" / "base" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsUser"] == pod["runAsGroup"] == uid
    chart = (ROOT / "charts" / "kvserve" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {uid}" in chart and f"runAsGroup: {uid}" in chart


def test_image_exposes_every_port_the_manifests_use():
    exposed = {int(p) for args in instructions("EXPOSE") for p in args.split()}
    liveness_port = int(operator_cli.build_parser().parse_args(["run"]).liveness.rsplit(":", 1)[1].split("/")[0])
    assert exposed == {M.RUNTIME_PORT, M.AGENT_PORT, operator_cli.METRICS_PORT, liveness_port}


def test_image_cache_variables_are_the_ones_the_operator_sets():
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(instructions("ENV"))))
    for var in M._cache_env():
        if var["name"] != "HF_HOME":  # per pod: under the models volume
            assert env[var["name"]] == var["value"], var["name"]


def test_torch_pin_is_the_makefiles():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M).group(1)
    assert f"ARG TORCH_VERSION={pin}" in DOCKERFILE


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # The Dockerfile's first stage, build isolation included (as `make install` does, it fetches
    # pyproject's setuptools).
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--wheel-dir", str(out), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("kvserve-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_every_tracked_module(wheel):
    tracked = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    names = set(wheel.namelist())
    expected = {FOLDERS[p.split("/", 1)[0]] + "/" + p.split("/", 1)[1] for p in tracked}
    assert expected - names == set()
    # No top-level `operator` (the standard library's name) and nothing outside kvserve/.
    assert all(n.startswith(("kvserve/", "kvserve-")) for n in names), sorted(names)


def test_wheel_declares_both_console_scripts(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"kvserve": "kvserve.runtime.cli:main",
                                                "kvserve-operator": "kvserve.operator.cli:main"}
