"""MLA's KV cache against multi-head attention's, and MoE decode against a dense model of the same
active parameters.

    python bench/moe_mla.py                   # both parts, CPU, float32 for the throughput part
    python bench/moe_mla.py --skip-throughput --threads 2

Part 1, KV memory. For published MLA configs (DeepSeek-V3, DeepSeek-V2-Lite) the capacity model
gives KV bytes per token and tokens per GiB of the latent cache (one kv_lora_rank + rope latent
per layer) and of its "MHA equivalent": the same layers and heads caching per-head K
(qk_nope + qk_rope dims) and V (v_head_dim), what the model would hold without MLA. The runtime's
real pool is then measured: an engine is started on a small DeepSeek-V2-shaped model and its
allocated pool bytes per token and `kv_cache_capacity_tokens` are compared with the model.

Part 2, MoE decode throughput. A Mixtral-style MoE (8 experts, top-2, expert intermediate I) and a
dense Llama with intermediate 2I, otherwise identical (6 layers, hidden 512, GQA 8/2, vocab
32000): the same active parameters per token (the router's 8 x 512 per layer aside), while the
MoE holds 4x the MLP weights. Random weights, float32, greedy, ignore_eos. Decode tokens per
second at batch 1 and batch 16, measured side by side in one run: decode time is a full run
minus a prefill-only run of the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                   kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                   v_head_dim=128, vocab_size=129280)
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048, intermediate_size=10944,
                        moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16,
                        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, vocab_size=102400)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--expert-intermediate", type=int, default=1408)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "moe_mla.json")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ KV memory


def mha_equivalent_bytes(shape, dtype_size: int) -> int:
    m = shape.mla
    return shape.num_layers * shape.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                                           + m.v_head_dim) * dtype_size


def kv_table() -> list[dict]:
    from kvserve.runtime.capacity import GiB, ModelShape, kv_bytes_per_token

    rows = []
    for name, config in (("DeepSeek-V3", DEEPSEEK_V3), ("DeepSeek-V2-Lite", DEEPSEEK_V2_LITE)):
        shape = ModelShape.from_hf_config(config)
        for dtype, size in (("bfloat16", 2), ("fp8", 1)):
            mla = kv_bytes_per_token(shape, size)
            mha = mha_equivalent_bytes(shape, size)
            rows.append(dict(model=name, dtype=dtype, mla_bytes_per_token=mla, mha_bytes_per_token=mha,
                             mla_tokens_per_gib=GiB // mla, mha_tokens_per_gib=GiB // mha, ratio=mha / mla))
    return rows


def measured_pool() -> dict:
    """A real engine's latent pool against the capacity model (a scaled-down DeepSeek-V2-Lite)."""
    from kvserve.runtime import LLMEngine
    from kvserve.runtime.capacity import GiB, kv_bytes_per_token
    from kvserve.runtime.kv_cache import kv_cache_bytes
    from kvserve.testing.tinymodels import build_tiny_model

    model_dir = build_tiny_model(RESULTS / "models" / "deepseek-v2-small", "deepseek_v2",
                                 hidden_size=256, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128,
                                 qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_hidden_layers=4)
    budget = 64 * 1024 * 1024
    engine = LLMEngine.from_args(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=budget)
    shape = engine.model_config.shape
    stats = engine.get_stats()
    pool = kv_cache_bytes(engine.kv_caches)
    per_token = pool // (stats.kv_blocks_total * stats.block_size)
    mha = mha_equivalent_bytes(shape, 4)
    return dict(model=str(model_dir), budget_bytes=budget, pool_bytes=pool, measured_bytes_per_token=per_token,
                model_bytes_per_token=kv_bytes_per_token(shape, 4), capacity_tokens=stats.kv_cache_capacity_tokens,
                mha_equivalent_bytes_per_token=mha, mha_equivalent_tokens=(budget // (mha * 16)) * 16,
                pool_shape=list(engine.kv_caches[0][0].shape), pools_per_layer=len(engine.kv_caches[0]),
                tokens_per_gib=GiB // per_token)


# ------------------------------------------------------------------------------- MoE vs dense


def build_pair(expert_inter: int) -> tuple[Path, Path]:
    import torch
    import transformers

    common = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out = []
    for name, cfg_cls, model_cls, extra in (
        (f"mixtral-8x{expert_inter}-top2", transformers.MixtralConfig, transformers.MixtralForCausalLM,
         dict(intermediate_size=expert_inter, num_local_experts=8, num_experts_per_tok=2)),
        (f"llama-dense-{2 * expert_inter}", transformers.LlamaConfig, transformers.LlamaForCausalLM,
         dict(intermediate_size=2 * expert_inter)),
    ):
        path = RESULTS / "models" / name
        if not (path / "config.json").is_file():
            path.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(0)
            model_cls(cfg_cls(**common, **extra)).save_pretrained(path, safe_serialization=True)
            _word_tokenizer(path, common["vocab_size"])
        out.append(path)
    return out[0], out[1]


def _word_tokenizer(path: Path, vocab_size: int) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)


def _run(engine, prompts, max_tokens: int) -> tuple[float, int]:
    from kvserve.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def decode_throughput(model_dir: Path, batch: int, args) -> dict:
    import random

    from kvserve.runtime import LLMEngine
    from kvserve.runtime.capacity import active_parameters, weight_bytes_per_gpu

    engine = LLMEngine.from_args(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=max(16, batch),
                                 kv_cache_memory_bytes=256 * 1024 * 1024, max_model_len=1024)
    rng = random.Random(batch)
    prompts = [[rng.randrange(4, 32000) for _ in range(args.prompt_len)] for _ in range(batch)]
    _run(engine, prompts[:1], 4)  # warm-up
    prefill_s, _ = _run(engine, prompts, 1)
    full_s, tokens = _run(engine, prompts, args.output_len)
    decode_tokens = tokens - batch
    shape = engine.model_config.shape
    return dict(model=model_dir.name, batch=batch, decode_tokens=decode_tokens, prefill_s=prefill_s, full_s=full_s,
                decode_tok_s=decode_tokens / (full_s - prefill_s),
                ms_per_step=(full_s - prefill_s) / (args.output_len - 1) * 1e3,
                total_params=weight_bytes_per_gpu(shape, 1), active_params=active_parameters(shape))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    kv = kv_table()
    print(f"\n{'model':<18}{'KV dtype':<10}{'MLA B/token':>13}{'MHA-equiv B/token':>19}{'MLA tokens/GiB':>16}"
          f"{'MHA tokens/GiB':>16}{'ratio':>8}")
    for r in kv:
        print(f"{r['model']:<18}{r['dtype']:<10}{r['mla_bytes_per_token']:>13,}{r['mha_bytes_per_token']:>19,}"
              f"{r['mla_tokens_per_gib']:>16,}{r['mha_tokens_per_gib']:>16,}{r['ratio']:>7.1f}x")
    pool = measured_pool()
    print(f"\nmeasured: engine on {Path(pool['model']).name} ({pool['pools_per_layer']} pool per layer, "
          f"{pool['pool_shape']}), {pool['budget_bytes'] >> 20} MiB budget: {pool['measured_bytes_per_token']} "
          f"B/token allocated (capacity model {pool['model_bytes_per_token']}), {pool['capacity_tokens']:,} tokens "
          f"(MHA equivalent: {pool['mha_equivalent_bytes_per_token']} B/token, "
          f"{pool['mha_equivalent_tokens']:,} tokens)", flush=True)

    throughput = []
    if not args.skip_throughput:
        moe_dir, dense_dir = build_pair(args.expert_intermediate)
        for batch in [int(b) for b in args.batches.split(",")]:
            for model_dir in (moe_dir, dense_dir):
                throughput.append(decode_throughput(model_dir, batch, args))
                r = throughput[-1]
                print(f"  {r['model']:<24} batch {batch:>3}: {r['decode_tok_s']:8.1f} decode tok/s "
                      f"({r['ms_per_step']:.1f} ms/step)", flush=True)
        print(f"\n{'model':<26}{'total params':>14}{'active':>12}{'batch':>7}{'decode tok/s':>14}{'ms/step':>9}"
              f"{'vs dense':>10}")
        for r in throughput:
            dense = next(d for d in throughput if d["batch"] == r["batch"] and d["model"].startswith("llama"))
            print(f"{r['model']:<26}{r['total_params'] / 1e6:>13.1f}M{r['active_params'] / 1e6:>11.1f}M"
                  f"{r['batch']:>7}{r['decode_tok_s']:>14.1f}{r['ms_per_step']:>9.1f}"
                  f"{r['decode_tok_s'] / dense['decode_tok_s']:>9.2f}x")
    print("\nGPU: not measured (no GPU in this task)")
    end_load = os.getloadavg()
    record = dict(benchmark="moe_mla", kv_memory=kv, measured_pool=pool, moe_vs_dense=throughput,
                  threads=torch.get_num_threads(), load_average_start=load, load_average_end=end_load,
                  machine=platform.platform(), cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"),
                  gpu="not measured (no GPU in this task)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
