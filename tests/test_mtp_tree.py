"""MTP tree drafting (`speculative_token_tree` with method mtp): the MTP layer expands a static
tree depth by depth (each node's children are its top-k guesses; each node sees the sequence and
its own ancestors only), and the target verifies the tree with the tree verifier Medusa and
EAGLE use (on DeepSeek-V3: MLA's up-projected path with the ancestor mask).

Oracles: for the drafter, the chain drafter forced down each node's ranks; for the engine,
greedy decoding without speculation, token for token, with no block leaked.
"""

from __future__ import annotations

import pytest
import torch
from test_mtp import add_mtp_layer  # noqa: E402  (tests/ is on sys.path via conftest)
from test_spec_decode import (  # noqa: E402
    GREEDY,
    assert_tree_nodes_are_forced_chains,
    grounded_prompts,
    make_engine,
    record_accepted_paths,
    run_checked,
)

from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.tree_verify import Tree

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


@pytest.fixture(scope="module")
def tiny_dsv3(tiny_model_factory):
    return tiny_model_factory("deepseek_v3")


@pytest.fixture(scope="module")
def mtp_models(tiny_dsv3, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_tree")
    return {"random": add_mtp_layer(tiny_dsv3, root / "random"),
            "copy": add_mtp_layer(tiny_dsv3, root / "copy", copy=True)}


def test_config():
    cfg = SpeculativeConfig.parse({"method": "mtp", "speculative_token_tree": str(TREE)})
    assert cfg.num_speculative_tokens == 3 and len(cfg.speculative_token_tree) == len(TREE)


def test_every_node_is_the_chain_forced_down_its_path(mtp_models):
    # max_num_seqs=3: a level's (sequence, node) pairs (4 at depth 1) take more than one round
    # of scratch sets.
    engine = make_engine(mtp_models["random"], {"method": "mtp", "speculative_token_tree": TREE}, max_num_seqs=3)
    prop = engine.spec_decoder.eagle
    tree = Tree(TREE)
    H = prop.layer.hidden_size
    torch.manual_seed(0)
    bs = prop.block_size
    n = 21
    scattered = [5, 2, 9, 11, 3, 6, 1, 8]  # past a block boundary: the context spans scattered blocks
    fills = [(scattered[:-(-n // bs)], list(range(n)), torch.randint(3, 512, (n,)).tolist(), torch.randn(n, H) * 3),
             ([7, 4, 10][:-(-9 // bs)], list(range(9)), torch.randint(3, 512, (9,)).tolist(), torch.randn(9, H) * 3)]
    nodes = prop.step(fills, [3, 3], tree=tree.full)
    assert_tree_nodes_are_forced_chains(prop, tree, fills, nodes, argmax="_argmax",
                                        pick_rank=lambda out, r: prop._topk(out, r + 1)[:, r].tolist())


@pytest.fixture(scope="module")
def greedy_reference(mtp_models):
    outs = run_checked(make_engine(mtp_models["random"]), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["random", "copy"])
def test_greedy_with_a_tree_equals_greedy_without(mtp_models, greedy_reference, kind):
    # Small pool and step budget: preemption, prefix-cache hits and trees cut short happen.
    engine = make_engine(mtp_models[kind], {"method": "mtp", "speculative_token_tree": TREE},
                         num_kv_blocks=48, max_num_batched_tokens=24)
    spec = engine.spec_decoder
    seen = record_accepted_paths(engine)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0 and seen
    if kind == "copy":
        assert s.spec_decode_num_accepted_tokens_total > 0
        # Accepted paths that leave the top-1 chain: the branches' masks, positions, moved K/V
        # and the MTP layer's refilled slots (from the path's rows) all held.
        assert any(n not in spec.tree.chain for p in seen for n in p), seen[:20]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_gqa_family_tree_equals_greedy(tiny_model_factory, tmp_path):
    """A GQA target (Llama with a DeepSeek-layout MTP module: K/V pools, not a latent one)."""
    model = add_mtp_layer(tiny_model_factory("llama"), tmp_path / "copy", copy=True)
    want = run_checked(make_engine(model), grounded_prompts(n=5), GREEDY)
    engine = make_engine(model, {"method": "mtp", "speculative_token_tree": TREE}, num_kv_blocks=48)
    got = run_checked(engine, grounded_prompts(n=5), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0 and s.spec_decode_num_accepted_tokens_total > 0
    assert engine.block_manager.num_used_blocks == 0


def test_mtp_slots_after_tree_steps_are_the_accepted_paths(mtp_models):
    """After every step, each running sequence's MTP slots (positions 0..n-2) hold exactly what
    a fresh fill of its tokens with the target's features (transformers' final normed hidden
    states) writes: a tree step's kept rows are its accepted path's nodes, not its first rows."""
    import transformers

    model = mtp_models["copy"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                            experts_implementation="eager").eval()
    engine = make_engine(model, {"method": "mtp", "speculative_token_tree": TREE})
    spec, bm, bs = engine.spec_decoder, engine.block_manager, engine.spec_decoder.block_size
    prop = spec.eagle
    seen = []
    real = spec._move_paths

    def spy(scheduled, block_tables, paths):
        seen.extend(p for p in paths.values() if any(n not in spec.tree.chain for n in p))
        real(scheduled, block_tables, paths)

    spec._move_paths = spy
    for i, p in enumerate(grounded_prompts(n=4)):
        engine.add_request(f"r{i}", p, GREEDY)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens != 1:  # mid-prefill: its slots are still being written
                continue
            ids, n = seq.token_ids, seq.num_tokens - 1
            table = bm.get_block_table(seq.seq_id)
            with torch.inference_mode():
                feats = hf.model(torch.tensor([ids[:n]])).last_hidden_state[0]
                saved = [pool.clone() for pool in prop.pools]
                prop._forward([table], [0], [n], torch.tensor(ids[1:n + 1]), feats)
                slots = [table[q // bs] * bs + q % bs for q in range(n)]
                for pool, old in zip(prop.pools, saved):
                    got, want = old.flatten(0, 1)[slots], pool.flatten(0, 1)[slots]
                    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
                    pool.copy_(old)
            checked += 1
    assert checked and seen  # accepted paths off the top-1 chain happened
    assert engine.block_manager.num_used_blocks == 0
