"""The per-pod admin token as the operator renders it, run for real: the pod template's own
commands and env (the admin-token init step, the agent, the preStop hook) as processes on
127.0.0.1, the token directory re-rooted under tmp_path, and a stub engine standing in for the
runtime that accepts /drain only with the pod's token."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from kvserve.operator import manifests as M
from kvserve.operator.spec import parse_spec

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "crds" / "examples" / "tiny-cpu.yaml"
KVSERVE = str(Path(sys.executable).with_name("kvserve"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rerooted(items: list[str], root: Path) -> list[str]:
    return [i.replace(M.ADMIN_DIR, str(root)) for i in items]


def container_env(container: dict, root: Path, home: Path) -> dict[str, str]:
    """The container's plain env, its token directory re-rooted at `root` and its caches under
    `home`, over a minimal process env; no secretKeyRef here."""
    out = {"PATH": os.environ.get("PATH", "")}
    for e in container["env"]:
        assert "valueFrom" not in e, e  # no Secret in this pod: the token is the credential
        out[e["name"]] = e["value"].replace(M.ADMIN_DIR, str(root))
    for cache in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME"):
        out[cache] = str(home)
    return out


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    command = list(command)
    command[command.index(flag) + 1] = value
    return command


async def test_rendered_token_step_agent_and_prestop_work_together(tmp_path):
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["uid"] = "u"
    pod = M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=1)["spec"]["template"]["spec"]
    c = {x["name"]: x for x in pod["containers"] + pod["initContainers"]}
    root = tmp_path / "admin"
    root.mkdir()

    # The init step: a fresh token, readable by its owner only.
    init = c["admin-token"]
    done = subprocess.run([KVSERVE, *rerooted(init["command"], root)[1:]], env=container_env(init, root, tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    token_file = root / "token"
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in done.stdout
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o400

    # A stand-in runtime: /drain answers only the pod's token.
    seen: list[str | None] = []

    async def drain(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": {"message": "admin key"}}, status=401)
        return web.json_response({"drained": True, "in_flight": 0})

    app = web.Application()
    app.router.add_post("/drain", drain)
    app.router.add_get("/metrics", lambda r: web.Response(text="kvserve:num_requests_running 0\n"))
    app.router.add_get("/ready", lambda r: web.json_response({"status": "ready"}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    agent_port = free_port()
    agent = c["agent"]
    command = with_flag(with_flag(agent["command"], "--engine-url", engine), "--port", str(agent_port))
    command = with_flag(command, "--model-dir", str(tmp_path / "models"))
    process = subprocess.Popen([KVSERVE, *command[1:], "--host", "127.0.0.1"], env=container_env(agent, root, tmp_path),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", agent_port), timeout=0.5).close()
                break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode()
                assert time.monotonic() < deadline, "agent did not listen"
                await asyncio.sleep(0.2)
        prestop = with_flag(agent["lifecycle"]["preStop"]["exec"]["command"], "--agent-url",
                            f"http://127.0.0.1:{agent_port}")
        # Without the container's env the hook has no key: it says so and fails.
        bare = await asyncio.to_thread(subprocess.run, [KVSERVE, *prestop[1:]], capture_output=True, text=True,
                                       timeout=60, env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)})
        assert bare.returncode == 2 and "admin" in bare.stderr
        # With it (what the kubelet runs in the agent container), the drain goes through to the engine.
        hook = await asyncio.to_thread(subprocess.run, [KVSERVE, *prestop[1:]], capture_output=True, text=True,
                                       timeout=60, env=container_env(agent, root, tmp_path))
        assert hook.returncode == 0, hook.stderr
        assert json.loads(hook.stdout.strip().splitlines()[-1])["drained"] is True
        assert seen == [f"Bearer {token}"]
    finally:
        process.terminate()
        process.wait(10)
        await runner.cleanup()
