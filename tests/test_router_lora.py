"""Adapter-aware routing (multi-LoRA), pure: the prefix index keyed by (adapter, prefix), requests
for an adapter placed among the pods that have it loaded under the same load bound, and the
adapter lists read from agents' signals and runtimes' /metrics."""

from __future__ import annotations

import pytest

from kvserve.runtime.agent.signals import standardize
from kvserve.runtime.router.load import MAX_ADAPTERS, LoadPoller, Sample, load_from_metrics, load_from_signals
from kvserve.runtime.router.policy import (
    OVERLOADED,
    PREFIX_HIT,
    PREFIX_NEW,
    EndpointLoad,
    PolicyConfig,
    PolicyState,
    adapter_holders,
    adapter_of,
    choose,
    chunk_hashes,
)

PODS = ["pod-a", "pod-b", "pod-c", "pod-d"]
ADAPTERS = {"pod-a": frozenset({"sql"}), "pod-b": frozenset({"sql", "chat"}), "pod-c": frozenset({"chat"})}


def state(**kw) -> PolicyState:
    s = PolicyState(PolicyConfig(**kw))
    s.set_pods(PODS)
    return s


def test_base_model_hashes_do_not_change():
    # No adapter: the very hashes routers computed before adapters existed (a rolling upgrade of
    # the routers keeps every prefix entry).
    assert chunk_hashes("x" * 200) == chunk_hashes("x" * 200, adapter=None)
    assert chunk_hashes([1, 2, 3] * 20) == chunk_hashes([1, 2, 3] * 20, adapter=None)


@pytest.mark.parametrize("key", ["a shared system prompt " * 10, list(range(64)), "short"])
def test_prefix_hashes_are_keyed_by_adapter(key):
    base = chunk_hashes(key)
    sql, chat = chunk_hashes(key, adapter="sql"), chunk_hashes(key, adapter="chat")
    assert len(base) == len(sql) == len(chat)
    # No chunk is shared across adapters (or with the base model): their KV differs.
    assert not (set(base) & set(sql)) and not (set(sql) & set(chat)) and not (set(base) & set(chat))
    assert chunk_hashes(key, adapter="sql") == sql  # deterministic across routers and restarts


@pytest.mark.parametrize("body, expected", [
    ({"model": "sql"}, "sql"),
    ({"model": "chat"}, "chat"),
    ({"model": "base-model"}, None),  # no pod lists it as an adapter: the base model
    ({"model": "unknown"}, None),
    ({}, None),
    ({"model": 3}, None),
    ({"model": ""}, None),
])
def test_adapter_of(body, expected):
    assert adapter_of(body, ADAPTERS) == expected


@pytest.mark.parametrize("adapter, expected", [
    (None, PODS),
    ("sql", ["pod-a", "pod-b"]),
    ("chat", ["pod-b", "pod-c"]),
    ("gone", PODS),  # nobody reports it: every pod, and the pod's own 404 decides
])
def test_adapter_holders(adapter, expected):
    assert adapter_holders(adapter, PODS, ADAPTERS) == expected


def test_adapter_requests_go_to_holders_only():
    s = state()
    for i in range(40):
        hashes = chunk_hashes(f"prompt {i} " * 20, adapter="sql")
        choice = choose(s, hashes, PODS, {}, now=0.0, adapter="sql", adapters=ADAPTERS)
        assert choice.pod in ("pod-a", "pod-b")
        s.record(hashes, choice.pod, 0.0)


def test_adapter_affinity_keeps_the_load_bound_among_holders():
    # pod-a is at the bound among the sql holders: new sql prompts go to pod-b, never to pod-c/d
    # (idle, but without the adapter).
    s = state()
    loads = {"pod-a": EndpointLoad(in_flight=6), "pod-b": EndpointLoad(in_flight=1)}
    for i in range(20):
        choice = choose(s, chunk_hashes(f"new {i}" * 30, adapter="sql"), PODS, loads, now=0.0,
                        adapter="sql", adapters=ADAPTERS)
        assert choice.pod == "pod-b"
        assert choice.decision == PREFIX_NEW


def test_adapter_prefix_hit_and_overload_fallback_stay_among_holders():
    s = state()
    hashes = chunk_hashes("conversation history " * 30, adapter="chat")
    s.record(hashes, "pod-c", 0.0)
    choice = choose(s, hashes, PODS, {}, now=1.0, adapter="chat", adapters=ADAPTERS)
    assert (choice.pod, choice.decision) == ("pod-c", PREFIX_HIT)
    hot = {"pod-c": EndpointLoad(queue_depth=50, fresh=True)}
    choice = choose(s, hashes, PODS, hot, now=1.0, adapter="chat", adapters=ADAPTERS)
    assert (choice.pod, choice.decision) == ("pod-b", OVERLOADED)
    # The same prompt for the base model shares nothing with the adapter's entry.
    base = chunk_hashes("conversation history " * 30)
    assert choose(s, base, PODS, {}, now=1.0).decision == PREFIX_NEW


def test_excluded_holders_fall_back_to_every_pod():
    # Both holders already refused this request: the rest are tried rather than none.
    s = state()
    choice = choose(s, chunk_hashes("p", adapter="sql"), PODS, {}, now=0.0, exclude=["pod-a", "pod-b"],
                    adapter="sql", adapters=ADAPTERS)
    assert choice.pod in ("pod-c", "pod-d")


def test_adapters_from_signals_are_bounded():
    sample = load_from_signals({"lora_adapters": ["sql", "chat", 3, "", "x" * 300]}, at=0.0)
    assert sample.adapters == {"sql", "chat"}
    assert load_from_signals({"lora_adapters": None}, at=0.0).adapters == frozenset()
    many = load_from_signals({"lora_adapters": [f"a{i}" for i in range(5000)]}, at=0.0)
    assert len(many.adapters) == MAX_ADAPTERS


METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE kvserve:lora_adapter_loaded gauge
kvserve:lora_adapter_loaded{lora_name="sql",model_name="m"} 1.0
kvserve:lora_adapter_loaded{lora_name="chat",model_name="m"} 1.0
"""


def test_adapters_from_runtime_metrics():
    assert standardize(METRICS).lora_adapters == ("chat", "sql")
    assert load_from_metrics(METRICS, at=0.0).adapters == {"chat", "sql"}
    assert standardize("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n").lora_adapters is None


def test_poller_reports_adapters_per_pod():
    poller = LoadPoller()
    poller.samples = {"pod-a": Sample(0, 0, 0, True, 0.0, frozenset({"sql"})), "pod-b": Sample(0, 0, 0, True, 0.0)}
    assert poller.adapters() == {"pod-a": {"sql"}}


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_the_router_never_forwards_the_adapter_admin_routes(path):
    # Admin routes of the pods: a router's client (holding a user key at most) never reaches them.
    from kvserve.runtime.router.access import RouteRefused, resolve_route

    with pytest.raises(RouteRefused):
        resolve_route("POST", path)
