"""The operator's own Prometheus metrics: what it decided and what it failed at, per resource.

Each `OperatorMetrics` has its own registry, so tests (and several operators in one process)
never share series. The handlers update it; `serve(port)` exposes it on /metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

RESOURCE = ("namespace", "inferenceservice")
FORGOTTEN = 4096  # uids of deleted resources remembered, so that a late timer run adds nothing


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvserve_operator_scaling_decisions", "Scaling decisions applied (replicas or TP changed)",
            RESOURCE + ("reason",), registry=self.registry)
        self.errors = Counter(
            "kvserve_operator_reconcile_errors", "Reconcile or autoscale runs that raised (kopf retries them)",
            RESOURCE, registry=self.registry)
        self.desired_replicas = Gauge("kvserve_operator_desired_replicas",
                                      "Replicas the operator wants", RESOURCE, registry=self.registry)
        self.desired_tp = Gauge("kvserve_operator_desired_tensor_parallel_size",
                                "Tensor-parallel degree the operator wants", RESOURCE, registry=self.registry)
        self.ready_replicas = Gauge("kvserve_operator_ready_replicas",
                                    "Ready, not terminating pods the operator saw", RESOURCE, registry=self.registry)
        self._reasons: dict[tuple[str, str], set[str]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._gone: deque[str] = deque(maxlen=FORGOTTEN)
        self._lock = threading.Lock()  # the HTTP server thread reads while handlers write

    def decision(self, namespace: str, name: str, reason: str, uid: str | None = None) -> None:
        with self._lock:
            if uid in self._gone:
                return
            self._reasons.setdefault((namespace, name), set()).add(reason)
            self._seen.add((namespace, name))
            self.decisions.labels(namespace, name, reason).inc()

    def error(self, namespace: str, name: str, uid: str | None = None) -> None:
        with self._lock:
            if uid in self._gone:
                return
            self._seen.add((namespace, name))
            self.errors.labels(namespace, name).inc()

    def observe(self, namespace: str, name: str, *, desired: int, tp: int, ready: int | None = None,
                uid: str | None = None) -> None:
        """`ready` None: only the desired size (set as it is applied, before pods are counted)."""
        with self._lock:
            if uid in self._gone:
                return
            self._seen.add((namespace, name))
            self.desired_replicas.labels(namespace, name).set(desired)
            self.desired_tp.labels(namespace, name).set(tp)
            if ready is not None:
                self.ready_replicas.labels(namespace, name).set(ready)

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Drop every series of a deleted resource (a recreated one starts from zero).

        With its uid, updates for that uid are ignored from now on: a timer run that started
        before the deletion may finish after it and would otherwise bring the series back."""
        key = (namespace, name)
        with self._lock:
            if uid is not None and uid not in self._gone:
                self._gone.append(uid)
            if key not in self._seen:
                return
            self._seen.discard(key)
            for metric in (self.errors, self.desired_replicas, self.desired_tp, self.ready_replicas):
                try:
                    metric.remove(namespace, name)
                except KeyError:
                    pass
            for reason in self._reasons.pop(key, ()):
                try:
                    self.decisions.remove(namespace, name, reason)
                except KeyError:
                    pass

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:
        """/metrics on `port` in a daemon thread (0 picks a free port: see server.server_port)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
