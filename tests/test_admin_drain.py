"""Issue 18, admin credential: /drain on the runtime and on its agent needs the admin key; a
finished (or timed-out) drain fails /live so the kubelet restarts the container.

Everything is real: the runtime (`ServerThread`, tiny random-weight llama) and the agent app on
127.0.0.1, called over HTTP exactly as a pod neighbour would call them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from server_helpers import http, idle, wait_until

from kvserve.runtime.agent.app import AgentConfig, build_app
from kvserve.runtime.server.main import ServerThread

USER_KEY = "user-key-0123456789"
ADMIN_KEY = "admin-key-9876543210"
BEARER = {"user": {"Authorization": f"Bearer {USER_KEY}"}, "admin": {"Authorization": f"Bearer {ADMIN_KEY}"}}


def _runtime(model, *extra) -> ServerThread:
    srv = ServerThread([str(model), "--served-model-name", "tiny", "--port", "0", "--num-kv-blocks", "256",
                        "--api-key", USER_KEY, *extra]).start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    return srv


async def _agent(engine_url: str, **config) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(AgentConfig(engine_url=engine_url, interval_s=0.1, **config)),
                           shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _completion_ok(srv: ServerThread) -> bool:
    s, _, _ = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2},
                   headers=BEARER["user"])
    return s == 200


async def _post(session: aiohttp.ClientSession, url: str, headers: dict | None = None) -> tuple[int, dict]:
    async with session.post(url, headers=headers or {}, params={"timeout": "5"}) as r:
        return r.status, await r.json()


async def test_drain_without_admin_credential_is_refused_and_runtime_keeps_serving(tiny_llama):
    """The attack: POST /drain to the agent (no credential) made the runtime drain for good,
    because the agent's request came from loopback. Neither loopback nor the user key is an
    admin credential, on the agent or on the runtime."""
    srv = _runtime(tiny_llama)
    runner, agent = await _agent(srv.url)
    try:
        async with aiohttp.ClientSession() as session:
            for url in (agent + "/drain", srv.url + "/drain"):
                status, body = await _post(session, url)
                assert status == 403, (url, body)  # no admin key configured anywhere
                assert "--admin-api-key" in body["error"]["message"], body
                assert body["error"]["type"] == "permission_error"
                status, body = await _post(session, url, BEARER["user"])
                assert status == 403, (url, body)
        assert http(srv.url, "GET", "/ready")[0] == 200 and http(srv.url, "GET", "/live")[0] == 200
        assert _completion_ok(srv)
    finally:
        await runner.cleanup()
        assert srv.stop() == 0


async def test_agent_reports_a_drain_the_runtime_refuses(tiny_llama):
    """An agent whose key the runtime does not accept says so, rather than watching scrapes and
    calling a runtime that never stopped admission "drained"."""
    srv = _runtime(tiny_llama, "--admin-api-key", ADMIN_KEY)
    runner, agent = await _agent(srv.url, admin_api_key="another-admin-key")
    try:
        async with aiohttp.ClientSession() as session:
            status, body = await _post(session, agent + "/drain", {"Authorization": "Bearer another-admin-key"})
        assert status == 200 and body["drained"] is False and body["engine_status"] == 401
        assert body["error"].startswith("the engine refused the drain: POST /drain needs the admin key")
        assert http(srv.url, "GET", "/ready")[0] == 200 and _completion_ok(srv)
    finally:
        await runner.cleanup()
        assert srv.stop() == 0


async def test_admin_key_drains_through_the_agent_and_then_live_fails(tiny_llama, tmp_path, monkeypatch, capsys):
    """The per-pod token as the operator sets it up: `kvserve agent admin-token` writes it, the runtime
    and the agent read it with --admin-api-key-file, and the preStop hook (`kvserve agent drain`)
    finds it through KVSERVE_ADMIN_API_KEY_FILE."""
    from kvserve.runtime import cli

    token_file = tmp_path / "admin" / "token"
    assert cli.main(["agent", "admin-token", "--out", str(token_file)]) == 0
    admin = {"Authorization": "Bearer " + token_file.read_text().strip()}
    srv = _runtime(tiny_llama, "--admin-api-key-file", str(token_file), "--drain-timeout", "30")
    runner, agent = await _agent(srv.url, admin_api_key=token_file.read_text().strip())
    try:
        async with aiohttp.ClientSession() as session:
            for url in (agent + "/drain", srv.url + "/drain"):
                for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic " + ADMIN_KEY}):
                    status, body = await _post(session, url, headers)
                    assert status == 401 and "admin key" in body["error"]["message"], (url, headers, body)
                    assert body["error"]["code"] == "invalid_api_key"
            status, body = await _post(session, agent + "/drain", BEARER["user"])
            assert status == 401  # the agent does not know the user key: just not the admin key
            status, body = await _post(session, srv.url + "/drain", BEARER["user"])
            assert status == 403 and "not an admin credential" in body["error"]["message"]
            assert http(srv.url, "GET", "/ready")[0] == 200 and _completion_ok(srv)
            # Every route under /admin/ is an admin route, even one that does not exist (yet).
            assert http(srv.url, "POST", "/admin/load_lora_adapter", {})[0] == 401
            assert http(srv.url, "POST", "/admin/load_lora_adapter", {}, headers=BEARER["user"])[0] == 403
            assert http(srv.url, "POST", "/admin/load_lora_adapter", {}, headers=admin)[0] == 404

            # preStop while a stream is in flight: it finishes, then the runtime retires.
            body = {"model": "tiny", "prompt": "A story:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            async with session.post(srv.url + "/v1/completions", json=body, headers=BEARER["user"]) as stream:
                assert (await stream.content.readline()).startswith(b"data: ")
                monkeypatch.setenv("KVSERVE_ADMIN_API_KEY_FILE", str(token_file))
                prestop = asyncio.create_task(asyncio.to_thread(
                    cli.main, ["agent", "drain", "--agent-url", agent, "--timeout", "30"]))
                await _until(lambda: http(srv.url, "GET", "/ready")[0] == 503)
                assert http(srv.url, "GET", "/live")[0] == 200  # in-flight work still running
                rest = await stream.content.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
            assert await prestop == 0
            result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert result["drained"] is True and result["aborted"] == 0
            for route in ("/live", "/health", "/ready"):
                status, _, raw = http(srv.url, "GET", route)
                assert status == 503 and json.loads(raw)["status"] == "drained", route
    finally:
        await runner.cleanup()
        assert srv.stop() == 0


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(predicate):
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_drain_is_time_boxed_and_survives_its_caller_hanging_up(tiny_llama):
    """?timeout= cannot stretch a drain past --drain-timeout; past the time box the rest is aborted
    (the stream still ends properly) and the runtime retires, even if the drain's caller is gone."""
    srv = _runtime(tiny_llama, "--admin-api-key", ADMIN_KEY, "--drain-timeout", "0.5")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + "/drain", params={"timeout": "-1"}, headers=BEARER["admin"]) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "timeout" and "timeout" in err["message"]
            body = {"model": "tiny", "prompt": "A story:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            async with session.post(srv.url + "/v1/completions", json=body, headers=BEARER["user"]) as stream:
                assert (await stream.content.readline()).startswith(b"data: ")
                # The caller asks for an hour, then hangs up at once.
                hung_up = asyncio.create_task(session.post(srv.url + "/drain", params={"timeout": "3600"},
                                                           headers=BEARER["admin"]))
                await asyncio.sleep(0.1)
                hung_up.cancel()
                rest = await asyncio.wait_for(stream.content.read(), 30)
            assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"abort"' in rest
            await _until(lambda: http(srv.url, "GET", "/live")[0] == 503)
            idle(srv.url)  # the aborted request's KV blocks are back in the pool
            # A later drain joins the one that ran and reports its outcome.
            async with session.post(srv.url + "/drain", headers=BEARER["admin"]) as r:
                outcome = await r.json()
            assert r.status == 200
            assert outcome == {"draining": True, "drained": False, "aborted": 1, "timeout_seconds": 0.5,
                               "in_flight": 0}
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("argv, says", [
    (["--api-key", "same-key-123", "--admin-api-key", "same-key-123"], "must differ from the API key"),
    (["--admin-api-key", "a", "--admin-api-key-file", "/x"], "not both"),
    (["--admin-api-key-file", "/nonexistent/token"], "/nonexistent/token does not exist"),
    (["--admin-api-key", "has space"], "visible ASCII"),
])
def test_serve_refuses_an_unusable_admin_key_before_loading(tiny_llama, capsys, argv, says):
    from kvserve.runtime import cli

    assert cli.main(["serve", str(tiny_llama), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve serve: ") and says in err


def test_agent_commands_refuse_an_unusable_or_missing_admin_key(tmp_path, capsys, monkeypatch):
    from kvserve.runtime import cli

    monkeypatch.delenv("KVSERVE_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("KVSERVE_ADMIN_API_KEY_FILE", raising=False)
    assert cli.main(["agent", "drain", "--agent-url", "http://127.0.0.1:9"]) == 2
    assert "no admin key to send" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    monkeypatch.setenv("KVSERVE_ADMIN_API_KEY_FILE", str(empty))
    for argv in (["agent", "drain"], ["agent", "serve", "--port", "0"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert f"KVSERVE_ADMIN_API_KEY_FILE ({empty}): the admin key is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve"], ["agent", "serve"], ["agent", "drain"]])
def test_admin_key_flags_are_in_help(argv, capsys):
    from kvserve.runtime import cli

    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--admin-api-key KEY" in out and "$KVSERVE_ADMIN_API_KEY)" in out
    assert "--admin-api-key-file PATH" in out and "$KVSERVE_ADMIN_API_KEY_FILE" in out
