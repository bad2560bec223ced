"""The router's event-fed index: the pure index and scoring (tables), the subscription shell against
a real ZMQ publisher with faults injected (dropped batches, a pod restart, a dead replay socket),
and the router's prompt hashes equal to the runtime's."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvserve.runtime.engine.prefix_cache import block_hashes
from kvserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventsConfig
from kvserve.runtime.kv_events.publisher import ZmqEventPublisher
from kvserve.runtime.router.endpoints import Endpoint, endpoints_from_pods, events_endpoints
from kvserve.runtime.router.kv_events import KVEventSubscriptions
from kvserve.runtime.router.kv_index import LIVE, PARTIAL, SYNCING, KVIndexConfig, PodKVIndex, PreciseMatch
from kvserve.runtime.router.policy import PREFIX_HIT, EndpointLoad, PolicyConfig, PolicyState, choose

H = [bytes([i]) * 4 for i in range(10)]


def stored(*hashes, medium="GPU"):
    return BlockStored(list(hashes), None, [], 4, None, medium)


def batch(*events):
    return EventBatch(0.0, list(events))


# -- the index: a table of streams -------------------------------------------------------------
def live_index(**config):
    index = PodKVIndex(KVIndexConfig(**config))
    index.start_replay()
    index.replay_done(0.0)
    return index


def test_index_follows_stored_removed_cleared_per_medium():
    index = live_index()
    assert index.live(0, batch(stored(H[0], H[1], H[2])), 1.0) is None
    assert index.match(H[:4]) == 3
    index.live(1, batch(stored(H[2], medium="DISK"), BlockRemoved([H[2]], "GPU")), 1.0)
    assert index.match(H[:3]) == pytest.approx(2.5)  # the third block now only on disk
    index.live(2, batch(stored(H[1], medium="CPU"), BlockRemoved([H[1]], "GPU")), 1.0)
    assert index.match(H[:3]) == pytest.approx(1 + 0.8 + 0.5)
    index.live(3, batch(BlockRemoved([H[0]])), 1.0)
    assert index.match(H[:3]) == 0  # a prefix needs its first block
    index.live(4, batch(AllBlocksCleared()), 1.0)
    assert len(index) == 0 and index.state == LIVE and index.last_seq == 4


def test_index_caps_blocks_per_pod_forgetting_the_oldest():
    index = live_index(max_blocks_per_pod=3)
    index.live(0, batch(stored(*H[:5])), 0.0)
    assert len(index) == 3 and index.match(H[2:5]) == 3 and index.match(H[:1]) == 0
    assert index.stats["evicted"] == 2


@pytest.mark.parametrize("name, steps, want_replay, want_state, want_blocks", [
    # A gap asks for a replay from the first missing seq; the batch waits meanwhile.
    ("gap", [("live", 0, 0), ("live", 2, 2)], 1, SYNCING, {0}),
    # Filled by the replay, the waiting batch follows: every block, in order.
    ("gap filled", [("live", 0, 0), ("live", 2, 2), ("replay", 1, 1), ("done",)], None, LIVE, {0, 1, 2}),
    # The pod's buffer no longer has seq 1: partial.
    ("gap unfillable", [("live", 0, 0), ("live", 3, 3), ("replay", 2, 2), ("done",)], None, PARTIAL, {0, 2, 3}),
    # Seqs start over: the pod restarted; the index is cleared and replayed from 0.
    ("restart", [("live", 0, 0), ("live", 1, 1), ("live", 0, 5)], 0, SYNCING, set()),
    ("restart replayed", [("live", 0, 0), ("live", 1, 1), ("live", 0, 5), ("replay", 0, 5), ("done",)],
     None, LIVE, {5}),
    # Live copies of replayed batches are duplicates, not a restart.
    ("duplicates", [("live", 0, 0), ("live", 2, 2), ("replay", 1, 1), ("replay", 2, 2), ("done",), ("live", 2, 2),
                    ("live", 3, 3)], None, LIVE, {0, 1, 2, 3}),
    # No answer to the replay: live from here, partial.
    ("replay failed", [("live", 0, 0), ("live", 2, 2), ("failed",), ("live", 3, 3)], None, PARTIAL, {0, 2, 3}),
])
def test_index_sequence_table(name, steps, want_replay, want_state, want_blocks):
    index = live_index()
    need = None
    for step in steps:
        if step[0] == "live":
            need = index.live(step[1], batch(stored(H[step[2]])), 1.0)
            if need is not None:
                assert index.start_replay() == need
        elif step[0] == "replay":
            index.replayed(step[1], batch(stored(H[step[2]])), 1.0)
        elif step[0] == "done":
            need = index.replay_done(1.0)
        elif step[0] == "failed":
            index.replay_failed()
            need = None
    assert need == want_replay and index.state == want_state
    assert {i for i in range(10) if H[i] in index.blocks} == want_blocks


def test_data_parallel_engines_are_indexed_apart():
    """One pod, two DP engines on one stream: a block one engine evicts (or a clear of its pool)
    leaves the other's copy held; the pod's match is its best engine's, not the union."""
    index = live_index()
    index.live(0, EventBatch(1.0, [stored(H[0], H[1])], 0), now=1.0)
    index.live(1, EventBatch(1.0, [stored(H[0]), stored(H[2])], 1), now=1.0)
    index.live(2, EventBatch(1.0, [BlockRemoved([H[0]])], 1), now=1.0)
    assert index.match([H[0], H[1]]) == 2  # engine 0 still holds H0
    assert index.match([H[0], H[2]]) == 1  # no engine holds H0 and H2 together
    index.live(3, EventBatch(1.0, [AllBlocksCleared()], 0), now=1.0)
    assert index.match([H[0]]) == 0 and H[2] in index.blocks and len(index) == 1
    # An untagged clear is the whole pod's (a live reshape): every engine starts empty.
    index.live(4, EventBatch(1.0, [AllBlocksCleared()]), now=1.0)
    assert len(index) == 0 and index.match([H[2]]) == 0
    index.live(5, EventBatch(1.0, [stored(H[1])]), now=1.0)  # one engine now, untagged
    assert index.match([H[1]]) == 1 and len(index) == 1


def test_trusted_only_live_and_caught_up():
    index = live_index(lag_seconds=5)
    index.live(0, batch(stored(H[0])), now=10.0)
    assert index.trusted(11.0, None) and index.trusted(11.0, last_routed=9.0)
    assert index.trusted(12.0, last_routed=11.0)  # sent 1 s ago: its events may still be coming
    assert not index.trusted(17.0, last_routed=11.0)  # sent 6 s ago, nothing since: lagging
    index.live(1, batch(stored(H[1])), now=17.5)
    assert index.trusted(18.0, last_routed=11.0)
    index.reset()
    assert not index.trusted(18.0, None)


# -- scoring: events over what was served ------------------------------------------------------
PODS = ["a", "b", "c"]
IDLE = {p: EndpointLoad() for p in PODS}


def policy_after_serving(pod: str, hashes: list[int]) -> PolicyState:
    state = PolicyState(PolicyConfig())
    state.set_pods(PODS)
    state.record(hashes, pod, 0.0)
    return state


@pytest.mark.parametrize("name, precise, want_pod, want_decision", [
    ("served only", None, "a", PREFIX_HIT),
    # a's events say the prefix was evicted there, c's that c holds it (a tier counts too).
    ("events know better", PreciseMatch(10, {"a": 0, "b": 0, "c": 9}), "c", PREFIX_HIT),
    ("tier copy", PreciseMatch(10, {"a": 0, "b": 0, "c": 10 * 0.8}), "c", PREFIX_HIT),
    # Not even its first block anywhere: evicted everywhere, or hashed unlike the pods (a guard
    # against a router/runtime mismatch): what was served decides.
    ("held nowhere", PreciseMatch(10, {"a": 0, "b": 0, "c": 0}), "a", PREFIX_HIT),
    # Held by none of the pods that served it, by c only in part: with every pod idle, c's 2
    # blocks beat the new-prompt pod's none by more than the margin.
    ("evicted on a", PreciseMatch(10, {"a": 0, "b": 0, "c": 2}), "c", PREFIX_HIT),
    # a's events are missing (not in held): its served record stands; b's events show less.
    ("a without events", PreciseMatch(10, {"b": 6, "c": 0}), "a", PREFIX_HIT),
    # A partial index is a floor under what was served.
    ("partial floor", PreciseMatch(10, {"a": 0, "b": 0}, {"c": 10}), "c", PREFIX_HIT),
])
def test_choose_with_events_table(name, precise, want_pod, want_decision):
    hashes = list(range(1, 9))
    state = policy_after_serving("a", hashes)
    choice = choose(state, hashes, PODS, IDLE, 1.0, precise=precise)
    assert choice.decision == want_decision
    if want_pod:
        assert choice.pod == want_pod


def test_events_endpoints_from_flag_and_annotation():
    assert events_endpoints("10.0.0.5", 5557) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert events_endpoints("fd00::1", 5557) == ("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558")
    assert events_endpoints("10.0.0.5", None) is None

    def pod(name, ip, annotations=None):
        return {"metadata": {"name": name, "labels": {"x": "y"}, "annotations": annotations or {}},
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    pods = [pod("p1", "10.0.0.1"), pod("p2", "10.0.0.2", {"kvserve.dev/kv-events-port": "6000"}),
            pod("p3", "10.0.0.3", {"kvserve.dev/kv-events-port": "bogus"})]
    got = {e.name: e.events for e in endpoints_from_pods(pods, selector={"x": "y"}, runtime_port=8000,
                                                         agent_port=None, events_port=5557)}
    assert got == {"p1": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
                   "p2": ("tcp://10.0.0.2:6000", "tcp://10.0.0.2:6001"),
                   "p3": ("tcp://10.0.0.3:5557", "tcp://10.0.0.3:5558")}
    assert all(e.events is None for e in endpoints_from_pods(pods[:1], selector={"x": "y"}, runtime_port=8000,
                                                             agent_port=None))


# -- the subscription shell against a real publisher, faults injected ---------------------------
def free_ports() -> int:
    """A port p with p + 1 free too (publisher and replay socket)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            with socket.socket() as s2:
                try:
                    s2.bind(("0.0.0.0", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


class LossyPublisher(ZmqEventPublisher):
    """Sends nothing live for the seqs in `drop` (they stay in the replay buffer): a lossy network."""

    drop: set[int] = set()

    def _send_live(self, seq, payload, zmq):
        if seq not in self.drop:
            super()._send_live(seq, payload, zmq)


def start_publisher(port, cls=ZmqEventPublisher, replay=True, **kw):
    return cls(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                              replay_endpoint=f"tcp://*:{port + 1}" if replay else None, **kw))


async def until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_subscription_replays_dropped_batches_and_late_joins():
    port = free_ports()

    async def main():
        pub = start_publisher(port, LossyPublisher)
        pub.drop = {1, 3}
        subs = KVEventSubscriptions(replay_timeout=2.0)
        try:
            pub.publish([stored(H[0])])  # before anyone listens: the first resync replays it
            await until(lambda: pub.published == 1)
            subs.set_endpoints([Endpoint("pod", "http://x", None, events_endpoints("127.0.0.1", port))])
            index = subs.indexes["pod"]
            await until(lambda: index.state == LIVE and index.last_seq == 0, what="initial replay")
            for i in range(1, 6):
                pub.publish([stored(H[i])])
            await until(lambda: index.last_seq == 5, what="gaps filled")
            assert set(index.blocks) == set(H[:6]) and index.state == LIVE
            assert index.stats["gaps"] >= 1
            assert subs.status()["pod"]["blocks"] == 6
            keys = H[:3]
            got = subs.precise(lambda size, lora=None: keys, ["pod", "other"])
            assert got.total_blocks == 3 and got.held == {"pod": 3}
            subs.set_endpoints([])  # the pod went away: its index with it
            assert subs.indexes == {}
        finally:
            await subs.stop()
            pub.close()

    run(main())


def test_subscription_clears_a_restarted_pod():
    port = free_ports()

    async def main():
        pub = start_publisher(port)
        subs = KVEventSubscriptions(replay_timeout=2.0)
        try:
            subs.set_endpoints([Endpoint("pod", "http://x", None, events_endpoints("127.0.0.1", port))])
            index = subs.indexes["pod"]
            await until(lambda: index.state == LIVE, what="connected")
            for i in range(4):
                pub.publish([stored(H[i])])
            await until(lambda: index.last_seq == 3)
            pub.close()
            await until(lambda: index.state == "down", what="disconnect seen")
            # The new process starts its own stream (seq 0) and holds other blocks.
            pub = start_publisher(port)
            pub.publish([stored(H[7])])
            await until(lambda: set(index.blocks) == {H[7]} and index.state == LIVE, what="restart resync")
            assert index.last_seq == 0
        finally:
            await subs.stop()
            pub.close()

    run(main())


def test_subscription_without_replay_answers_is_partial_and_not_trusted():
    port = free_ports()

    async def main():
        pub = start_publisher(port, LossyPublisher, replay=False)
        subs = KVEventSubscriptions(replay_timeout=0.3, resync_interval=60)
        try:
            subs.set_endpoints([Endpoint("pod", "http://x", None, events_endpoints("127.0.0.1", port))])
            index = subs.indexes["pod"]
            await until(lambda: index.state == PARTIAL, what="replay timeout")
            pub.drop = {1}
            for i in range(3):
                pub.publish([stored(H[i])])
            await until(lambda: H[2] in index.blocks, what="live batches")
            assert index.state == PARTIAL and H[1] not in index.blocks
            got = subs.precise(lambda size, lora=None: H[:1], ["pod"])
            assert got.held == {} and got.partial == {"pod": 1}
        finally:
            await subs.stop()
            pub.close()

    run(main())


# -- the router's hashes are the runtime's -----------------------------------------------------
def test_router_prompt_hashes_equal_the_runtimes(tiny_llama):
    from transformers import AutoTokenizer

    from kvserve.runtime import LLMEngine, SamplingParams
    from kvserve.runtime.router.prompt_keys import PromptKeys

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    keys = PromptKeys(tok, max_chars=400)
    body = {"model": "tiny", "messages": [{"role": "system", "content": "You are terse."},
                                          {"role": "user", "content": "cache prefix token block " * 8}]}
    ids, cut = keys.token_ids("chat", body)
    assert not cut
    engine = LLMEngine.from_args(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_num_seqs=1)
    try:
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        engine.add_request("r", {"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]},
                           SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        held = set(engine.block_manager.cached)
    finally:
        engine.close()
    want = block_hashes(ids, 4)
    assert want and set(want) <= held
    assert keys.token_ids("completion", {"model": "tiny", "prompt": [5, 6, 7]}) == ([5, 6, 7], False)
    assert keys.token_ids("chat", {"model": "tiny", "messages": []}) is None  # the server's 400
    long = {"model": "tiny", "prompt": "word " * 200}
    ids_cut, cut = keys.token_ids("completion", long)
    assert cut and len(ids_cut) < len(tok("word " * 200)["input_ids"])


@pytest.mark.parametrize("route, body, want", [
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
     ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}, False)),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
              "tools": [{"type": "function", "function": {"name": "f"}}]},
     ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
       "tools": [{"type": "function", "function": {"name": "f"}}]}, False)),
    # Options /tokenize does not take: the pods' hashes cannot be known, served-based then.
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}, None),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, None),
    ("chat", {"model": "m", "messages": []}, None),
    ("completion", {"model": "m", "prompt": "abc"}, ({"model": "m", "prompt": "abc", "add_special_tokens": True}, False)),
    ("completion", {"model": "m", "prompt": ["abc", "d"], "add_special_tokens": False},
     ({"model": "m", "prompt": "abc", "add_special_tokens": False}, False)),
    ("completion", {"model": "m", "prompt": "x" * (64 * 1024 + 1)},
     ({"model": "m", "prompt": "x" * (64 * 1024), "add_special_tokens": True}, True)),
    ("completion", {"model": "m", "prompt": ""}, None),
])
def test_remote_tokenize_request_table(route, body, want):
    from kvserve.runtime.router.prompt_keys import tokenize_request

    assert tokenize_request(route, body) == want
