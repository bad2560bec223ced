"""Which speculative verification steps replay CUDA graphs: the pure policy.

A verification step runs each speculating sequence's pending token and its drafts. When every
sequence of the step has the same query length q, the step is *uniform* and one graph per
(batch-size bucket, q) replays it (runtime/executor/cuda_graphs.py's DecodeGraphs with
``query_len=q``). The query lengths worth capturing follow from ``speculative_config``:

- a chain (n-gram, draft model, EAGLE, MTP, Medusa without a tree): q = 1 + k;
- a candidate tree (``speculative_token_tree``): q = the tree's node count (root included),
  captured with tree masks; a request that verifies the tree's top-1 chain instead (a sampled
  one) runs 1 + min(k, the chain's depth) rows, a second, chain graph family.

Batch sizes are the decode capture sizes whose steps stay within ``max_capture_size`` tokens
(vLLM's uniform-decode rule: a bucket of b sequences holds b x q tokens). A step whose queries are
all at most q rows but not all q (the n-gram lookup found fewer drafts, or none) is padded up to
q by runtime/executor/verify_padding.py. Anything else (a prefill in the step, a batch past the
largest bucket) runs eagerly, and so does every multi-token step of a model with multi-head
latent attention (its attention plans such steps on the host).
"""

from __future__ import annotations


def verify_query_lens(spec_config) -> dict[int, bool]:
    """Query length -> whether its graphs hold tree masks, for a speculative config (None: {})."""
    if spec_config is None:
        return {}
    k = spec_config.num_speculative_tokens
    choices = spec_config.speculative_token_tree
    if choices is None:
        return {1 + k: False}
    from kvserve.runtime.spec_decode.tree_verify import Tree

    tree = Tree(choices)
    chain_q = 1 + min(k, len(tree.chain) - 1)
    lens = {chain_q: False}
    # A tree whose nodes are all the top-1 chain verifies as a chain (no masks in its steps).
    if not tree.is_chain(tree.full.num_nodes):
        lens[tree.full.num_nodes] = True  # a tree graph also runs chain steps of its length
    return lens


def verify_capture_sizes(decode_sizes: list[int], query_len: int, max_capture_tokens: int) -> list[int]:
    """The batch sizes (in sequences) captured for steps of `query_len` tokens per sequence."""
    return [s for s in decode_sizes if s * query_len <= max_capture_tokens]


def why_no_verify_graphs(model_config) -> str | None:
    """Why this target's verification steps cannot be captured, or None."""
    if getattr(model_config.shape, "mla", None) is not None:
        return "multi-head latent attention plans multi-token steps on the host"
    return None
