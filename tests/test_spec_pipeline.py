"""Medusa and EAGLE heads at pipeline_parallel_size > 1 (runtime/executor/pipeline_hidden.py).

The heads run on rank 0 from the last stage's hidden rows (EAGLE-3's aux streams from the stage
holding each layer); the target verifies, so PP=2 greedy output must equal PP=1 greedy output,
inside continuous batching with preemption and prefix-cache hits (small pool). Each case also
checks that drafts were proposed (and, with heads copying the target, accepted): without the
hidden rows on rank 0 no draft would ever be made.
"""

from __future__ import annotations

import pytest
from test_eagle import base_config, random_head, target_copy_head  # noqa: E402  (tests/ is on sys.path)
from test_medusa import target_copy_heads
from test_medusa_tree_engine import TREE
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402

from kvserve.runtime.spec_decode.eagle import save_eagle_head
from kvserve.runtime.spec_decode.medusa import save_medusa_heads

# A closed engine's workers wait as spares for the next engine here (conftest.recycled_workers).
pytestmark = pytest.mark.usefixtures("recycled_workers")


@pytest.fixture(scope="module")
def untied_llama(tiny_llama):
    """The tiny Llama's head is untied: rank 0's stage has no lm_head, so EAGLE-1 reads the
    checkpoint's copy."""
    return tiny_llama


@pytest.fixture(scope="module")
def reference(untied_llama):
    engine = make_engine(untied_llama)
    try:
        outs = run_checked(engine, grounded_prompts(n=4), GREEDY)
    finally:
        engine.close()
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


def _heads(kind, model_dir, tmp_path):
    if kind == "medusa":
        return save_medusa_heads(target_copy_heads(model_dir), tmp_path / kind)
    if kind == "eagle":
        return save_eagle_head(target_copy_head(), tmp_path / kind, base_config=base_config())
    # Aux layers 1 and 2 (hook layers 0 and 1): one on each stage of the 2-layer model.
    return save_eagle_head(random_head(True, draft_vocab=200), tmp_path / kind, base_config=base_config(),
                           aux_layers=(1, 2, 2))


@pytest.mark.parametrize("kind", ["medusa", "medusa_tree", "eagle", "eagle3"])
def test_pp2_greedy_with_heads_equals_pp1(untied_llama, reference, tmp_path, kind):
    method = kind.removesuffix("_tree")
    path = _heads(method, untied_llama, tmp_path)
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 3}
    moved = []
    if kind == "medusa_tree":
        # Off-chain accepted paths are moved into place on rank 0 at once, and on stage 1 before
        # its next step (ForwardInput.kv_slot_moves): a missed move would change the output.
        spec = {"method": method, "model": str(path), "speculative_token_tree": TREE}
    engine = make_engine(untied_llama, spec, num_kv_blocks=48, pipeline_parallel_size=2, max_num_batched_tokens=24)
    if kind == "medusa_tree":
        real = engine.spec_decoder._move_paths

        def spy(scheduled, block_tables, paths):
            moved.extend(p for p in paths.values() if any(n not in engine.spec_decoder.tree.chain for n in p))
            real(scheduled, block_tables, paths)

        engine.spec_decoder._move_paths = spy
    try:
        outs = run_checked(engine, grounded_prompts(n=4), GREEDY)
        s = engine.get_stats()
    finally:
        engine.close()
    if kind == "medusa_tree":
        assert moved, "no off-chain path was accepted: the slot moves went untested"
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == reference
    assert s.spec_decode_num_drafts_total > 0
    if kind != "eagle3":  # the copying heads guess the target's repeats
        assert s.spec_decode_num_accepted_tokens_total > 0


@pytest.fixture(scope="module")
def dsv3_copy_mtp(tiny_model_factory, tmp_path_factory):
    from test_mtp import add_mtp_layer

    return add_mtp_layer(tiny_model_factory("deepseek_v3"), tmp_path_factory.mktemp("mtp") / "copy", copy=True)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_pp2_greedy_with_mtp_equals_pp1(dsv3_copy_mtp, shape):
    """DeepSeek-V3's MTP layer at PP=2: the layer (MLA block, MoE, its own latent pool) runs on
    rank 0 from the last stage's final hidden rows, with whole embedding / head copies (rank 0's
    stage has no head). Drafts (a chain, or a tree whose accepted path's K/V every stage moves)
    are made and accepted, and greedy output equals PP=1 without speculation, under preemption
    and prefix-cache hits (small pool)."""
    prompts = grounded_prompts(n=4)
    engine = make_engine(dsv3_copy_mtp)
    try:
        reference = {k: v.outputs[0].token_ids for k, v in run_checked(engine, prompts, GREEDY).items()}
    finally:
        engine.close()
    spec = {"method": "mtp", "num_speculative_tokens": 3} if shape == "chain" else {
        "method": "mtp", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    engine = make_engine(dsv3_copy_mtp, spec, num_kv_blocks=48,
                         pipeline_parallel_size=2, max_num_batched_tokens=24)
    moved = []
    if shape == "tree":
        real = engine.spec_decoder._move_paths

        def spy(scheduled, block_tables, paths):
            moved.extend(p for p in paths.values() if any(n not in engine.spec_decoder.tree.chain for n in p))
            real(scheduled, block_tables, paths)

        engine.spec_decoder._move_paths = spy
    try:
        assert engine.spec_decoder.eagle.layer.head is not None  # the checkpoint's copy
        outs = run_checked(engine, prompts, GREEDY)
        s = engine.get_stats()
    finally:
        engine.close()
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == reference
    assert s.spec_decode_num_drafts_total > 0 and s.spec_decode_num_accepted_tokens_total > 0
    assert shape == "chain" or moved, "no off-chain path was accepted: the slot moves went untested"
