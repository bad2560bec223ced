"""Ranks on several nodes: how a multi-node replica's processes find each other.

On Kubernetes a multi-node replica is one LeaderWorkerSet group: pod 0 (the leader) runs
``kvserve serve`` (server, scheduler, rank 0), pods 1..N-1 run ``kvserve worker``. LeaderWorkerSet
gives every container ``LWS_LEADER_ADDRESS`` (the leader pod's DNS name), ``LWS_GROUP_SIZE`` (N)
and ``LWS_WORKER_INDEX`` (the pod's index). Pod i hosts global ranks [i*L, (i+1)*L), L = world / N
(one per GPU of the node); with L = tensor_parallel_size each node is one pipeline stage, so only
activations cross the network.

Two channels, both opened towards the leader:

- control: each remote rank connects to ``LEADER:port`` and speaks the protocol local workers
  speak over their pipes (runtime/executor/protocol.py). Both ends prove they hold the shared key
  (``KVSERVE_RENDEZVOUS_KEY``, a Secret) with multiprocessing's HMAC challenge before any message
  is read, because messages are pickles; a multi-node start without a key is refused. The socket
  is also the death signal: a lost connection fails the group at once, as a closed pipe does.
- collectives: torch.distributed's TCPStore on ``LEADER:port+1`` (gloo or NCCL over the pod network).

Pure helpers here (``Rendezvous.from_env``, ``node_ranks``); the sockets are in ``accept_ranks``
(leader) and ``connect`` (worker).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT_S = 600.0  # worker pods may pull images and fetch weights after the leader


@dataclass(frozen=True)
class Rendezvous:
    leader_address: str
    group_size: int  # pods in the group (LWS_GROUP_SIZE)
    worker_index: int  # this pod's index (LWS_WORKER_INDEX); 0 is the leader
    port: int = DEFAULT_PORT  # control; the TCPStore listens on port + 1
    key: bytes = b""
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def store_port(self) -> int:
        return self.port + 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rendezvous | None:
        """The group from LeaderWorkerSet's variables, or None on one node (no LWS_GROUP_SIZE, or 1).
        ``KVSERVE_RENDEZVOUS_PORT`` / ``_KEY`` / ``_TIMEOUT_S`` override the defaults."""
        env = os.environ if env is None else env
        raw = env.get("LWS_GROUP_SIZE", "")
        if not raw:
            return None
        size = _int(env, "LWS_GROUP_SIZE", low=1)
        if size == 1:
            return None
        index = _int(env, "LWS_WORKER_INDEX", low=0, default="0")
        if index >= size:
            raise ValueError(f"LWS_WORKER_INDEX: {index} is not below LWS_GROUP_SIZE {size}")
        address = env.get("LWS_LEADER_ADDRESS", "")
        if not address:
            raise ValueError("LWS_LEADER_ADDRESS: must be set for a multi-node group (LWS_GROUP_SIZE > 1)")
        key = env.get("KVSERVE_RENDEZVOUS_KEY", "")
        if not key:
            raise ValueError("KVSERVE_RENDEZVOUS_KEY: a multi-node group needs a shared key (ranks exchange "
                             "pickled messages; only key holders may connect)")
        port = _int(env, "KVSERVE_RENDEZVOUS_PORT", low=1, default=str(DEFAULT_PORT))
        if port >= 65535:
            raise ValueError(f"KVSERVE_RENDEZVOUS_PORT: must be below 65535 (the store takes port + 1), got {port}")
        timeout = float(env.get("KVSERVE_RENDEZVOUS_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
        return cls(address, size, index, port, key.encode(), timeout)

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.group_size:
            raise ValueError(f"LWS_GROUP_SIZE: {self.group_size} pods cannot host {world_size} ranks "
                             f"(tensor x pipeline parallel) evenly")
        return world_size // self.group_size

    def node_ranks(self, world_size: int, index: int | None = None) -> range:
        """The global ranks pod `index` (default: this pod) hosts."""
        per = self.ranks_per_node(world_size)
        i = self.worker_index if index is None else index
        return range(i * per, (i + 1) * per)


def _int(env: Mapping[str, str], name: str, *, low: int, default: str | None = None) -> int:
    raw = env.get(name) or default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    return value


class RemoteRank:
    """A rank on another node, seen by the leader through its control connection (the
    counterpart of multiproc's local worker process: same ``ctrl`` / ``report`` / ``eof``)."""

    def __init__(self, rank: int, sock: socket.socket, conn: Connection, peer: str) -> None:
        self.rank, self.peer, self.pid = rank, peer, None
        self._sock = sock
        self.ctrl = self.report = conn
        self.eof = False

    @property
    def exitcode(self) -> int | None:
        return None  # another node's process: only its connection says whether it lives

    @property
    def lost(self) -> str:
        return f"on {self.peer} lost its connection (its process or pod ended)"

    def join(self, timeout_s: float) -> None:
        pass

    def kill(self) -> None:
        # Shut the socket down rather than close it: a thread waiting on it wakes with EOF, and
        # the remote rank sees EOF and exits (its pod then restarts the group).
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.kill()
        self.ctrl.close()
        self._sock.close()


def accept_ranks(rdv: Rendezvous, ranks: range, init_message, deadline: float) -> list[RemoteRank]:
    """Leader: waits for every rank in `ranks` to connect and authenticate, sends each its
    ``init_message(rank)`` bytes, and returns them in rank order. A wrong key, an unexpected or
    repeated rank is dropped (logged by the caller's timeout if a real rank never comes)."""
    server = socket.create_server(("", rdv.port), reuse_port=False)
    got: dict[int, RemoteRank] = {}
    try:
        while len(got) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(ranks) - set(got))
                raise TimeoutError(f"multi-node ranks {missing} did not connect to {rdv.leader_address}:{rdv.port} "
                                   f"within {rdv.timeout_s:g}s (KVSERVE_RENDEZVOUS_TIMEOUT_S)")
            server.settimeout(left)
            try:
                sock, peer = server.accept()
            except TimeoutError:
                continue
            # A blocking socket (Connection reads its fd directly) whose reads time out, so a
            # client that connects and says nothing cannot hold the accept loop.
            sock.setblocking(True)
            _read_timeout(sock, 30.0)
            conn = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(conn, rdv.key)
                answer_challenge(conn, rdv.key)
                rank = int(conn.recv_bytes(16))
            except Exception:
                conn.close()
                sock.close()
                continue
            if rank not in ranks or rank in got:
                conn.close()
                sock.close()
                continue
            _read_timeout(sock, 0.0)
            remote = RemoteRank(rank, sock, conn, f"{peer[0]}")
            conn.send_bytes(init_message(rank))
            got[rank] = remote
    except BaseException:
        for r in got.values():
            r.close()
        raise
    finally:
        server.close()
    return [got[r] for r in ranks]


def _read_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO (0: none): applies to reads of the raw fd, unlike socket.settimeout."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def connect(rdv: Rendezvous, rank: int) -> Connection:
    """Worker: connects to the leader (retrying until the deadline: the leader may start later),
    proves the key and says which rank it is."""
    deadline = time.monotonic() + rdv.timeout_s
    while True:
        try:
            sock = socket.create_connection((rdv.leader_address, rdv.port), timeout=10.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    answer_challenge(conn, rdv.key)
    deliver_challenge(conn, rdv.key)
    conn.send_bytes(str(rank).encode())
    return conn
