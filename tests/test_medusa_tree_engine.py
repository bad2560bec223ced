"""Medusa tree verification in the engine (`speculative_token_tree`): one forward pass over every
node with the tree mask, the longest accepted path moved into place, the rest rolled back.

Greedy output with a tree must equal greedy output without speculation token for token, inside
continuous batching with preemption, prefix-cache hits and aborts; no block may leak.
"""

from __future__ import annotations

import pytest
import torch
from test_medusa import random_heads, target_copy_heads  # noqa: E402  (tests/ is on sys.path via conftest)
from test_spec_decode import GREEDY, grounded_prompts, make_engine, record_accepted_paths, run_checked  # noqa: E402

from kvserve.runtime import SamplingParams
from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.medusa import save_medusa_heads
from kvserve.runtime.spec_decode.tree_verify import Tree, move_slots, path_moves, typical_path

# Branches at every level, and second-ranked guesses under the top-1 path.
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


def test_config_takes_vllms_tree_key():
    cfg = SpeculativeConfig.parse({"method": "medusa", "model": "/h",
                                   "speculative_token_tree": "[(0,), (0, 0), (1,)]"})
    assert cfg.speculative_token_tree == ((0,), (1,), (0, 0)) and cfg.num_speculative_tokens == 2
    bad = [({"speculative_token_tree": [[0, 0]]}, "needs its parent path"),
           ({"speculative_token_tree": "[(0,), (0, 0)", "num_speculative_tokens": 2}, "not a list of rank paths"),
           ({"speculative_token_tree": [[0], [0, 0]], "num_speculative_tokens": 3}, "must equal the depth"),
           ({"acceptance_method": "typical"}, "acceptance_method: must be one of"),
           ({"posterior_threshold": 1.5}, "posterior_threshold: must be a number in"),
           ({"medusa_choices": [[0]]}, "medusa_choices: unknown key")]
    for extra, message in bad:
        with pytest.raises(ValueError, match=f"speculative_config.*{message}"):
            SpeculativeConfig.parse({"method": "medusa", "model": "/h", "num_speculative_tokens": 2, **extra})
    with pytest.raises(ValueError, match="speculative_token_tree: only used with methods"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": [[0]]})


def test_tree_prefixes_and_chain():
    tree = Tree(TREE)
    assert tree.chain == (0, 1, 4, 7) and tree.top_k == (3, 2, 2)
    assert tree.nodes_within(1) == 4 and tree.nodes_within(3) == 10
    assert tree.is_chain(2) and not tree.is_chain(3)
    assert tree.layout(5).num_nodes == 5 and tree.layout(5).parents == (-1, 0, 0, 0, 1)


def test_path_moves_bring_the_path_into_place():
    # Path root -> node 2 -> node 6 from start 5 with blocks of 4: node 2 (slot 7) to 6, 6 (11) to 7.
    table = [10, 11, 12, 13]
    moves = path_moves([0, 2, 6], 5, table, 4)
    assert moves == [(11 * 4 + 3, 11 * 4 + 2), (12 * 4 + 3, 11 * 4 + 3)]
    k = torch.arange(14 * 4 * 2, dtype=torch.float32).view(14, 4, 1, 2)
    before = k.clone()
    move_slots([(k,)], moves)
    flat, old = k.view(-1, 2), before.view(-1, 2)
    assert torch.equal(flat[11 * 4 + 2], old[11 * 4 + 3]) and torch.equal(flat[11 * 4 + 3], old[12 * 4 + 3])


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    outs = run_checked(make_engine(tiny_llama), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["random", "target_copy"])
def test_greedy_with_a_tree_equals_greedy_without(tiny_llama, greedy_reference, tmp_path, kind, monkeypatch):
    from kvserve.kernels.cpu import native
    from kvserve.runtime.models import native_decode

    native_steps = []  # tree steps the native CPU stack ran as decode rows (tests/test_medusa_native_tree.py)
    rows = native_decode.tree_rows
    monkeypatch.setattr(native_decode, "tree_rows", lambda meta: native_steps.append(rows(meta)) or native_steps[-1])
    heads = random_heads() if kind == "random" else target_copy_heads(tiny_llama)
    path = save_medusa_heads(heads, tmp_path / kind)
    # Small pool: preemption and prefix-cache hits happen along the way; a step budget of 12
    # tokens cuts some trees short (a prefix of the nodes is still a tree).
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE},
                         num_kv_blocks=48, max_num_batched_tokens=24)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0
    if kind == "target_copy":
        assert s.spec_decode_num_accepted_tokens_total > 0
    if native.available():
        assert native_steps and all(r is not None for r in native_steps)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def test_branches_are_accepted(tiny_llama, tmp_path):
    """Some accepted paths leave the top-1 chain (so the masks, positions and moved K/V of a
    branch were exercised, and the output still equals plain greedy decoding)."""
    path = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "h")
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE})
    spec = engine.spec_decoder
    seen = record_accepted_paths(engine)
    prompts = grounded_prompts(n=8, seed=1)
    got = run_checked(engine, prompts, GREEDY)
    want = run_checked(make_engine(tiny_llama), prompts, GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    off_chain = [p for p in seen if any(n not in spec.tree.chain for n in p)]
    assert off_chain, seen[:20]


def test_aborts_mid_tree_leak_nothing(tiny_llama, tmp_path):
    path = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "h")
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE},
                         num_kv_blocks=48)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(grounded_prompts(n=6)):
        engine.add_request(f"a{i}", p, params)
    for step in range(8):
        engine.step()
        if step == 4:
            engine.abort_request("a0")
            engine.abort_request("a3")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_typical_acceptance_runs_sampled_requests_through_the_tree(tiny_llama, tmp_path):
    path = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "h")
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE,
                                      "acceptance_method": "typical_acceptance_sampler"})
    params = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=3)
    outs = run_checked(engine, grounded_prompts(n=4), params)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs.values())
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0 and s.spec_decode_num_accepted_tokens_total > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_typical_path_takes_the_longest_passing_branch():
    tree = Tree([(0,), (1,), (1, 0)])
    layout = tree.full  # nodes: 0 root, 1 = (0,), 2 = (1,), 3 = (1, 0)
    vocab = 6
    probs = torch.full((4, vocab), 0.0)
    probs[0, 1], probs[0, 2], probs[0, 5] = 0.45, 0.45, 0.1  # both children pass under the root
    probs[2, 3] = 1.0  # after node 2, token 3 is certain: node 3 passes
    probs[1, 0] = probs[3, 4] = 1.0
    path, out = typical_path(layout, [9, 1, 2, 3], probs, threshold=0.09, alpha=0.3)
    assert path == [0, 2, 3] and out == [2, 3, 4]


def test_trees_the_target_cannot_verify_are_refused(tiny_llama, tiny_model_factory, tmp_path):
    two = save_medusa_heads(random_heads(num_heads=2), tmp_path / "two")
    with pytest.raises(ValueError, match="num_speculative_tokens: the Medusa directory has 2 heads, fewer than 3"):
        make_engine(tiny_llama, {"method": "medusa", "model": str(two), "speculative_token_tree": TREE,
                                 "num_speculative_tokens": 3})


def test_real_smollm2_greedy_with_a_tree_equals_plain(smollm2, tmp_path):
    """The real SmolLM2 with a tree: the heads trained for it (when build/spec-heads has them;
    scripts/train_medusa_heads.py), else heads that project through its own lm_head."""
    from kvserve.runtime import LLM
    from kvserve.testing.spec_heads import REPO_ROOT, _weights_digest

    model = smollm2.hf_dir
    trained = sorted((REPO_ROOT / "build" / "spec-heads").glob(f"{model.name}-{_weights_digest(model)}-medusa-3x*"))
    trained = [p for p in trained if (p / "training.json").is_file()]
    if trained:
        heads = trained[0]
    else:
        heads = save_medusa_heads(target_copy_heads(model), tmp_path / "copy")
    prompts = ["The capital of France is", "Three facts about the moon:"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = dict(dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=32)
    with LLM(str(model), **small) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "medusa", "model": str(heads), "speculative_token_tree": TREE}
    with LLM(str(model), **small, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.engine.get_stats()
    assert got == want
    assert s.spec_decode_num_drafts_total > 0
    if trained:
        assert s.spec_decode_num_accepted_tokens_total > 0


# fp8 pools: tests/test_medusa_tree.py's backend and kernel cases (the engine adds nothing there)
@pytest.mark.parametrize("family, kw", [("gemma2", {}), ("mpt", {})], ids=["gemma2-window-softcap", "mpt-alibi"])
def test_triton_backend_verifies_trees_with_windows_soft_caps_and_alibi(tiny_model_factory, tmp_path, monkeypatch,
                                                                            family, kw):
    """The Triton backend (interpreted) verifies trees for targets whose attention reads positions
    (Gemma 2's 8-token window and soft-capping, MPT's ALiBi): greedy output with a tree equals
    greedy output without, through the same backend."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model_factory(family, **({"num_attention_heads": 4, "hidden_size": 64} if family == "mpt" else {}))
    if family == "mpt":  # MPT names its (tied) embedding transformer.wte: copy-heads from a renamed view
        from safetensors.torch import load_file, save_file

        view = tmp_path / "wte"
        view.mkdir()
        save_file({"model.embed_tokens.weight": load_file(str(model / "model.safetensors"))["transformer.wte.weight"]},
                  str(view / "model.safetensors"))
        heads = target_copy_heads(view)
    else:
        heads = target_copy_heads(model)
    path = save_medusa_heads(heads, tmp_path / "h")
    prompts = grounded_prompts(n=2, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    opts = dict(attention_backend="triton", **kw)

    def run(engine):  # requests arriving while others decode (Gemma 2's KV cache groups included)
        out, pending, steps = {}, list(enumerate(prompts)), 0
        while pending or engine.has_unfinished_requests():
            if pending and steps % 2 == 0:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, params)
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            steps += 1
        return out

    want = run(make_engine(model, **opts))
    engine = make_engine(model, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE}, **opts)
    assert run(engine) == want
    stats = engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_mla_targets_verify_trees(tiny_model_factory, tmp_path, family):
    """Multi-head latent attention verifies a tree in its up-projected path with the tree mask
    (the rotary key rotated at each node's depth): greedy output equals plain greedy, branches
    and moved latents included, and no block leaks."""
    model = tiny_model_factory(family)
    path = save_medusa_heads(target_copy_heads(model), tmp_path / "h")
    prompts = grounded_prompts(n=4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run_checked(make_engine(model), prompts, params)
    engine = make_engine(model, {"method": "medusa", "model": str(path), "speculative_token_tree": TREE})
    got = run_checked(engine, prompts, params)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    stats = engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
