"""``kvserve worker``: a non-leader pod of a multi-node replica runs only its ranks.

It reads the group from LeaderWorkerSet's environment (runtime/executor/rendezvous.py), starts one
process per rank this node hosts (each connects to the leader and runs its stage's shard), and
exits as soon as any of them does, with its status, after stopping the others: the pod restarts
and LeaderWorkerSet's RecreateGroupOnPodRestart restarts the whole group, leader included, so a
half-alive group never lingers. It serves no HTTP and schedules nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("kvserve.worker")

_BOOT = "from kvserve.runtime.executor.worker_process import main_remote; main_remote()"


def run_node(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    from kvserve.runtime.executor.rendezvous import Rendezvous

    try:
        rdv = Rendezvous.from_env()
        if rdv is None:
            raise ValueError("LWS_GROUP_SIZE: kvserve worker runs in a multi-node group (LWS_GROUP_SIZE > 1)")
        if rdv.worker_index == 0:
            raise ValueError("LWS_WORKER_INDEX: 0 is the leader, which runs `kvserve serve`")
        ranks = rdv.node_ranks(tensor_parallel_size * pipeline_parallel_size)
    except ValueError as exc:
        print(f"kvserve worker: {exc}", file=sys.stderr)
        return 2
    log.info("node %d of %d: ranks %d..%d, leader %s:%d", rdv.worker_index, rdv.group_size, ranks[0], ranks[-1],
             rdv.leader_address, rdv.port)
    children = [subprocess.Popen([sys.executable, "-c", _BOOT], env=dict(os.environ, KVSERVE_RANK=str(r)))
                for r in ranks]
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping:
            done = [c for c in children if c.poll() is not None]
            if done:
                code = done[0].returncode
                log.error("rank process %d exited (%s): stopping this node's ranks", done[0].pid, code)
                return code if code else 1
            time.sleep(0.2)
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(5.0)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
