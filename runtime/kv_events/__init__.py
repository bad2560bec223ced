"""KV cache events in vLLM's format: what the block pool (and the offload tier) stored and dropped,
published per engine step over ZMQ so that a router (kvserve's, llm-d's indexer, Dynamo's) can
know which blocks each pod holds. See docs/kv-events.md."""

from .config import KVEventsConfig
from .events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSink,
    decode_batch,
    encode_batch,
)
