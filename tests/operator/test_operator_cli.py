"""`kvserve-operator plan` against a real agent (and straight against an engine's /metrics)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import yaml

from kvserve.testing.e2e_harness import Load, StubPod, free_port_on_all

OPERATOR = str(Path(sys.executable).parent / "kvserve-operator")
SPEC = {
    "apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "tiny"},
    "spec": {"model": {"uri": "hf://kvserve/tiny",
                       "config": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}},
             "parallelism": {"tensor": {"min": 1, "max": 4}},
             "autoscaling": {"maxReplicas": 6, "targetKVCacheUtilization": 0.5, "targetQueueDepth": 2}},
}


async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(OPERATOR, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture()
async def pods():
    ip = "127.0.0.90"
    agent_port, engine_port = free_port_on_all([ip, "127.0.0.91"]), free_port_on_all([ip, "127.0.0.91"])
    load = Load()
    load.kv, load.queue, load.running = 0.9, 5, 8
    started = [StubPod("a", ip, 1, engine_port, agent_port, load), StubPod("b", "127.0.0.91", 1, engine_port,
                                                                           agent_port, load)]
    await asyncio.gather(*(p.start() for p in started))
    yield started, load
    await asyncio.gather(*(p.stop() for p in started))


async def test_plan_against_live_agents_and_runtimes(pods, tmp_path):
    started, load = pods
    spec_file = tmp_path / "isvc.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    agents = [f"http://{p.ip}:{p.agent_port}" for p in started]
    code, out, err = await run_cli("plan", "--spec", str(spec_file), *sum((["--metrics-url", u] for u in agents), []))
    assert code == 0, err
    decision = json.loads(out)
    assert decision["replicas"] == {"from": 2, "to": 5}  # queue 10 / 2 per replica; panic skips the up window
    assert decision["signals"]["queueDepth"] == 10 and decision["signals"]["pods"] == 2
    assert decision["validTensorParallelDegrees"] == [1, 2, 4]

    # The same straight from the engines' /metrics (what the agent would have read).
    engines = [f"http://{p.ip}:{p.engine_port}/metrics" for p in started]
    code, out, err = await run_cli("plan", "--spec", str(spec_file), *sum((["--metrics-url", u] for u in engines), []))
    assert code == 0, err
    assert json.loads(out)["replicas"]["to"] == 5

    # Idle, steady: a scale-down shows; without --steady the down window holds it.
    load.kv, load.queue, load.running = 0.05, 0, 1
    await asyncio.sleep(0.5)
    code, out, _ = await run_cli("plan", "--spec", str(spec_file), "--steady", *sum((["--metrics-url", u] for u in agents), []))
    assert json.loads(out)["replicas"] == {"from": 2, "to": 1}
    code, out, _ = await run_cli("plan", "--spec", str(spec_file), *sum((["--metrics-url", u] for u in agents), []))
    assert json.loads(out)["reason"] == "ScaleDownStabilizing"


async def test_plan_rejects_a_bad_spec_naming_the_field(tmp_path):
    bad = yaml.safe_load(yaml.safe_dump(SPEC))
    bad["spec"]["autoscaling"]["minReplicas"] = 9
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump(bad))
    code, _, err = await run_cli("plan", "--spec", str(spec_file), "--metrics-url", "http://127.0.0.1:9")
    assert code == 2 and "spec.autoscaling: needs minReplicas <= maxReplicas" in err


async def test_unreachable_pods_are_stale_and_hold(tmp_path):
    spec_file = tmp_path / "isvc.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    code, out, err = await run_cli("plan", "--spec", str(spec_file), "--metrics-url", "http://127.0.0.1:9")
    assert code == 0 and "127.0.0.1:9" in err
    decision = json.loads(out)
    assert decision["reason"] == "NoMetrics" and decision["replicas"] == {"from": 1, "to": 1}


async def test_run_help():
    code, out, _ = await run_cli("run", "--help")
    assert code == 0 and "--all-namespaces" in out and "--liveness" in out and "--peering" in out


def test_run_subcommand_reconciles_with_kubeconfig_and_serves_liveness(tmp_path):
    """The console script itself: KUBECONFIG login, a namespace, the liveness and metrics endpoints."""
    import os
    import subprocess
    import urllib.request

    from kvserve.testing.e2e_harness import Api, wait_for
    from kvserve.testing.kube_emulator import EmulatorThread

    emulator = EmulatorThread().start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": emulator.url}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "t"}}]}))
    live_port, metrics_port = free_port_on_all(["127.0.0.1"]), free_port_on_all(["127.0.0.1"])
    proc = subprocess.Popen([OPERATOR, "run", "--namespace", "default", "--standalone",
                             "--liveness", f"http://127.0.0.1:{live_port}/healthz", "--scrape-interval", "1",
                             "--metrics-port", str(metrics_port)],
                            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        api = Api(emulator.url)
        api.apply_isvc(yaml.safe_load(yaml.safe_dump(SPEC)) | {"metadata": {"name": "tiny", "namespace": "default"}})
        dep = wait_for(lambda: api.get("Deployment", "tiny"), timeout=20, what="Deployment from the CLI operator")
        assert dep["spec"]["replicas"] == 1

        def alive():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{live_port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(alive, timeout=10, what="liveness endpoint")

        def scraped():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return None
            return 'kvserve_operator_desired_replicas{inferenceservice="tiny",namespace="default"} 1.0' in text and text

        text = wait_for(scraped, timeout=10, what="operator metrics")
        assert "# TYPE kvserve_operator_scaling_decisions_total counter" in text
        assert 'kvserve_operator_desired_tensor_parallel_size{inferenceservice="tiny",namespace="default"} 1.0' in text
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        emulator.stop()
    assert proc.returncode in (0, -15), err.decode()[-2000:]


async def test_plan_rejects_bad_yaml_and_other_kinds_in_one_line(tmp_path):
    """Regression: invalid YAML printed a traceback; a kustomization said `spec.model.uri: is required`."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec:\n  model: [1, 2\n  x: 3\n")
    code, out, err = await run_cli("plan", "--spec", str(broken), "--metrics-url", "http://127.0.0.1:9")
    assert code == 2 and out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "broken.yaml is not valid YAML (line 3" in err
    kust = tmp_path / "kustomization.yaml"
    kust.write_text("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [a.yaml]\n")
    code, _, err = await run_cli("plan", "--spec", str(kust), "--metrics-url", "http://127.0.0.1:9")
    assert code == 2 and "is not an InferenceService: kind 'Kustomization'" in err and "model.uri" not in err


def test_load_spec_file_takes_the_object_or_a_bare_spec(tmp_path):
    from kvserve.operator.cli import load_spec_file

    whole, bare = tmp_path / "whole.yaml", tmp_path / "bare.yaml"
    whole.write_text(yaml.safe_dump(SPEC))
    bare.write_text(yaml.safe_dump(SPEC["spec"]))
    assert load_spec_file(str(whole)) == load_spec_file(str(bare)) == SPEC["spec"]


@pytest.mark.parametrize("argv,message", [
    (["plan", "--replicas", "-1"], "argument --replicas: must be >= 0, got -1"),
    (["plan", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["plan", "--timeout", "-1"], "argument --timeout: must be > 0, got -1"),
    (["run", "--scrape-interval", "-1"], "argument --scrape-interval: must be > 0, got -1"),
    (["run", "--scrape-timeout", "0"], "argument --scrape-timeout: must be > 0, got 0"),
    (["run", "--max-sample-age", "nan"], "argument --max-sample-age: must be a finite number, got nan"),
    (["run", "--scrape-concurrency", "0"], "argument --scrape-concurrency: must be >= 1, got 0"),
    (["run", "--agent-port", "70000"], "argument --agent-port: must be >= 1 and <= 65535, got 70000"),
    (["run", "--metrics-port", "-1"], "argument --metrics-port: must be >= 0 and <= 65535, got -1"),
])
def test_numeric_flags_are_range_checked(argv, message, capsys):
    """Regression: `plan --replicas -1`/`--timeout -1` and `run --scrape-interval -1` were accepted,
    `plan --tp 0` silently ignored."""
    from kvserve.operator.cli import build_parser

    if argv[0] == "plan":
        argv = argv + ["--spec", "x.yaml", "--metrics-url", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_numeric_flags_accept_their_ranges():
    from kvserve.operator.cli import build_parser

    args = build_parser().parse_args(["plan", "--spec", "x", "--metrics-url", "u", "--replicas", "0", "--tp", "2",
                                      "--timeout", "0.5"])
    assert (args.replicas, args.tp, args.timeout) == (0, 2, 0.5)
    args = build_parser().parse_args(["run", "--scrape-interval", "0.5", "--agent-port", "9000"])
    assert (args.scrape_interval, args.agent_port, args.scrape_concurrency) == (0.5, 9000, 16)
    assert args.metrics_port == 8082
    assert build_parser().parse_args(["run", "--metrics-port", "0"]).metrics_port == 0


@pytest.mark.skipif(Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists(),
                    reason="runs inside a pod: in-cluster credentials exist")
def test_run_without_credentials_exits_with_one_line(tmp_path):
    """Regression: `run` with no credentials logged a LoginError traceback and stayed up forever."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | {"HOME": str(tmp_path)}
    for extra in ({}, {"KUBECONFIG": str(tmp_path / "missing")}):
        done = subprocess.run([OPERATOR, "run", "--standalone", "--liveness", ""], env=env | extra,
                              capture_output=True, text=True, timeout=30)
        err = done.stderr.strip()
        assert done.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert ("no Kubernetes credentials" in err) if not extra else ("missing" in err)


async def test_plan_says_why_tp_degrees_are_unknown(tmp_path):
    """Regression: `validTensorParallelDegrees` was a bare null for an hf:// model without config."""
    doc = yaml.safe_load(yaml.safe_dump(SPEC))
    doc["spec"]["model"] = {"uri": "hf://kvserve-test/not-cached"}
    spec_file = tmp_path / "isvc.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    code, out, err = await run_cli("plan", "--spec", str(spec_file), "--metrics-url", "http://127.0.0.1:9")
    assert code == 0, err
    decision = json.loads(out)
    assert decision["validTensorParallelDegrees"] is None
    assert "spec.model.config" in decision["tensorParallelNote"]
