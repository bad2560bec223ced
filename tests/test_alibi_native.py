"""ALiBi layers (MPT, BLOOM, Falcon-RW) in the native CPU decode stack: the stack is built for
them, and its decode steps give the per-op path's tokens and logprobs (to float rounding: its
LayerNorms and GELU are C, the per-op path's torch). Greedy output against transformers over the
stack is tests/test_alibi.py's; the native kernel's ALiBi term against dense attention is
test_alibi.py's decode-only case."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams

MPT = dict(num_attention_heads=6, hidden_size=96)


@pytest.mark.parametrize("family", ["mpt", "bloom", "falcon"])
def test_native_stack_runs_alibi_layers_like_the_per_op_path(tiny_model_factory, family):
    from kvserve.kernels.cpu import native

    if not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    assert_native_stack_matches_per_op(tiny_model_factory(family, **MPT), max_tokens=12)


def assert_native_stack_matches_per_op(path, max_tokens: int) -> None:
    """Greedy decoding of `path` through the native stack gives the per-op path's tokens, and
    its logprobs to float rounding (the stack's norms and activations are C)."""
    from kvserve.kernels.cpu import native

    prompts = [[1, 40, 41, 42, 300, 17, 5, 9, 250], [1, 7, 8], [3] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)

    def run(stack: bool):
        with LLM(str(path), num_kv_blocks=64, block_size=8, dtype="float32", device="cpu") as llm:
            model = llm.engine.model
            if not stack:
                model._native_stack = None
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], model._native_stack

    got, stack = run(True)
    want, _ = run(False)
    assert isinstance(stack, native.DecoderStack)
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want):
        assert list(g_ids) == list(w_ids)
        for g, w in zip(g_lp, w_lp):
            assert g.keys() == w.keys()
            torch.testing.assert_close(torch.tensor([g[t].logprob for t in g]), torch.tensor([w[t].logprob for t in g]),
                                       rtol=1e-4, atol=1e-4)
