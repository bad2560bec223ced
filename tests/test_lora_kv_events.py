"""LoRA adapter blocks in KV events (runtime/lora/identity.py): two pods that load the same adapter
(under different lora_int_ids, from different paths, after different other adapters) publish the
same block hashes with the same lora_id and lora_name, which the router rebuilds from the events
alone, so it sends an adapter request to the pod that holds the adapter's prefix; new weights
under an old name are a new key."""

from __future__ import annotations

import shutil
import time

import pytest

from kvserve.runtime.engine.prefix_cache import block_hashes, extra_key
from kvserve.runtime.kv_events import BlockRemoved, BlockStored, EventBatch, decode_batch
from kvserve.runtime.lora.identity import adapter_digest, adapter_id, cache_key
from kvserve.runtime.router.kv_events import KVEventSubscriptions
from kvserve.runtime.router.kv_index import PodKVIndex
from kvserve.runtime.router.policy import EndpointLoad, PolicyConfig, PolicyState, choose
from kvserve.testing.adapters import build_lora_adapters

PROMPT = list(range(50, 66))  # four full blocks of 4
OTHER_PROMPT = list(range(100, 116))


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-events")
    chat, other, chat_v2 = build_lora_adapters(base, {root / "chat": {"r": 4, "seed": 1, "std": 0.1},
                                                      root / "other": {"r": 4, "seed": 2, "std": 0.1},
                                                      root / "chat-v2": {"r": 4, "seed": 3, "std": 0.1}})
    copy = shutil.copytree(chat, root / "elsewhere" / "chat")  # the second pod's own download
    return base, {"chat": chat, "other": other, "chat-v2": chat_v2, "chat-copy": copy}


class Pod:
    """A runtime engine with adapters and KV events on, and a subscriber on its endpoint."""

    def __init__(self, base, endpoint: str):
        import zmq

        from kvserve.runtime import LLMEngine

        self.engine = LLMEngine.from_args(model=str(base), block_size=4, num_kv_blocks=64, max_num_seqs=2,
                                          enable_lora=True, max_loras=2, max_lora_rank=4,
                                          kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: list = []

    def run(self, prompt, lora_request=None) -> list[BlockStored]:
        from kvserve.runtime import SamplingParams

        before = len(self.batches)
        self.engine.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                                SamplingParams(max_tokens=1, temperature=0), lora_request=lora_request)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        # Every run stores blocks: wait for its first batch, then take what follows it.
        while self.sub.poll(10_000 if len(self.batches) == before else 300):
            seq, payload = self.sub.recv_multipart()[1:]
            self.batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        return [e for _, b in self.batches[before:] for e in b.events if isinstance(e, BlockStored)]

    def close(self):
        self.engine.close()
        self.sub.close(0)
        self.context.term()


def test_two_pods_key_an_adapter_alike_and_the_router_finds_its_prefix(adapters, tmp_path):
    from kvserve.runtime import LoRARequest

    base, paths = adapters
    one, two = Pod(base, f"ipc://{tmp_path}/one"), Pod(base, f"ipc://{tmp_path}/two")
    try:
        time.sleep(0.3)  # the subscriptions reach the publishers
        # Pod one knows "other" first and numbers "chat" 2; pod two loads its own copy as 7.
        one.engine.add_lora(LoRARequest("other", 1, str(paths["other"])))
        one.engine.add_lora(LoRARequest("chat", 2, str(paths["chat"])))
        two.engine.add_lora(LoRARequest("chat", 7, str(paths["chat-copy"])))
        on_one = one.run(PROMPT, LoRARequest("chat", 2, str(paths["chat"])))
        on_two = two.run(PROMPT, LoRARequest("chat", 7, str(paths["chat-copy"])))
        base_on_one = one.run(PROMPT)
        two.run(OTHER_PROMPT, LoRARequest("chat", 7, str(paths["chat-copy"])))  # two knows "chat" too

        want_id = adapter_id("chat", adapter_digest(str(paths["chat"])))
        hashes = [h for e in on_one for h in e.block_hashes]
        assert len(hashes) == 4 and hashes == [h for e in on_two for h in e.block_hashes]
        assert {(e.lora_id, e.lora_name) for e in on_one + on_two} == {(want_id, "chat")}
        assert {(e.lora_id, e.lora_name) for e in base_on_one} == {(None, None)}
        assert not set(hashes) & {h for e in base_on_one for h in e.block_hashes}  # apart from the base's
        # What a router computes from the events' lora_id / lora_name: the pods' own hashes.
        assert block_hashes(PROMPT, 4, extra_key(None, cache_key("chat", want_id))) == hashes

        # The router's indexes fed each pod's stream; pod two then lost the adapter's PROMPT blocks.
        subs = KVEventSubscriptions()
        for name, pod in (("one", one), ("two", two)):
            index = subs.indexes[name] = PodKVIndex()
            index.start_replay()
            index.replay_done(0.0)
            for seq, batch in pod.batches:
                assert index.live(seq, batch, 0.0) is None
        assert subs.indexes["one"].adapters == subs.indexes["two"].adapters == {"chat": want_id}
        subs.indexes["two"].live(len(two.batches), EventBatch(0.0, [BlockRemoved(hashes)]), 0.0)

        def keys_for(size, lora_key=None):
            return block_hashes(PROMPT, size or 4, extra_key(None, lora_key))

        precise = subs.precise(keys_for, ["one", "two"], adapter="chat")
        assert precise is not None and precise.held == {"one": 4, "two": 0}
        assert subs.precise(keys_for, ["one", "two"], adapter="unknown") is None  # served-based then
        assert subs.precise(keys_for, ["one", "two"]).held == {"one": 4, "two": 0}  # the base's blocks on one
        # Pod two served the conversation before (the served-based index says two); the events win.
        state = PolicyState(PolicyConfig())
        state.set_pods(["one", "two"])
        served = list(range(1, 5))
        state.record(served, "two", 0.0)
        loads = {"one": EndpointLoad(), "two": EndpointLoad()}
        assert choose(state, served, ["one", "two"], loads, 1.0, precise=precise).pod == "one"

        # New weights under the old name: a new id, a new key (no stale block is ever reused).
        two.engine.remove_lora(7)
        two.engine.add_lora(LoRARequest("chat", 7, str(paths["chat-v2"])))
        assert two.engine.lora.identity(7)[0] != want_id
        assert two.engine.lora.identity(7) == (adapter_id("chat", adapter_digest(str(paths["chat-v2"]))), "chat")
    finally:
        one.close()
        two.close()
