"""The router's pure checks: the route allowlist, the credential, the memory-derived limits, and the
hold queue's byte accounting. Tables for the cases the issue names, hypothesis for the rest."""

from __future__ import annotations

import asyncio
import posixpath
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.router.access import ROUTES, RouteRefused, bearer_ok, parse_api_keys, resolve_route
from kvserve.runtime.router.hold import HoldFull, HoldQueue
from kvserve.runtime.router.limits import (
    MIB,
    BodyLimits,
    ByteBudget,
    container_memory_limit,
    max_connections_for_memory,
    parse_memory_limit,
    prefix_index_capacity,
)


@pytest.mark.parametrize("method, target, path, kind, model", [
    ("POST", "/v1/completions", "/v1/completions", "completion", None),
    ("POST", "/v1/chat/completions?stream=1", "/v1/chat/completions", "chat", None),
    ("POST", "/tokenize", "/tokenize", "forward", None),
    ("POST", "/detokenize", "/detokenize", "forward", None),
    ("GET", "/v1/models", "/v1/models", "models", None),
    ("HEAD", "/v1/models", "/v1/models", "models", None),
    ("GET", "/v1/models/HuggingFaceTB/SmolLM2-135M", "/v1/models", "model", "HuggingFaceTB/SmolLM2-135M"),
    ("GET", "/v1/models/my%20model", "/v1/models", "model", "my model"),
])
def test_allowlisted_routes(method, target, path, kind, model):
    route, name = resolve_route(method, target)
    assert (route.path, route.kind, name) == (path, kind, model)


@pytest.mark.parametrize("method, target, status", [
    ("POST", "/v1/../drain", 404), ("POST", "/v1/%2e%2e/drain", 404), ("POST", "/v1/%2E%2e/drain", 404),
    ("POST", "/v1/..%2fdrain", 404), ("POST", "/v1%2fcompletions", 404), ("POST", "/v1%5Ccompletions", 404),
    ("POST", "/v1\\completions", 404), ("POST", "/v1//completions", 404), ("POST", "/v1/completions/", 404),
    ("POST", "/v1/./completions", 404), ("POST", "/v1/completions%00", 404), ("POST", "/v1/%252e%252e/x", 404),
    ("POST", "/v1/completions\t", 404), ("POST", "http://pod/v1/completions", 404), ("POST", "*", 404),
    ("POST", "", 404), ("POST", "/drain", 404), ("POST", "/admin/drain", 404), ("POST", "/v1/embeddings", 404),
    ("GET", "/v1/models/", 404), ("GET", "/v1/models/tiny/", 404), ("GET", "/v1/models/a/../../../drain", 404),
    ("GET", "/v1/models/a%2fb", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("POST", "/v1/models/x", 405),
    ("GET", "/tokenize", 405),
])
def test_refused_routes(method, target, status):
    with pytest.raises(RouteRefused) as refused:
        resolve_route(method, target)
    assert refused.value.status == status
    if status == 405:
        assert "use " in refused.value.message


_path_chars = st.sampled_from(list("abcv1/.%2eEfF5cC\\") + ["%2e", "%2f", "%5c", "..", "//", "/v1/", "models"])


@settings(max_examples=500, deadline=None)
@given(st.lists(_path_chars, max_size=12).map("".join), st.sampled_from(["GET", "POST", "HEAD"]))
def test_an_accepted_path_means_what_it_says(tail, method):
    """Whatever a pod or client library does to a path (decode it, resolve its dot segments), an
    accepted one stays the same path; and the upstream path is always one of the allowlist's."""
    target = "/v1/" + tail
    try:
        route, model = resolve_route(method, target)
    except RouteRefused:
        return
    path = target.split("?", 1)[0]
    # Decoding it (once, or twice) gives no dot segment, empty segment or new "/" to resolve.
    for decoded in (path, unquote(path), unquote(unquote(path))):
        assert posixpath.normpath(decoded) == decoded and decoded.count("/") == path.count("/")
    assert route.path in {r.path for r in ROUTES.values()}
    if model is None:
        assert path == route.path  # a forwarded route is exactly one of the allowlist's
    else:
        assert route.path == "/v1/models" and not {".", ".."} & set(model.split("/"))


def test_bearer_ok():
    keys = ("k1", "k-two")
    assert bearer_ok("Bearer k1", keys) and bearer_ok("bearer k-two", keys) and bearer_ok("Bearer  k1 ", keys)
    for header in (None, "", "k1", "Bearer", "Bearer ", "Basic k1", "Bearer k", "Bearer k1k1", "Bearer K1"):
        assert not bearer_ok(header, keys), header
    assert not bearer_ok("Bearer ", ())


@pytest.mark.parametrize("text, keys", [(None, ()), ("", ()), ("k", ("k",)), ("a, b", ("a", "b"))])
def test_parse_api_keys(text, keys):
    assert parse_api_keys(text) == keys


@pytest.mark.parametrize("text, message", [("a,,b", "key 2 of 3 in the comma-separated list is empty"),
                                           ("a,", "key 2 of 2"), ("a b", "visible ASCII"), ("clé", "visible ASCII")])
def test_bad_api_keys(text, message):
    with pytest.raises(ValueError, match=message):
        parse_api_keys(text)


@pytest.mark.parametrize("text, limit", [("max\n", None), ("536870912\n", 512 * MIB), ("", None), ("junk", None),
                                         ("9223372036854771712", None), ("0", None)])
def test_parse_memory_limit(text, limit):
    assert parse_memory_limit(text) == limit


def test_container_memory_limit_reads_v2_then_v1():
    files = {"/v1": "268435456"}

    def read(path):
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    assert container_memory_limit(("/v2", "/v1"), read) == 256 * MIB
    files["/v2"] = "max"
    assert container_memory_limit(("/v2", "/v1"), read) == 256 * MIB  # v2 unlimited: v1 may still say
    files["/v2"] = str(128 * MIB)
    assert container_memory_limit(("/v2", "/v1"), read) == 128 * MIB
    assert container_memory_limit(("/none",), read) is None


@pytest.mark.parametrize("memory, body, held, buffered, index", [
    (None, 8 * MIB, 128 * MIB, 256 * MIB, 167_772),  # no limit: a 512 MiB router pod's
    (512 * MIB, 8 * MIB, 128 * MIB, 256 * MIB, 167_772),
    (2048 * MIB, 8 * MIB, 512 * MIB, 1024 * MIB, 200_000),
    (64 * MIB, 4 * MIB, 16 * MIB, 32 * MIB, 20_971),
    (1 * MIB, 64 << 10, 256 << 10, 512 << 10, 10_000),
])
def test_limits_follow_the_memory_limit(memory, body, held, buffered, index):
    limits = BodyLimits.for_memory(memory)
    assert (limits.max_request_body_bytes, limits.max_held_bytes, limits.max_buffered_bytes) == (body, held, buffered)
    assert prefix_index_capacity(memory) == index
    assert max_connections_for_memory(memory) == max(64, (memory or 512 * MIB) // (64 << 10))


@pytest.mark.parametrize("field, value", [("max_held_bytes", -1), ("max_buffered_bytes", 1.5),
                                          ("max_request_body_bytes", 0)])
def test_bad_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BodyLimits(**{field: value})


def test_byte_budget_never_goes_over():
    budget = ByteBudget(10)
    assert budget.take(6) and not budget.take(5) and budget.take(4) and budget.used == 10
    budget.give(6)
    assert budget.used == 4 and budget.take(0)
    with pytest.raises(ValueError):
        budget.take(-1)


async def test_hold_queue_counts_places_and_bytes_until_each_leaves():
    queue = HoldQueue(max_held=3, timeout=5, max_held_bytes=100)
    a = queue.admit(60)
    with pytest.raises(HoldFull, match="--max-held-bytes 100"):
        queue.admit(41)
    b = queue.admit(40)
    with pytest.raises(HoldFull, match="--max-held-bytes"):
        queue.grow(b, 1)
    assert (len(queue), queue.held_bytes) == (2, 100) and queue.must_hold()
    queue.leave(a)
    queue.leave(a)  # twice is once
    queue.grow(b, 10)
    assert (len(queue), queue.held_bytes) == (1, 50)
    waiter = asyncio.create_task(queue.wait(b))
    await asyncio.sleep(0)
    queue.set_available(True)
    ticket, _ = await asyncio.wait_for(waiter, 1)
    ticket.sent.set()
    assert (len(queue), queue.held_bytes) == (0, 0) and not queue.must_hold()
    with pytest.raises(HoldFull, match="--max-held 0"):
        HoldQueue(max_held=0, timeout=1).admit()
