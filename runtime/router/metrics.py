"""The router's /metrics (`kvserve_router_*`): what it decided, what it held, how fast pods answered."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0]
RETRY_REASONS = ("connect", "http_429", "http_503", "disconnected")
HOLD_OUTCOMES = ("released", "timeout", "rejected", "client_gone")
REFUSAL_CODES = ("401", "404", "405")
RETIRED_KEPT = 32  # gone pods whose series are still shown
HOLD_BUCKETS = [0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0]


class KVEventsCollector:
    """The pods' KV event streams as this replica follows them, read at scrape time from
    `source()` -> (per-pod status as kv_events.KVEventSubscriptions.status() gives it, requests
    ranked by events). Only followed pods have series: a pod gone takes its series along."""

    def __init__(self):
        self.source = None

    def describe(self):
        return []  # unchecked: the series exist only while pods are followed

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.source is None:
            return
        pods, ranked = self.source()
        live = GaugeMetricFamily("kvserve_router_kv_events_live",
                                 "1 while a pod's KV event stream is followed in sequence (it is ranked by the "
                                 "blocks it holds), else 0 (syncing, partial or down: ranked by what it served).",
                                 labels=["upstream"])
        blocks = GaugeMetricFamily("kvserve_router_kv_events_blocks",
                                   "Block hashes a pod's KV events say it holds (pool and offload tier).",
                                   labels=["upstream"])
        gaps = CounterMetricFamily("kvserve_router_kv_events_gaps",
                                   "Sequence gaps in a pod's KV events (missed batches), each answered by a replay.",
                                   labels=["upstream"])
        restarts = CounterMetricFamily("kvserve_router_kv_events_restarts",
                                       "Times a pod's KV event numbering started over (a restart): index cleared.",
                                       labels=["upstream"])
        for pod, st in pods.items():
            live.add_metric([pod], 1.0 if st["state"] == "live" else 0.0)
            blocks.add_metric([pod], st["blocks"])
            gaps.add_metric([pod], st["gaps"])
            restarts.add_metric([pod], st["restarts"])
        yield from (live, blocks, gaps, restarts)
        yield CounterMetricFamily("kvserve_router_kv_events_ranked_requests",
                                  "Requests placed with some pod ranked by its KV events.", value=ranked)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvserve_router_requests", "Requests sent to a pod, by pod and routing decision.",
                                ["upstream", "decision"], registry=r)
        self.prefix_hits = Counter("kvserve_router_prefix_hits",
                                   "Requests sent to a pod that had served a prefix of the prompt recently.",
                                   registry=r)
        self.prefix_query_chunks = Counter("kvserve_router_prefix_query_chunks",
                                           "Prefix chunks of routed prompts (prefix policy).", registry=r)
        self.prefix_matched_chunks = Counter("kvserve_router_prefix_matched_chunks",
                                             "Of those, chunks the chosen pod had served recently.", registry=r)
        self.retries = Counter("kvserve_router_retries",
                               "Requests sent again to another pod after one refused before the first byte.",
                               ["reason"], registry=r)
        self.responses = Counter("kvserve_router_responses", "Responses to clients, by HTTP status.", ["code"],
                                 registry=r)
        self.held = Gauge("kvserve_router_held_requests", "Requests waiting for a ready pod now.", registry=r)
        self.holds = Counter("kvserve_router_holds", "Requests that had to wait for a ready pod, by outcome.",
                             ["outcome"], registry=r)
        self.hold_seconds = Histogram("kvserve_router_hold_seconds",
                                      "How long held requests waited for a ready pod.", buckets=HOLD_BUCKETS,
                                      registry=r)
        self.ttft = Histogram("kvserve_router_upstream_ttft_seconds",
                              "From sending a streaming request to a pod to its first body bytes.",
                              ["upstream"], buckets=TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge("kvserve_router_in_flight_requests", "Requests open to each pod.", ["upstream"],
                               registry=r)
        self.endpoints = Gauge("kvserve_router_ready_endpoints", "Ready pods the router sends to.", registry=r)
        self.conversations = Gauge("kvserve_router_conversations",
                                   "Conversations (chains of requests that extend each other) each pod keeps, as "
                                   "this router counts them for placing new ones (prefix policy; --session-ttl).",
                                   ["upstream"], registry=r)
        self.refusals = Counter("kvserve_router_refused_requests",
                                "Requests refused from their request line and headers alone: 404 (not on the "
                                "allowlist), 405 (wrong method), 401 (no valid API key).", ["code"], registry=r)
        self.body_rejections = Counter("kvserve_router_body_rejections",
                                       "Requests refused because their body would pass a byte budget.", ["budget"],
                                       registry=r)
        self.held_bytes = Gauge("kvserve_router_held_bytes", "Bytes of request bodies held for a ready pod now.",
                                registry=r)
        self.buffered_bytes = Gauge("kvserve_router_buffered_bytes",
                                    "Bytes of request bodies in the router's memory now (held or being forwarded).",
                                    registry=r)

        # Every label value exists from the start: a dashboard's rate() of "no retries yet" is 0,
        # not "no data".
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for outcome in HOLD_OUTCOMES:
            self.holds.labels(outcome)
        for code in REFUSAL_CODES:
            self.refusals.labels(code)
        self.body_rejections.labels("buffered")
        self.kv_events = KVEventsCollector()
        r.register(self.kv_events)
        self._retired: dict[str, None] = {}  # gone pods, oldest first

    def retire_upstream(self, upstream: str) -> None:
        """A pod that went away. Its series stay (a dashboard or a report still reads what it
        served) until RETIRED_KEPT more pods have gone: pods come and go under an autoscaler, each
        with a new name, and the number of series must follow the live pods, not the history."""
        self._retired.pop(upstream, None)
        self._retired[upstream] = None
        while len(self._retired) > RETIRED_KEPT:
            oldest = next(iter(self._retired))
            del self._retired[oldest]
            self._remove(oldest)

    def revive_upstream(self, upstream: str) -> None:
        self._retired.pop(upstream, None)

    def shows(self, upstream: str) -> bool:
        """Whether a gone pod's series are still kept."""
        return upstream in self._retired

    def _remove(self, upstream: str) -> None:
        from .policy import DECISIONS

        for metric, labels in [(self.requests, (upstream, d)) for d in DECISIONS] + [(self.ttft, (upstream,)),
                                                                                      (self.in_flight, (upstream,)),
                                                                                      (self.conversations, (upstream,))]:
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
