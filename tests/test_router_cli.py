"""`kvserve router` bad input: a clear one-line error and exit 2, never a traceback or a router
that runs with nothing to route to. And the pure parts of its endpoint sources."""

from __future__ import annotations

import pytest

from kvserve.runtime.cli import main
from kvserve.runtime.router.endpoints import endpoints_from_pods, inferenceservice_selector, parse_endpoints


@pytest.mark.parametrize("argv, message", [
    ([], "no pods to route to: give --endpoints"),
    (["--endpoints", ""], "endpoints: no URL given"),
    (["--endpoints", "ftp://x:1"], "endpoints: 'ftp://x:1' is not an http(s)://host:port URL"),
    (["--endpoints", "http://a:1,http://a:1"], "endpoints: a:1 is listed twice"),
    (["--endpoints", "http://a:1", "--inferenceservice", "x"], "cannot be combined"),
    (["--selector", "novalue"], "selector: 'novalue' is not key=value"),
])
def test_bad_pod_sources_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve router: ") and message in err and "Traceback" not in err


def test_no_namespace_outside_a_pod(capsys, monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr("kvserve.runtime.router.cli._service_account_namespace", lambda: None)
    assert main(["router", "--inferenceservice", "tiny"]) == 2
    assert "--namespace is required" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--policy", "random"], "argument --policy: invalid choice: 'random'"),
    (["--hold-timeout", "-1"], "argument --hold-timeout"),
    (["--max-kv-utilization", "2"], "argument --max-kv-utilization"),
    (["--balance-factor", "0.5"], "argument --balance-factor"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["router", "--endpoints", "http://a:1", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_parse_endpoints():
    eps = parse_endpoints("http://10.0.0.5:8000, 10.0.0.6:9000/", agent_port=8081)
    assert [(e.name, e.url, e.signals_url) for e in eps] == [
        ("10.0.0.5:8000", "http://10.0.0.5:8000", "http://10.0.0.5:8081/v1/signals"),
        ("10.0.0.6:9000", "http://10.0.0.6:9000", "http://10.0.0.6:8081/v1/signals")]
    assert parse_endpoints("http://h:1", agent_port=0)[0].signals_url == "http://h:1/metrics"
    assert parse_endpoints("http://h:1", agent_port=None)[0].signals_url is None


def pod(name, ip="10.1.0.1", ready="True", phase="Running", labels=None, deleting=False):
    meta = {"name": name, "labels": inferenceservice_selector("svc") if labels is None else labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": ready}]}}


def test_only_ready_pods_of_the_service_are_endpoints():
    pods = [pod("b", "10.1.0.2"), pod("a", "fd00::1"), pod("unready", ready="False"), pod("pending", phase="Pending"),
            pod("going", deleting=True), pod("other", labels={"app.kubernetes.io/instance": "svc"}),
            pod("no-ip", ip=None)]
    eps = endpoints_from_pods(pods, selector=inferenceservice_selector("svc"), runtime_port=8000, agent_port=8081)
    assert [(e.name, e.url, e.signals_url) for e in eps] == [
        ("a", "http://[fd00::1]:8000", "http://[fd00::1]:8081/v1/signals"),
        ("b", "http://10.1.0.2:8000", "http://10.1.0.2:8081/v1/signals")]


def test_api_key_and_byte_limits_from_flags_env_and_memory(monkeypatch):
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.router.cli import config_from_args

    def config(*argv, memory=None):
        return config_from_args(build_parser().parse_args(["router", "--endpoints", "http://a:1", *argv]), memory)

    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    c = config(memory=256 << 20)
    assert c.api_keys == () and (c.max_request_body_bytes, c.max_held_bytes, c.max_buffered_bytes) == (
        8 << 20, 64 << 20, 128 << 20)
    assert c.policy.index_capacity == (256 << 20) // 8 // 400
    c = config("--max-held-bytes", "0", "--max-buffered-bytes", "1000", "--max-request-body-bytes", "10",
               memory=256 << 20)
    assert (c.max_request_body_bytes, c.max_held_bytes, c.max_buffered_bytes) == (10, 0, 1000)
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert config().api_keys == ("from-env",)
    assert config("--api-key", "a,b").api_keys == ("a", "b")  # the flag wins


@pytest.mark.parametrize("key, message", [("a,,b", "--api-key / KVSERVE_API_KEY: key 2 of 3"),
                                          ("tab\tkey", "visible ASCII")])
def test_a_bad_api_key_is_a_one_line_error(key, message, capsys, monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    assert main(["router", "--endpoints", "http://a:1", "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve router: ") and message in err and "Traceback" not in err and key not in err
