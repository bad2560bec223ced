"""The whole engine on CUDA, end to end: every model family and the features that have CUDA
paths, greedy output against transformers (or against our own CPU engine where transformers
cannot be the oracle: fp8 KV, quantized weights, grammars, speculative decoding).

Every test is marked `gpu` and skipped without CUDA, so CI (no GPU) pays nothing for this file.
The engines run as a user gets them: `device="cuda"`, the Triton attention backend and CUDA
graphs for decode (the defaults), with an explicit `num_kv_blocks` so that no engine profiles the
device's memory: under `pytest -n 8` several engines share one GPU.

`KVSERVE_TEST_GPU_FILE_ON_CPU=1` runs the same tests on the CPU (the torch attention backend, or
Triton's interpreter when `TRITON_INTERPRET=1` is set too): a check, without a GPU, that what
reaches the GPU runs at all. There the "CPU oracle" tests compare the CPU engine with itself.

Greedy comparisons allow one thing only: where the oracle's top two tokens are within `tie` of
each other (in logprob), a different choice there is rounding, not a bug, and the continuations
after it are not compared. float32 runs use a tie of 1e-3; bf16 and 8-bit paths a wider one.
"""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import test_baichuan  # tests/ is on sys.path (conftest)
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.sampling_params import StructuredOutputsParams

ON_CPU = os.environ.get("KVSERVE_TEST_GPU_FILE_ON_CPU") == "1"
CUDA = torch.cuda.is_available() and not ON_CPU
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "triton" if CUDA or os.environ.get("TRITON_INTERPRET") == "1" else "torch"

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU),
                                 reason="needs CUDA (KVSERVE_TEST_GPU_FILE_ON_CPU=1 runs it on the CPU)")]

# Small pools, few graph sizes (capture sizes are capped by max_num_seqs: 1, 2, 4, 8, 16).
ENGINE = dict(device=DEVICE, attention_backend=BACKEND, dtype="float32", block_size=16, num_kv_blocks=64,
              max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
# The oracle side of the "against our CPU engine" tests.
CPU_ENGINE = dict(ENGINE, device="cpu", attention_backend="torch")
FP32_TIE = 1e-3
TOPK = 20  # logprobs kept per step of an oracle


def prompts_for(vocab: int = 512, lengths=(1, 3, 9, 17, 40, 26), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ----------------------------------------------------------------------------------- oracles


class Reference:
    """One request's oracle: its greedy tokens and, per step, the top logprobs it chose among."""

    def __init__(self, tokens: list[int], top: list[dict[int, float]]):
        self.tokens, self.top = tokens, top


def hf_references(model_dir, prompts, max_tokens: int) -> list[Reference]:
    """transformers' greedy generate on the CPU in float32, one unpadded prompt at a time, cut
    after the first EOS (as the engine stops there)."""
    import transformers

    # Soft-capped attention needs transformers' eager attention: 5.17 (the GPU image's) picks SDPA
    # for Gemma 2, which drops the cap; that oracle was 0.08 logprob off on a 300-token prompt (GPU
    # run 3). Elsewhere the default: Falcon-RW's eager ALiBi differs from its SDPA path (0.03).
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager" if eager else None).eval()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            top = []
            for step in out.logits:
                lp = torch.log_softmax(step[0].float(), -1)
                values, index = lp.topk(TOPK)
                top.append(dict(zip(index.tolist(), values.tolist())))
            for i, t in enumerate(tokens):
                if t in eos:
                    tokens = tokens[: i + 1]
                    break
            refs.append(Reference(tokens, top[: len(tokens)]))
    return refs


def engine_references(outputs) -> list[Reference]:
    """Our own engine as the oracle: its outputs, generated with logprobs=TOPK."""
    return [Reference(list(o.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs])
            for o in outputs]


def assert_greedy_matches(got: list[list[int]], refs: list[Reference], *, tie: float = FP32_TIE) -> None:
    """Token for token, except at a near tie of the oracle (see the module docstring)."""
    for r, (tokens, ref) in enumerate(zip(got, refs, strict=True)):
        for i, (g, w) in enumerate(zip(tokens, ref.tokens)):
            if g != w:
                gap = ref.top[i][w] - ref.top[i].get(g, float("-inf"))
                assert gap <= tie, (
                    f"request {r} token {i}: got {g}, want {w} (oracle prefers it by {gap:.3g}, tie {tie}); "
                    f"got {tokens}, want {ref.tokens}")
                break
        else:
            assert len(tokens) == len(ref.tokens), f"request {r}: got {tokens}, want {ref.tokens}"


def generate(model_dir, prompts, max_tokens: int, *, logprobs: int | None = None, lora_request=None,
             params: SamplingParams | None = None, **overrides):
    """One engine, one batch (continuous batching of all `prompts`); returns (completions, stats,
    decode steps replayed from CUDA graphs).
    Checks that every KV block came back and that no CUDA graph capture failed."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    with LLM(str(model_dir), **{**ENGINE, **overrides}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=lora_request)
        stats = llm.engine.get_stats()
        assert llm.engine.block_manager.num_used_blocks == 0
        replays = graph_replays(llm)
    assert stats.cuda_graph_capture_failures_total == 0
    return [o.outputs[0] for o in outs], stats, replays


def graph_replays(llm) -> int | None:
    """Decode steps replayed from CUDA graphs (None: no graphs, as on the CPU)."""
    graphs = getattr(llm.engine.executor.driver_worker, "graphs", None)
    return None if graphs is None else graphs.replays


def assert_graphs_replayed(replays) -> None:
    if CUDA:  # the point of running here: decode steps went through the captured graphs
        assert replays, f"no decode step replayed a CUDA graph ({replays})"


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


# ------------------------------------------------------------------------ every family served

FAMILIES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("llama", dict(num_key_value_heads=1, head_dim=32), id="llama-mqa-headdim32"),
    pytest.param("qwen2", {}, id="qwen2-bias"),
    pytest.param("qwen3", {}, id="qwen3-qknorm"),
    pytest.param("mistral", dict(sliding_window=7), id="mistral-window7"),
    pytest.param("phi3", {}, id="phi3-fused"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5), id="gemma2-softcaps"),
    pytest.param("gemma3", dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"]), id="gemma3-hybrid"),
    pytest.param("mixtral", {}, id="mixtral-moe"),
    pytest.param("qwen2_moe", {}, id="qwen2moe-shared-expert"),
    pytest.param("qwen3_moe", {}, id="qwen3moe"),
    pytest.param("deepseek_v2", {}, id="deepseekv2-mla"),
    pytest.param("deepseek_v3", {}, id="deepseekv3-mla-noaux"),
    pytest.param("mpt", {}, id="mpt-alibi"),
    pytest.param("bloom", {}, id="bloom-alibi"),
    pytest.param("falcon", {}, id="falcon-rw-alibi"),
    pytest.param("falcon", dict(alibi=False, parallel_attn=True, bias=False, multi_query=True,
                                new_decoder_architecture=True, num_kv_heads=2), id="falcon-40b-rotary"),
]


@pytest.mark.parametrize("arch,overrides", FAMILIES)
def test_family_greedy_equals_transformers(tiny_model_factory, arch, overrides):
    """Six prompts (1 to 40 tokens) batched together, the long ones prefilled in two chunks, decode
    through CUDA graphs (a batch of 6 replays the graph of 8): transformers' greedy tokens."""
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = prompts_for()
    got, _, replays = generate(model_dir, prompts, 10, max_num_batched_tokens=32)
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 10))
    assert_graphs_replayed(replays)


LONG = [
    pytest.param("llama", dict(head_dim=128), id="llama-headdim128"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0), id="gemma2-window8-softcap"),
    # Each without one of the two features above (GPU run 3's failure of that case was the oracle's:
    # see hf_references).
    pytest.param("gemma2", dict(attn_logit_softcapping=None), id="gemma2-window8-nocap"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0, sliding_window=4096), id="gemma2-nowindow-softcap"),
    pytest.param("deepseek_v2", {}, id="deepseekv2-mla"),
    pytest.param("mpt", {}, id="mpt-alibi"),
]


@pytest.mark.parametrize("arch,overrides", LONG)
def test_long_contexts_equal_transformers(tiny_model_factory, arch, overrides):
    """Contexts of 300 to 1500 tokens (many KV blocks per sequence, so decode attention splits
    the context and prefill runs many tiles over chunks of 512): transformers' greedy tokens."""
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = prompts_for(lengths=(700, 1500, 1100, 300), seed=11)
    got, _, replays = generate(model_dir, prompts, 8, max_model_len=2048, num_kv_blocks=320,
                               max_num_batched_tokens=512)
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 8))
    assert_graphs_replayed(replays)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2", "qwen3_moe"])
def test_wide_decode_batches_equal_transformers(tiny_model_factory, arch):
    """28 requests decoding together (graphs of 32 rows, 4 of them padding)."""
    model_dir = tiny_model_factory(arch)
    prompts = prompts_for(lengths=[3 + (5 * i) % 23 for i in range(28)], seed=12)
    got, _, replays = generate(model_dir, prompts, 6, max_num_seqs=32, num_kv_blocks=128, max_num_batched_tokens=512)
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 6))
    assert_graphs_replayed(replays)


baichuan = test_baichuan.checkpoint  # its tiny checkpoints, both variants (a module-scoped fixture)


def test_baichuan_matches_the_cpu_engine(baichuan):
    """Baichuan has no transformers class (remote code only); tests/test_baichuan.py holds our CPU
    path to a float64 reference. Both variants (13B's ALiBi, 7B's rotary) on the device: the CPU
    engine's greedy tokens."""
    path, _, _ = baichuan
    prompts = prompts_for()
    want, _, _ = generate(path, prompts, 10, logprobs=TOPK, device="cpu", attention_backend="torch")
    got, _, _ = generate(path, prompts, 10)
    assert_greedy_matches(tokens_of(got), engine_references(want))


# --------------------------------------- chunked prefill, preemption, prefix caching together

# 18 prompts up to 40 tokens; a step budget of 16 (chunked prefill) and 20 blocks of 4 (80 tokens:
# requests must be preempted and recomputed).
SQUEEZED = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=16)


@pytest.mark.parametrize("arch,overrides", [
    pytest.param("llama", {}, id="llama"),
    pytest.param("gemma3", dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"]), id="gemma3-hybrid"),
    pytest.param("deepseek_v2", {}, id="deepseekv2-mla"),
    pytest.param("mpt", {}, id="mpt-alibi"),
])
def test_chunked_prefill_and_preemption_equal_transformers(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = prompts_for(lengths=(1, 2, 3, 40, 37, 5, 8, 13, 21, 34, 9, 17, 28, 4, 11, 25, 6, 31))
    got, stats, replays = generate(model_dir, prompts, 8, **SQUEEZED)
    assert stats.num_preemptions_total > 0
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 8))
    assert_graphs_replayed(replays)


def test_async_scheduling_equals_transformers(tiny_model_factory):
    """Step N+1's forward launched while step N's tokens are processed: the same tokens."""
    model_dir = tiny_model_factory("qwen3")
    prompts = prompts_for()
    got, _, _ = generate(model_dir, prompts, 10, async_scheduling=True, max_num_batched_tokens=32)
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 10))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_swapped_out_requests_come_back_intact(tiny_model_factory, arch):
    """Preemption by swapping (swap_space): blocks copied device -> host and back instead of
    recomputed; the tokens are still transformers'."""
    overrides = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention"]) if arch == "gemma3" else {}
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = prompts_for(lengths=(1, 2, 3, 40, 37, 5, 8, 13, 21, 34, 9, 17, 28, 4, 11, 25, 6, 31))
    got, stats, _ = generate(model_dir, prompts, 8, **SQUEEZED, swap_space=0.01)
    assert stats.num_preemptions_total > 0 and stats.kv_swap_ins_total > 0
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 8))


def test_kv_offload_tier_hits_give_the_same_tokens(tiny_model_factory):
    """Blocks evicted from a small device pool are kept in the host tier and loaded back for a
    repeated prompt (host <-> device copies of the tier): transformers' tokens both times."""
    model_dir = tiny_model_factory("llama")
    prompts = prompts_for(lengths=(40, 37, 34, 31, 28), seed=9)
    refs = hf_references(model_dir, prompts, 6)
    with LLM(str(model_dir), **{**ENGINE, "block_size": 4, "num_kv_blocks": 24, "kv_offload_bytes": 8 << 20}) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        for _ in range(2):  # the second round finds the first round's blocks in the tier
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert_greedy_matches(tokens_of([o.outputs[0] for o in outs]), refs)
        stats = llm.engine.get_stats()
    assert stats.kv_offload_hit_tokens_total > 0


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_prefix_cache_hits_give_the_same_tokens(tiny_model_factory, arch):
    """Prompts sharing a 37-token prefix (two full blocks of 16 and part of a third): the second
    batch reads the cached blocks and still decodes what transformers does."""
    model_dir = tiny_model_factory(arch)
    shared = prompts_for(lengths=(37,), seed=5)[0]
    prompts = [shared + tail for tail in prompts_for(lengths=(1, 4, 9), seed=6)]
    refs = hf_references(model_dir, prompts, 8)
    with LLM(str(model_dir), **ENGINE) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits_total >= 3 * 32
    assert_greedy_matches(tokens_of([first[0].outputs[0]]), refs[:1])
    assert_greedy_matches(tokens_of([o.outputs[0] for o in rest]), refs)


# --------------------------------------------------------------------------------- fp8 KV cache


@pytest.mark.parametrize("arch,kv_cache_dtype,dtype", [  # MLA refuses fp8 pools (a ValueError)
    ("llama", "fp8", "float32"), ("llama", "fp8_e5m2", "float32"), ("gemma2", "fp8", "float32"),
    ("gemma2", "fp8_e5m2", "float32"), ("llama", "fp8", "bfloat16"), ("gemma3", "fp8", "bfloat16")])
def test_fp8_kv_cache_matches_the_cpu_fp8_path(tiny_model_factory, arch, kv_cache_dtype, dtype):
    """The same float8 rounding on both devices: greedy tokens equal our CPU engine's with an fp8
    pool, up to near ties (a value on a float8 rounding edge may land either way)."""
    model_dir = tiny_model_factory(arch)
    prompts = prompts_for()
    want, _, _ = generate(model_dir, prompts, 10, logprobs=TOPK, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                          device="cpu", attention_backend="torch")
    got, _, _ = generate(model_dir, prompts, 10, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    assert_greedy_matches(tokens_of(got), engine_references(want), tie=0.05 if dtype == "float32" else 0.15)


# ----------------------------------------------------------------------------------- LoRA


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters of fused experts
# arch -> two adapters that differ in rank and modules (PEFT wants one model's adapters to target the
# same parameters, hence the shared target_parameters of the MoE pair).
LORAS = {
    "llama": (dict(r=8, seed=1, std=0.1), dict(r=4, seed=2, std=0.15, target_modules=["q_proj", "v_proj", "down_proj"])),
    "deepseek_v3": (dict(r=8, seed=1, std=0.15, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                 "kv_b_proj", "o_proj"]),
                    dict(r=4, seed=2, std=0.2, target_modules=["kv_b_proj"])),
    "mixtral": (dict(r=8, seed=1, std=0.15, target_modules=["q_proj"], target_parameters=EXPERTS),
                dict(r=4, seed=2, std=0.2, target_modules=["q_proj"], target_parameters=EXPERTS)),
}


@pytest.mark.parametrize("arch", list(LORAS))
def test_multi_lora_batch_equals_peft(tiny_model_factory, tmp_path, arch):
    """Two adapters and the base model in one batch (the sgmv kernels on CUDA; MLA's latent
    projections; routed experts): each request's tokens and logprobs are peft's for its adapter."""
    from kvserve.runtime.lora.request import LoRARequest
    from kvserve.testing.adapters import assert_outputs_match_peft, build_lora_adapters, peft_model

    if "target_parameters" in LORAS[arch][0]:
        import dataclasses

        from peft import LoraConfig

        if "target_parameters" not in {f.name for f in dataclasses.fields(LoraConfig)}:
            pytest.skip("this peft has no target_parameters (fused expert adapters)")
    base = tiny_model_factory(arch)
    a, b = build_lora_adapters(base, {tmp_path / "a": LORAS[arch][0], tmp_path / "b": LORAS[arch][1]})
    requests = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    pm = peft_model(base, {"a": str(a), "b": str(b)})
    names = ["a", None, "b", "a", "b"]
    prompts = prompts_for(lengths=(5, 17, 3, 30, 9), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(str(base), **{**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
    assert_outputs_match_peft(outs, pm, names, prompts, 8, abs_logprob=1e-3, adapter_matters=True)


# ---------------------------------------------------------------------- speculative decoding

SPEC_GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _spec_tokens(model_dir, spec, **kw):
    from test_spec_decode import grounded_prompts, make_engine, run_checked  # tests/ is on sys.path (conftest)

    opts = {k: v for k, v in ENGINE.items() if k not in ("block_size", "num_kv_blocks", "max_model_len",
                                                        "max_num_batched_tokens")}
    engine = make_engine(model_dir, spec, **{**opts, **kw})
    try:
        outs = run_checked(engine, grounded_prompts(), SPEC_GREEDY)
        stats = engine.get_stats()
    finally:
        engine.close()
    return {k: v.outputs[0].token_ids for k, v in outs.items()}, stats


@pytest.fixture(scope="module")
def spec_targets(tiny_model_factory, tmp_path_factory):
    """target("llama" | "dsv3") -> (directory, greedy tokens without speculation on this device),
    each built on first use (under xdist every worker builds only the targets its tests need)."""
    from kvserve.testing.mtp_layers import add_mtp_layer

    built = {}

    def target(name):
        if name not in built:
            path = (tiny_model_factory("llama") if name == "llama" else
                    add_mtp_layer(tiny_model_factory("deepseek_v3"), tmp_path_factory.mktemp("gpu-spec") / "mtp", copy=True))
            built[name] = path, _spec_tokens(path, None)[0]
        return built[name]

    return target


def _medusa(model_dir, tmp, kind):
    from test_medusa import random_heads, target_copy_heads

    from kvserve.runtime.spec_decode.medusa import save_medusa_heads

    return save_medusa_heads(random_heads() if kind == "random" else target_copy_heads(model_dir), tmp / kind)


def _eagle(tmp, kind):
    from test_eagle import base_config, random_head, target_copy_head

    from kvserve.runtime.spec_decode.eagle import save_eagle_head

    eagle3 = kind == "eagle3"
    head = random_head(True, draft_vocab=200) if eagle3 else target_copy_head()
    return save_eagle_head(head, tmp / kind, base_config=base_config(), aux_layers=(1, 2, 2) if eagle3 else ())


SPECS = ["ngram", "medusa-random", "medusa-copy-tree", "eagle-copy", "eagle3-random", "eagle-copy-tree", "mtp-copy"]


@pytest.mark.parametrize("kind", SPECS)
def test_speculative_greedy_equals_plain_greedy(spec_targets, tmp_path, kind):
    """Drafts only propose: with n-gram, Medusa, EAGLE / EAGLE-3 and MTP proposers (chains and
    trees), greedy output on CUDA equals plain greedy on CUDA, through a small pool (preemption,
    prefix hits), and copy-style drafters get tokens accepted."""
    target = "dsv3" if kind == "mtp-copy" else "llama"
    model_dir, want = spec_targets(target)
    tree = "[(0,), (1,), (0, 0), (0, 0, 0)]"
    spec = {
        "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "medusa-random": lambda: {"method": "medusa", "model": str(_medusa(model_dir, tmp_path, "random")),
                                  "num_speculative_tokens": 3},
        "medusa-copy-tree": lambda: {"method": "medusa", "model": str(_medusa(model_dir, tmp_path, "copy")),
                                     "speculative_token_tree": tree},
        "eagle-copy": lambda: {"method": "eagle", "model": str(_eagle(tmp_path, "eagle")),
                               "num_speculative_tokens": 3},
        "eagle3-random": lambda: {"method": "eagle3", "model": str(_eagle(tmp_path, "eagle3")),
                                  "num_speculative_tokens": 3},
        "eagle-copy-tree": lambda: {"method": "eagle", "model": str(_eagle(tmp_path, "eagle")),
                                    "speculative_token_tree": tree},
        "mtp-copy": lambda: {"method": "mtp", "num_speculative_tokens": 3},
    }[kind]()
    got, stats = _spec_tokens(model_dir, spec, num_kv_blocks=48)
    assert got == want
    assert stats.spec_decode_num_drafts_total > 0
    if "copy" in kind or kind == "ngram":
        assert stats.spec_decode_num_accepted_tokens_total > 0


# ------------------------------------------------------------------------ structured outputs

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def test_structured_outputs_on_cuda_logits(tiny_model_factory):
    """xgrammar's bitmask applied to the device's logits: the output follows the grammar and is the
    token sequence our CPU engine picks under the same grammar."""
    model_dir = tiny_model_factory("llama")
    grammars = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
                StructuredOutputsParams(choice=["kube", "serve", "cache"])]
    prompts = [[1, 40, 41, 42], [1, 300, 17], [1, 7, 8, 9, 10]]

    def run(opts, logprobs):
        with LLM(str(model_dir), **opts) as llm:
            params = [SamplingParams(temperature=0.0, max_tokens=60, logprobs=logprobs, structured_outputs=g)
                      for g in grammars]
            return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                       use_tqdm=False)]

    got = run(ENGINE, None)
    want = run(CPU_ENGINE, TOPK)
    person = json.loads(got[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got[1].text), got[1].text
    assert got[2].text in ("kube", "serve", "cache")
    assert_greedy_matches(tokens_of(got), engine_references(want))


# ----------------------------------------------------------------------- quantized weights


@pytest.mark.parametrize("quantization,dtype,tie", [
    pytest.param("int8", "float32", 0.02, id="int8"),
    pytest.param("int4", "float32", 0.02, id="int4"),
    pytest.param("fp8", "bfloat16", 0.15, id="fp8-bf16"),
])
def test_load_time_quantization_matches_the_cpu_engine(tiny_model_factory, quantization, dtype, tie):
    """Weights quantized at load (kernels/quant.py's Triton GEMMs, cuBLAS's scaled_mm for fp8 on
    Hopper): greedy tokens as our CPU engine's on the same quantized weights, up to near ties."""
    model_dir = tiny_model_factory("qwen2", hidden_size=64, intermediate_size=192)
    prompts = prompts_for(lengths=(3, 17, 40, 70))  # 70 rows in one prefill: above the dequant-GEMM cutover
    kw = dict(quantization=quantization, dtype=dtype, max_num_batched_tokens=128)
    want, _, _ = generate(model_dir, prompts, 10, logprobs=TOPK, **{**kw, "device": "cpu", "attention_backend": "torch"})
    got, _, _ = generate(model_dir, prompts, 10, **kw)
    assert_greedy_matches(tokens_of(got), engine_references(want), tie=tie)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_gguf_quantized_weights_match_the_cpu_engine(tiny_model_factory, tmp_path, kind):
    pytest.importorskip("gguf")
    import ggufmodels

    path = ggufmodels.write_gguf(tiny_model_factory("llama", hidden_size=256, intermediate_size=512), tmp_path / f"{kind}.gguf",
                                 kind)
    prompts = prompts_for(lengths=(3, 17, 40))
    want, _, _ = generate(path, prompts, 10, logprobs=TOPK, device="cpu", attention_backend="torch")
    got, _, _ = generate(path, prompts, 10)
    assert_greedy_matches(tokens_of(got), engine_references(want), tie=0.02)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bitsandbytes_checkpoints_match_the_cpu_engine(tiny_model_factory, tmp_path, kind):
    """A bitsandbytes checkpoint (kernels/nf4.py's dequant-GEMM for NF4 on CUDA): our CPU engine's
    greedy tokens on the same codes."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    qc = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32) if kind == "nf4"
          else BitsAndBytesConfig(load_in_8bit=True))
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=qc, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(tmp_path / kind)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(tmp_path / kind)
    prompts = prompts_for(lengths=(3, 17, 40))
    want, _, _ = generate(tmp_path / kind, prompts, 10, logprobs=TOPK, device="cpu", attention_backend="torch")
    got, _, _ = generate(tmp_path / kind, prompts, 10)
    assert_greedy_matches(tokens_of(got), engine_references(want), tie=0.02)


# ------------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "deepseek_v2",
                                  "deepseek_v3", "mpt", "bloom", "phi3"])
def test_bfloat16_stays_on_the_float32_greedy_path(tiny_model_factory, arch):
    """bf16 weights, activations and KV (what a GPU serves): the first tokens of every request are
    transformers' float32 greedy tokens, up to near ties at bf16's resolution."""
    model_dir = tiny_model_factory(arch)
    prompts = prompts_for()
    got, _, _ = generate(model_dir, prompts, 6, dtype="bfloat16")
    assert_greedy_matches(tokens_of(got), hf_references(model_dir, prompts, 6), tie=0.15)


# -------------------------------------------------------------------------------- sampling


def test_seeded_sampling_repeats_on_the_device(tiny_model_factory):
    """Per-request seeds: the same seed gives the same tokens (alone or batched with others, with
    top-p / top-k / penalties), another seed another sequence; n > 1 samples differ."""
    model_dir = tiny_model_factory("llama")
    prompts = [{"prompt_token_ids": p} for p in prompts_for(lengths=(5, 12, 30))]

    def params(seed, **kw):
        return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, presence_penalty=0.3, max_tokens=16,
                              ignore_eos=True, seed=seed, **kw)

    with LLM(str(model_dir), **ENGINE) as llm:
        a = llm.generate(prompts, [params(7), params(8), params(9)], use_tqdm=False)
        b = llm.generate(prompts[:1], params(7), use_tqdm=False)
        c = llm.generate(prompts[:1], params(1234), use_tqdm=False)
        n = llm.generate(prompts[:1], params(7, n=3), use_tqdm=False)[0]
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert c[0].outputs[0].token_ids != b[0].outputs[0].token_ids
    assert len({tuple(s.token_ids) for s in n.outputs}) > 1
