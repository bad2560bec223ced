"""KV events (runtime/kv_events): the block pool's reports, vLLM's wire shape, the ZMQ publisher
(real PUB/ROUTER sockets read by a real SUB/REQ socket), and an engine's events naming exactly the
blocks its prefix cache holds."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.prefix_cache import block_hashes
from kvserve.runtime.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    KVEventSink,
    decode_batch,
    encode_batch,
)
from kvserve.runtime.kv_events.publisher import END_SEQ, ZmqEventPublisher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the block pool's reports --------------------------------------------------------------------
def test_block_pool_reports_stored_runs_evictions_and_clears():
    bm = BlockManager(4, 2, enable_caching=True)
    sink = bm.events = KVEventSink(2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, 2)
    bm.allocate_slots(0, 0, 6)
    bm.register(0, hashes[:2], tokens)
    bm.register(0, hashes, tokens)  # only the new block is reported
    assert sink.take() == [BlockStored(hashes[:2], None, [1, 2, 3, 4], 2),
                           BlockStored(hashes[2:], hashes[1], [5, 6], 2)]
    bm.free(0)
    # A second sequence with the same content: already cached, nothing new to tell.
    bm.allocate_slots(1, 0, 2)
    bm.register(1, hashes[:1], tokens)
    assert sink.take() == []
    bm.free(1)
    # Allocating past the free key-less block evicts cached ones, oldest first, in one event.
    bm.allocate_slots(2, 0, 8)
    events = sink.take()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved) and sorted(events[0].block_hashes) == sorted(hashes)
    bm.reset_prefix_cache()
    assert sink.take() == [AllBlocksCleared()]
    bm.check_invariants()


def test_sink_merges_removals_and_a_clear_supersedes_the_step():
    sink = KVEventSink(16)
    sink.removed([b"a"])
    sink.removed([b"b"])
    sink.removed([b"c"], medium="DISK")
    assert sink.take() == [BlockRemoved([b"a", b"b"]), BlockRemoved([b"c"], "DISK")]
    sink.stored([b"x"], None, [1] * 16, medium="CPU")
    sink.cleared()
    assert sink.take() == [AllBlocksCleared()]


# -- wire shape ----------------------------------------------------------------------------------
def test_encoding_is_vllms_array_like_tagged_shape():
    batch = EventBatch(12.5, [BlockStored([b"h1", b"h2"], b"h0", [1, 2, 3, 4], 2, None, "GPU"),
                              BlockRemoved([b"h0"], "GPU"), AllBlocksCleared()])
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw == [12.5, [["BlockStored", [b"h1", b"h2"], b"h0", [1, 2, 3, 4], 2, None, "GPU", None],
                          ["BlockRemoved", [b"h0"], "GPU"], ["AllBlocksCleared"]]]
    assert decode_batch(encode_batch(batch)) == batch
    # An adapter's blocks: lora_id, medium, lora_name (vLLM's field order).
    lora = EventBatch(1.0, [BlockStored([b"h1"], None, [1, 2], 2, 2**62 + 5, "GPU", "chat")])
    assert msgpack.unpackb(encode_batch(lora), raw=False)[1][0][5:] == [2**62 + 5, "GPU", "chat"]
    assert decode_batch(encode_batch(lora)) == lora
    ranked = EventBatch(1.0, [], 3)
    assert msgpack.unpackb(encode_batch(ranked)) == [1.0, [], 3] and decode_batch(encode_batch(ranked)) == ranked
    # vLLM without lora_id/medium (older releases) and integer hashes decode too.
    assert decode_batch(msgpack.packb([1.0, [["BlockStored", [7], None, [1], 1]]])).events == [
        BlockStored([7], None, [1], 1, None, None)]
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]]),
                msgpack.packb([1.0, [["BlockRemoved", "x"]]]),
                msgpack.packb([1.0, [["BlockStored", [7], None, [1], 1, "id", "GPU", "x"]]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


def test_config_follows_vllm_and_names_bad_fields():
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().active
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert on.publisher == "zmq" and on.endpoint == "tcp://*:5557" and on.buffer_steps == 10_000 and on.active
    for bad, field in (('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": 0}', "buffer_steps"),
                       ('{"endpoint": "5557"}', "endpoint"), ('{"topics": "x"}', "topics"), ("[1]", "")):
        with pytest.raises(ValueError, match=f"kv_events_config{'.' + field if field else ''}"):
            KVEventsConfig.parse(bad)


# -- the publisher over real sockets -------------------------------------------------------------
@pytest.fixture
def publisher():
    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                                           replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=3, topic="kv"))
    yield pub, pub_port, replay_port
    pub.close()


def subscribe(ctx, port, topic=b"kv"):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def receive(sub, timeout_ms=5000):
    assert sub.poll(timeout_ms), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def test_publisher_sends_numbered_batches_and_replays_them(publisher):
    pub, pub_port, replay_port = publisher
    ctx = zmq.Context()
    sub = subscribe(ctx, pub_port)
    try:
        # PUB drops what is sent before a subscriber's connection completes: send until one lands.
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline
            pub.publish([AllBlocksCleared()])
        while sub.poll(200):
            last = sub.recv_multipart()
        first_live = int.from_bytes(last[1], "big")
        pub.publish([BlockStored([b"h1"], None, [1, 2], 2)])
        topic, seq, batch = receive(sub)
        assert topic == b"kv" and seq == first_live + 1
        assert batch.events == [BlockStored([b"h1"], None, [1, 2], 2, None, "GPU")] and batch.ts > 0
        # Replay, as vLLM's example subscriber asks for it (a REQ socket, 8-byte start seq).
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send(seq.to_bytes(8, "big"))
        assert req.poll(5000)
        got_seq, payload = req.recv_multipart()
        assert int.from_bytes(got_seq, "big") == seq and decode_batch(payload) == batch
        # Asking for what fell out of the buffer (3 batches kept) gives what is left, then the end.
        for _ in range(3):
            pub.publish([AllBlocksCleared()])
            seq = receive(sub)[1]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000)
            _, s, p = dealer.recv_multipart()
            if s == END_SEQ:
                assert p == b""
                break
            seqs.append(int.from_bytes(s, "big"))
        assert seqs == list(range(seq - 2, seq + 1))
        # A malformed request gets just the end marker.
        dealer.send_multipart([b"", b"xyz"])
        assert dealer.poll(5000) and dealer.recv_multipart()[1] == END_SEQ
    finally:
        ctx.destroy(linger=0)


def test_a_full_queue_drops_the_oldest_batch_and_counts_it():
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}",
                                           max_queue_size=2))
    try:
        with pub._lock:  # the thread cannot take anything meanwhile
            for i in range(5):
                pub.publish([BlockRemoved([bytes([i])])])
            assert pub.dropped == 3 and [e[1][0].block_hashes for e in pub._queue] == [[b"\x03"], [b"\x04"]]
        deadline = time.monotonic() + 5
        while pub.published < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        pub.close()


def test_a_taken_port_is_a_value_error_naming_the_config():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match="kv_events_config"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))


# -- the engine ----------------------------------------------------------------------------------
def test_engine_events_name_the_prefix_cache_blocks(tiny_llama):
    port, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
    engine = LLMEngine.from_args(model=str(tiny_llama), block_size=4, num_kv_blocks=12, max_num_seqs=2,
                                 kv_events_config=config)
    ctx = zmq.Context()
    try:
        prompt = list(range(3, 21))  # 18 tokens: 4 full blocks
        params = SamplingParams(max_tokens=3, temperature=0.0)
        engine.add_request("a", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
        # Replay from 0 (a subscriber that joins late): the stored chain is exactly the prompt's.
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{replay}")
        deadline = time.monotonic() + 10
        stored: list[BlockStored] = []
        while not stored or sum(len(e.block_hashes) for e in stored) < 5:
            assert time.monotonic() < deadline, stored
            req.send_multipart([b"", (0).to_bytes(8, "big")])
            stored = []
            while True:
                assert req.poll(5000)
                _, s, p = req.recv_multipart()
                if s == END_SEQ:
                    break
                stored += [e for e in decode_batch(p).events if isinstance(e, BlockStored)]
            time.sleep(0.05)
        chain = [h for e in stored for h in e.block_hashes]
        out_tokens = prompt  # the first 4 blocks are the prompt's; the 5th holds 2 prompt + 2 generated
        assert chain[:4] == block_hashes(out_tokens, 4)
        assert stored[0].parent_block_hash is None and stored[0].block_size == 4
        assert [t for e in stored for t in e.token_ids][:16] == prompt[:16]
        assert all(e.medium == "GPU" for e in stored)
    finally:
        ctx.destroy(linger=0)
        engine.close()
    with pytest.raises(ValueError, match="kv_events_config"):
        LLMEngine.from_args(model=str(tiny_llama), enable_prefix_caching=False, kv_events_config=config)


# Data-parallel engines share one publisher (engine 0 binds the pod's one endpoint, the others
# publish through it): tests/test_reshape.py test_data_parallel_engines_share_one_kv_events_endpoint.
