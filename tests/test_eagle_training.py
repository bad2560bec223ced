"""The EAGLE head trainer (testing/eagle_heads.py) on a tiny Llama: the unrolled training loop runs
and lowers the loss, and what it saves loads as an EAGLE head the engine serves with greedy output
unchanged and drafts accepted."""

from __future__ import annotations

import json

import torch
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402  (tests/ is on sys.path via conftest)


def test_trainer_learns_and_its_head_serves(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvserve.testing.eagle_heads import train
    from kvserve.testing.spec_heads import hidden_states

    # The tiny model's own greedy continuations of random prompts (self-distillation data).
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (160, 6), generator=gen)
    with torch.inference_mode():
        seqs = model.generate(prompts, max_new_tokens=40, do_sample=False, min_new_tokens=40,
                              pad_token_id=0).tolist()
    hidden, tokens = hidden_states(tiny_llama, seqs, [6] * len(seqs))
    data = tmp_path / "data.pt"
    torch.save({"hidden": hidden, "tokens": tokens}, data)

    report = train(tiny_llama, tmp_path / "head", vocab=256, epochs=8, depth=2, data=data, log=lambda *_: None)
    # A random tiny model's answers loop, so the pass-through start already guesses them well
    # and there is little to learn: this checks the loop runs and lowers the loss; learning
    # itself is measured on the real SmolLM2 (docs/benchmarks.md).
    assert report["loss_per_epoch"][-1] < report["loss_per_epoch"][0], report
    assert len(report["held_out_top1_accuracy_per_depth"]) == 2 and report["steps"] == 8 * 18
    assert json.loads((tmp_path / "head" / "training.json").read_text())["steps"] == report["steps"]

    want = run_checked(make_engine(tiny_llama), grounded_prompts(n=4), GREEDY)
    engine = make_engine(tiny_llama, {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 2})
    got = run_checked(engine, grounded_prompts(n=4), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    assert engine.get_stats().spec_decode_num_accepted_tokens_total > 0
