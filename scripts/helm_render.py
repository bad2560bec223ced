"""Render charts/kvserve with the real Helm engine (Helm's Go library through helm-sdkpy).

helm-sdkpy has no `template` call, so each render is a real `helm install` (release storage in
memory, HELM_DRIVER=memory) against a throw-away kmock Kubernetes API emulator that knows the
kinds the chart creates. What comes back is the release's rendered manifest and NOTES, exactly
as `helm template` would print them; values are checked against values.schema.json by Helm.

helm-sdkpy needs Python >= 3.12 while the project's .venv is 3.11, so this runs in its own
virtual environment, build/helm-venv:

    python scripts/helm_render.py --ensure-env          # create it (pyenv's 3.12 or python3.12)
    build/helm-venv/bin/python scripts/helm_render.py CASES.json   # render, JSON to stdout

CASES.json: {"name": {"release": "kvserve", "namespace": "kvserve-system", "values": {...}}}.
Output: {"name": {"manifest": "...", "notes": "..."}} or {"name": {"error": "..."}}.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvserve"
VENV = ROOT / "build" / "helm-venv"
REQUIREMENTS = ["helm-sdkpy==0.1.32", "kmock==0.8", "pyyaml"]

# (group/version/plural, kind, namespaced) for every kind the chart can create, plus Helm's own.
KINDS = [
    ("v1/configmaps", "ConfigMap", True), ("v1/secrets", "Secret", True),
    ("v1/serviceaccounts", "ServiceAccount", True), ("v1/services", "Service", True),
    ("v1/namespaces", "Namespace", False), ("apps/v1/deployments", "Deployment", True),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
    ("monitoring.coreos.com/v1/podmonitors", "PodMonitor", True),
    ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True),
    ("monitoring.coreos.com/v1/prometheusrules", "PrometheusRule", True),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True),
]
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def python312() -> str | None:
    """A Python >= 3.12 interpreter: $KVSERVE_PYTHON312, pyenv's 3.12.x, or python3.12/3.13."""
    if os.environ.get("KVSERVE_PYTHON312"):
        return os.environ["KVSERVE_PYTHON312"]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for pattern in ("3.12*", "3.13*"):
        found = sorted(glob.glob(os.path.join(root, "versions", pattern, "bin", "python")))
        if found:
            return found[-1]
    return shutil.which("python3.12") or shutil.which("python3.13")


def venv_python() -> Path:
    return VENV / "bin" / "python"


def env_ready() -> bool:
    py = venv_python()
    return py.exists() and subprocess.run(
        [str(py), "-c", "import helm_sdkpy, kmock, yaml"], capture_output=True).returncode == 0


def ensure_env() -> Path:
    """Create build/helm-venv with helm-sdkpy and kmock unless it already works."""
    if env_ready():
        return venv_python()
    py = python312()
    if not py:
        raise RuntimeError("helm-sdkpy needs Python >= 3.12 and none was found "
                           "(set KVSERVE_PYTHON312 or install python3.12)")
    subprocess.run([py, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(venv_python()), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    return venv_python()


async def _render_one(case: dict) -> dict:
    import helm_sdkpy
    import kmock
    import yaml
    from kmock._internal import apps

    class Emulator(kmock.KubernetesEmulator):
        # kmock 0.8 answers core discovery with groupVersion "/v1"; Helm's REST mapper wants "v1".
        async def _serve_version(self, request):
            out = await super()._serve_version(request)
            if request.resource.group == "":
                out["groupVersion"] = "v1"
            return out

    async with Emulator() as emu, apps.Server(emu) as srv:
        for resource, kind, namespaced in KINDS:
            emu.resources[resource] = dict(kind=kind, namespaced=namespaced, verbs=VERBS)
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": str(srv.url).rstrip("/")}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [{"name": "emulator",
                          "context": {"cluster": "emulator", "user": "emulator"}}],
        }
        config = helm_sdkpy.Configuration(namespace=case.get("namespace", "kvserve-system"),
                                          kubeconfig=yaml.safe_dump(kubeconfig))
        try:
            release = await helm_sdkpy.Install(config).run(
                case.get("release", "kvserve"), str(CHART), values=case.get("values") or None,
                wait=False, timeout=60)
        except helm_sdkpy.HelmError as e:
            return {"error": str(e)}
        return {"manifest": release.get("manifest", ""),
                "notes": (release.get("info") or {}).get("notes", "")}


def render(cases: dict) -> dict:
    import asyncio

    if os.environ.get("HELM_DRIVER") != "memory":
        # Helm's Go code reads the variable when the library loads: re-exec with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "HELM_DRIVER": "memory"})
    return {name: asyncio.run(_render_one(case)) for name, case in cases.items()}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--ensure-env"]:
        print(ensure_env())
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    cases = json.loads(Path(argv[0]).read_text())
    json.dump(render(cases), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
