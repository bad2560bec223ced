"""Medusa heads: loading both checkpoint layouts, refusals, and the engine's greedy exactness.

The heads only propose; the target verifies, so greedy output with heads must equal greedy output
without them token for token, inside continuous batching with preemption and prefix-cache hits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402  (tests/ is on sys.path via conftest)

from kvserve.runtime import SamplingParams
from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.medusa import MedusaHeads, load_medusa_heads, save_medusa_heads


def random_heads(num_heads=3, num_layers=1, hidden=64, vocab=512, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    return heads


def target_copy_heads(model_dir, num_heads=3) -> MedusaHeads:
    """Heads whose blocks are zero and whose projection is the target's own lm_head: every head
    guesses the target's next token again (a model that repeats itself gets them accepted)."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    # A tied model stores only the embedding, under its family's name.
    head = weights["lm_head.weight"] if "lm_head.weight" in weights else next(
        w for name, w in weights.items() if name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")))
    head = head.float()
    heads = MedusaHeads(num_heads, 1, head.shape[1], head.shape[0])
    with torch.no_grad():
        for blocks, proj in zip(heads.blocks, heads.heads):
            blocks[0].weight.zero_()
            blocks[0].bias.zero_()
            proj.weight.copy_(head)
    return heads


def test_config_methods():
    cfg = SpeculativeConfig.parse({"method": "medusa", "model": "/heads", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model) == ("medusa", "/heads")
    with pytest.raises(ValueError, match="speculative_config.model: a Medusa heads directory is required"):
        SpeculativeConfig.parse({"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative_config.method: must be one of"):
        SpeculativeConfig.parse({"method": "mlp_speculator", "model": "/x", "num_speculative_tokens": 3})


def test_both_layouts_load_to_the_same_heads(tmp_path):
    heads = random_heads(num_heads=2, num_layers=2)
    x = torch.randn(5, 64)
    want = heads(x)
    medusa = save_medusa_heads(heads, tmp_path / "medusa")
    loaded = load_medusa_heads(medusa, hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    assert torch.equal(loaded(x), want)

    vllm = tmp_path / "vllm"
    vllm.mkdir()
    tensors = {}
    for i in range(2):
        for j in range(2):
            tensors[f"blocks.{i}.layers.{j}.weight"] = heads.blocks[i][j].weight.detach().clone()
            tensors[f"blocks.{i}.layers.{j}.bias"] = heads.blocks[i][j].bias.detach().clone()
        tensors[f"lm_heads.{i}.weight"] = heads.heads[i].weight.detach().clone()
    save_file(tensors, str(vllm / "model.safetensors"))
    (vllm / "config.json").write_text(json.dumps({"num_heads": 2, "num_hidden_layers": 2}))
    loaded = load_medusa_heads(vllm, hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    assert torch.equal(loaded(x), want)
    assert loaded.propose(x, 1) == want[:, :1].argmax(-1).tolist()


def test_bad_heads_are_refused(tmp_path, tiny_llama):
    save_medusa_heads(random_heads(hidden=32), tmp_path / "narrow")
    with pytest.raises(ValueError, match="heads read hidden size 32, the target's is 64"):
        load_medusa_heads(tmp_path / "narrow", hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    save_medusa_heads(random_heads(vocab=600), tmp_path / "wide")
    with pytest.raises(ValueError, match="heads project to 600 tokens"):
        load_medusa_heads(tmp_path / "wide", hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no medusa_lm_head.safetensors"):
        load_medusa_heads(tmp_path / "empty", hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    save_medusa_heads(random_heads(num_heads=2), tmp_path / "two")
    with pytest.raises(ValueError, match="num_speculative_tokens: the Medusa directory has 2 heads"):
        make_engine(tiny_llama, {"method": "medusa", "model": str(tmp_path / "two"), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    outs = run_checked(make_engine(tiny_llama), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["random", "target_copy"])
def test_greedy_with_heads_equals_greedy_without(tiny_llama, greedy_reference, tmp_path, kind):
    heads = random_heads() if kind == "random" else target_copy_heads(tiny_llama)
    path = save_medusa_heads(heads, tmp_path / kind)
    # Small pool: preemption and prefix-cache hits happen along the way.
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "num_speculative_tokens": 3},
                         num_kv_blocks=48)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0
    assert s.spec_decode_num_accepted_tokens_total <= s.spec_decode_num_draft_tokens_total
    if kind == "target_copy":
        assert s.spec_decode_num_accepted_tokens_total > 0


def test_hidden_state_hook_keeps_the_rows_behind_the_logits(tiny_llama):
    """The worker keeps the final-norm hidden states of the logits rows (what lm_head read) and,
    for layers the model names in aux_hidden_layers, their residual streams; decode steps then
    leave the native stack and still give the same logits."""
    engine = make_engine(tiny_llama)
    worker = engine.executor.driver_worker
    model = worker.model
    worker.keep_hidden = True
    prompts = [[5, 9, 11, 13, 17, 19], [7, 3, 2]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = run_checked(engine, prompts, params)
    last = worker.last_hidden
    assert last is not None and last.shape[-1] == 64
    # The last step's rows gave the last tokens of the requests that sampled in it.
    assert set(model.compute_logits(last).argmax(-1).tolist()) <= {o.outputs[0].token_ids[-1] for o in plain.values()}
    model.aux_hidden_layers = (0, 1)
    try:
        aux = run_checked(engine, prompts, params)
        assert [len(a.shape) for a in worker.last_aux_hidden] == [2, 2]
        assert worker.last_aux_hidden[0].shape[0] == worker.last_hidden.shape[0]
        assert {k: v.outputs[0].token_ids for k, v in aux.items()} == {k: v.outputs[0].token_ids
                                                                      for k, v in plain.items()}
    finally:
        model.aux_hidden_layers = ()


def test_truncated_vocabulary_maps_back_to_target_ids(tmp_path, tiny_llama):
    """vLLM's truncated_vocab_size + token_map: projections over a few tokens, guesses in target ids;
    heads sharing one projection project together and give the same guesses."""
    token_map = torch.tensor([3, 17, 40, 99, 250, 511])
    heads = MedusaHeads(2, 1, 64, 6, token_map=token_map)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
        heads.heads[1].weight.copy_(heads.heads[0].weight)
    x = torch.randn(4, 64)
    want = token_map[heads(x).argmax(-1)].tolist()
    path = save_medusa_heads(heads, tmp_path / "truncated")
    loaded = load_medusa_heads(path, hidden_size=64, vocab_size=512, dtype=torch.float32, device="cpu")
    assert loaded.shared and loaded.propose(x, 2) == want
    with pytest.raises(ValueError, match="token_map must hold 6 token ids below the target's vocabulary size 100"):
        load_medusa_heads(path, hidden_size=64, vocab_size=100, dtype=torch.float32, device="cpu")
    engine = make_engine(tiny_llama, {"method": "medusa", "model": str(path), "num_speculative_tokens": 2})
    run_checked(engine, grounded_prompts(n=3), GREEDY)


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]])
def test_medusa_through_the_server_with_the_openai_client(tiny_llama, tmp_path, tree):
    """`kvserve serve --speculative-config '{"method": "medusa", ...}'` (a chain, and a candidate
    tree): streamed and plain completions equal the offline engine's greedy text without
    speculation, drafts counted."""
    from server_helpers import m, metrics
    from spec_server import plain_greedy_texts, spec_server

    heads = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "heads")
    prompts = grounded_prompts(n=4)
    want = plain_greedy_texts(tiny_llama, prompts)
    spec = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3}
    if tree is not None:
        spec["speculative_token_tree"] = str([tuple(p) for p in tree])  # vLLM's string form
    with spec_server(tiny_llama, spec) as (url, client):
        extra = {"ignore_eos": True}
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                         extra_body=extra).choices[0].text for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=16, temperature=0, stream=True, extra_body=extra))
        assert got == want and streamed == want[0]
        assert m(metrics(url), "vllm:spec_decode_num_drafts_total") > 0
