"""Multi-node rendezvous on loopback addresses: the leader (the engine, in this process) and a
`kvserve worker` node process find each other through LeaderWorkerSet's variables, greedy output
equals one process's, and a lost node fails the leader's health naming the rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError

import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.executor.multiproc import WorkerDiedError
from kvserve.runtime.executor.rendezvous import Rendezvous, accept_ranks, connect

KW = dict(block_size=4, dtype="float32", device="cpu", kv_cache_memory_bytes=256 * 1024)


def _free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port


def _env(port: int, index: int, key: str = "k" * 32) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": "127.0.0.2", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index),
            "KVSERVE_RENDEZVOUS_KEY": key, "KVSERVE_RENDEZVOUS_PORT": str(port),
            "KVSERVE_RENDEZVOUS_TIMEOUT_S": "60", "GLOO_SOCKET_IFNAME": "lo"}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_two_nodes_over_loopback_match_one_process_and_a_lost_node_fails_health(tiny_model_factory, monkeypatch):
    model_dir = tiny_model_factory("llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(model_dir), **KW) as llm1:
        want = [list(o.outputs[0].token_ids) for o in llm1.generate(prompts, params, use_tqdm=False)]

    port = _free_port_pair()
    node = subprocess.Popen([sys.executable, "-m", "kvserve.runtime.cli", "worker", "--pipeline-parallel-size", "2"],
                            env=dict(os.environ, **_env(port, 1)))
    try:
        for name, value in _env(port, 0).items():
            monkeypatch.setenv(name, value)
        llm = LLM(str(model_dir), pipeline_parallel_size=2, **KW)
        try:
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            assert got == want
            report = llm.engine.executor.rank_reports[1]
            assert report["node"] == "127.0.0.1" and report["pid"] in _children(node.pid)
            # The node's rank dies: the leader's health check names it; the node process exits too.
            os.kill(report["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while llm.engine.executor.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) on 127.0.0.1 lost its connection"):
                llm.engine.check_health()
            assert node.wait(10) != 0
        finally:
            llm.close()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_only_key_holders_join_and_bad_environment_is_named():
    port = _free_port_pair()
    rdv = Rendezvous.from_env(_env(port, 0))
    result: dict[str, object] = {}

    def leader():
        try:
            result["ranks"] = accept_ranks(rdv, range(1, 2), lambda rank: b"init", time.monotonic() + 20)
        except Exception as exc:  # pragma: no cover - reported below
            result["error"] = exc

    t = threading.Thread(target=leader)
    t.start()
    intruder = Rendezvous.from_env(_env(port, 1, key="wrong"))
    with pytest.raises(AuthenticationError):
        connect(intruder, 1).recv_bytes()
    conn = connect(Rendezvous.from_env(_env(port, 1)), 1)
    assert conn.recv_bytes() == b"init"
    t.join(20)
    (remote,) = result["ranks"]
    assert remote.rank == 1
    remote.close()
    conn.close()

    assert Rendezvous.from_env({}) is None and Rendezvous.from_env({"LWS_GROUP_SIZE": "1"}) is None
    with pytest.raises(ValueError, match="KVSERVE_RENDEZVOUS_KEY"):
        Rendezvous.from_env({"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "x"})
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX: 2 is not below LWS_GROUP_SIZE 2"):
        Rendezvous.from_env(dict(_env(port, 2)))
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE: 2 pods cannot host 3 ranks"):
        rdv.ranks_per_node(3)
    assert list(Rendezvous.from_env(_env(port, 1)).node_ranks(4)) == [2, 3]
