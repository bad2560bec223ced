"""EAGLE tree drafting (`speculative_token_tree` with method eagle / eagle3): the draft layer
expands a static tree depth by depth (each node's children are its top-k guesses, each node
attending to the sequence and its own ancestors only), and the target verifies the tree in one
forward pass with Medusa's tree verifier.

The oracle for the drafter is the chain drafter itself: a node's token must be what the chain
gives when the tokens above it are forced to its ancestors' ranks. The oracle for the engine is
greedy decoding without speculation, token for token, with no block leaked.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import H, base_config, random_head, target_copy_head  # noqa: E402  (tests/ is on sys.path via conftest)
from test_spec_decode import (  # noqa: E402
    GREEDY,
    assert_tree_nodes_are_forced_chains,
    grounded_prompts,
    make_engine,
    record_accepted_paths,
    run_checked,
)

from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.eagle import save_eagle_head
from kvserve.runtime.spec_decode.tree_verify import Tree

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


def test_config():
    for method in ("eagle", "eagle3"):
        cfg = SpeculativeConfig.parse({"method": method, "model": "/h", "speculative_token_tree": str(TREE)})
        assert cfg.num_speculative_tokens == 3 and len(cfg.speculative_token_tree) == len(TREE)
    with pytest.raises(ValueError, match="speculative_token_tree: only used with methods"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": TREE})


def test_every_node_is_the_chain_forced_down_its_path(tiny_llama, tmp_path):
    path = save_eagle_head(random_head(std=0.2), tmp_path / "h", base_config=base_config())
    engine = make_engine(tiny_llama, {"method": "eagle", "model": str(path), "speculative_token_tree": TREE})
    prop = engine.spec_decoder.eagle
    tree = Tree(TREE)
    torch.manual_seed(0)
    n = 21
    bs = prop.block_size
    scattered = [5, 2, 9, 11, 3, 6, 1, 8]  # past a block boundary: the context spans scattered blocks
    fills = [(scattered[:-(-n // bs)], list(range(n)), torch.randint(0, 512, (n,)).tolist(), torch.randn(n, H) * 3),
             ([7, 4, 10][:-(-9 // bs)], list(range(9)), torch.randint(0, 512, (9,)).tolist(), torch.randn(9, H) * 3)]
    nodes = prop.step(fills, [3, 3], tree=tree.full)
    assert_tree_nodes_are_forced_chains(prop, tree, fills, nodes, argmax="_logits_argmax",
                                        pick_rank=lambda out, r: prop._logits_topk(out, r + 1)[:, r])


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    outs = run_checked(make_engine(tiny_llama), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["eagle_random", "eagle_target_copy", "eagle3_random"])
def test_greedy_with_a_tree_equals_greedy_without(tiny_llama, greedy_reference, tmp_path, kind):
    method = kind.split("_")[0]
    head = {"eagle_random": lambda: random_head(), "eagle_target_copy": target_copy_head,
            "eagle3_random": lambda: random_head(True, draft_vocab=200)}[kind]()
    path = save_eagle_head(head, tmp_path / kind, base_config=base_config(),
                           aux_layers=(1, 2, 2) if method == "eagle3" else ())
    # Small pool and step budget: preemption, prefix-cache hits and trees cut short happen.
    engine = make_engine(tiny_llama, {"method": method, "model": str(path), "speculative_token_tree": TREE},
                         num_kv_blocks=48, max_num_batched_tokens=24)
    spec = engine.spec_decoder
    seen = record_accepted_paths(engine)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0 and seen
    if kind == "eagle_target_copy":
        # Accepted paths that leave the top-1 chain: the branches' masks, positions, moved K/V
        # and the head's refilled slots (from the path's rows, not the first rows) all held.
        assert any(n not in spec.tree.chain for p in seen for n in p), seen[:20]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
