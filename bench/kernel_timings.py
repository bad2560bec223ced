"""Benchmark the Triton kernels on a GPU: time, achieved bandwidth / FLOP rate, and torch baselines.

    python bench/kernel_timings.py                      # full grids on CUDA (writes bench/results/kernels.json)
    python bench/kernel_timings.py --quick              # smaller grids
    python bench/kernel_timings.py --quick --only attention   # decode and prefill attention only
    python bench/kernel_timings.py --interpret          # CPU smoke run under TRITON_INTERPRET=1: tiny shapes,
                                                 # checks results and that the script works; its
                                                 # timings mean nothing

Every CUDA timing is triton.testing.do_bench's median (it flushes the L2 cache between runs and
repeats the call for --rep milliseconds after --warmup milliseconds), not one event pair per call.
Memory-bound kernels report GB/s and the fraction of the device's measured copy bandwidth
(a device-to-device copy of 1 GiB, read + write bytes counted); prefill reports TFLOP/s. Decode
attention is compared with torch SDPA over K/V already gathered into contiguous tensors (gather
not timed), prefill with torch's SDPA (flash where available) on K/V expanded to all query heads.
Decode is also timed as CUDA-graph replays (do_bench_cudagraph), as the engine runs it: a small
batch's eager time is mostly the launch from Python.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="tiny CPU smoke run under TRITON_INTERPRET=1")
    p.add_argument("--quick", action="store_true", help="smaller grids")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, milliseconds")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, milliseconds")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/kernels[-interpret].json)")
    p.add_argument("--only", choices=["attention", "layers"], default=None,
                   help="time only the attention kernels or only the layer kernels")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402

if not ARGS.interpret and not torch.cuda.is_available():
    sys.exit("bench/kernel_timings.py measures GPU kernels and needs a CUDA device; none is visible here. "
             "Use --interpret for a CPU smoke run of the script (timings meaningless).")

import triton  # noqa: E402
import triton.testing  # noqa: E402

from kvserve.kernels import layers, reference  # noqa: E402
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.kernels.cache import write_kv_cache  # noqa: E402

DEVICE = torch.device("cpu" if ARGS.interpret else "cuda")
DTYPE = getattr(torch, ARGS.dtype)
ELT = torch.empty((), dtype=DTYPE).element_size()
# A Llama-3-8B layer: 32 query heads, 8 KV heads, head_dim 128, hidden 4096, intermediate 14336.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16
if ARGS.interpret:
    HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 4, 2, 64, 128, 256, 16


def timed(fn) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench on a GPU; one wall-clock call under
    the interpreter, where the number only shows that the script runs)."""
    if DEVICE.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=ARGS.warmup, rep=ARGS.rep, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth_gbs() -> float:
    n = (1 << 30) // 2 if DEVICE.type == "cuda" else 1 << 20
    src = torch.empty(n, dtype=torch.float16, device=DEVICE).uniform_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def paged_cache(batch: int, context: int, gen: torch.Generator):
    """A KV pool holding batch x context tokens in shuffled blocks, and its block tables."""
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    v_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1
    tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def gathered(cache, tables, context):
    batch = tables.shape[0]
    return cache[tables.long()].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()


TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[DTYPE]


def check(name, got, want):
    """Max abs error, after failing loudly if any element is off by more than TOL * (1 + |want|)."""
    diff = (got.float() - want.float()).abs()
    if not bool((diff <= TOL * (1 + want.float().abs())).all()):
        raise SystemExit(f"{name}: max error {diff.max().item():.3g} beyond tolerance {TOL}: "
                         "the kernel disagrees with its twin")
    return diff.max().item()


def bench_decode(grid, copy_bw, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for batch, context in grid:
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * ELT
        if DEVICE.type == "cuda" and 3 * kv_bytes > 0.6 * torch.cuda.get_device_properties(DEVICE).total_memory:
            continue
        k_cache, v_cache, tables = paged_cache(batch, context, gen)
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        scale = HEAD_DIM ** -0.5
        out = torch.empty_like(q)
        run = lambda: paged_decode_attention(q, k_cache, v_cache, qsl, seq_lens, tables, scale,  # noqa: E731, F821 (deleted after use below)
                                             max_seq_len=context, out=out)
        run()
        ks, vs = gathered(k_cache, tables, context), gathered(v_cache, tables, context)
        q4 = q.unsqueeze(2)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, ks, vs, scale=scale, enable_gqa=True)  # noqa: E731, F821 (deleted after use below)
        err = check(f"decode b{batch} c{context}", out, sdpa().squeeze(2))
        ms, ms_sdpa = timed(run), timed(sdpa)
        moved = kv_bytes + 2 * q.numel() * ELT
        gbs = moved / ms / 1e6
        row = dict(kernel="decode_attention", batch=batch, context=context, ms=ms, gbs=gbs,
                   frac_copy_bw=gbs / copy_bw, sdpa_ms=ms_sdpa, vs_sdpa=ms_sdpa / ms, max_err=err)
        if DEVICE.type == "cuda":
            # Decode serves from CUDA graphs: replayed, a small batch is not launch bound. (No L2 flush
            # between replays: a small batch's K/V stays in L2, for SDPA too.)
            graph = lambda f: float(triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median"))  # noqa: E731
            row.update(graph_ms=graph(run), sdpa_graph_ms=graph(sdpa))
            row["graph_vs_sdpa"] = row["sdpa_graph_ms"] / row["graph_ms"]
        rows.append(row)
        del k_cache, v_cache, ks, vs


def bench_prefill(grid, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for batch, prompt, cached in grid:
        context = cached + prompt
        k_cache, v_cache, tables = paged_cache(batch, context, gen)
        q = torch.randn(batch * prompt, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
        qsl = torch.arange(0, batch * prompt + 1, prompt, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        scale = HEAD_DIM ** -0.5
        out = torch.empty_like(q)
        run = lambda: paged_prefill_attention(q, k_cache, v_cache, qsl, seq_lens, tables, scale,  # noqa: E731, F821 (deleted after use below)
                                              max_query_len=prompt, out=out)
        run()
        group = HEADS // KV_HEADS
        ks = gathered(k_cache, tables, context).repeat_interleave(group, 1)
        vs = gathered(v_cache, tables, context).repeat_interleave(group, 1)
        q4 = q.view(batch, prompt, HEADS, HEAD_DIM).transpose(1, 2)
        # Bottom-right causal alignment (queries are the last `prompt` positions) only when
        # nothing is cached can use is_causal; otherwise an explicit mask.
        if cached:
            mask = torch.ones(prompt, context, dtype=torch.bool, device=DEVICE).tril(cached)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, ks, vs, attn_mask=mask, scale=scale)  # noqa: E731, F821 (deleted after use below)
        else:
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, ks, vs, is_causal=True, scale=scale)  # noqa: E731, F821 (deleted after use below)
        want = sdpa().transpose(1, 2).reshape(batch * prompt, HEADS, HEAD_DIM)
        err = check(f"prefill b{batch} p{prompt} c{cached}", out, want)
        ms, ms_sdpa = timed(run), timed(sdpa)
        # causal score pairs per sequence: each query attends to cached + its own prefix
        pairs = batch * sum(cached + j + 1 for j in range(prompt))
        tflops = 4 * pairs * HEADS * HEAD_DIM / ms / 1e9
        rows.append(dict(kernel="prefill_attention", batch=batch, context=context, prompt=prompt, ms=ms,
                         tflops=tflops, sdpa_ms=ms_sdpa, vs_sdpa=ms_sdpa / ms, max_err=err))
        del k_cache, v_cache, ks, vs


def bench_elementwise(tokens_grid, copy_bw, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    rnd = lambda *shape: torch.randn(*shape, dtype=DTYPE, device=DEVICE, generator=gen)  # noqa: E731, F821 (deleted after use below)
    for tokens in tokens_grid:
        x, res, w = rnd(tokens, HIDDEN), rnd(tokens, HIDDEN), rnd(HIDDEN)
        qkv = rnd(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
        pos = torch.randint(0, 8192, (tokens,), device=DEVICE, generator=gen)
        inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE, dtype=torch.float32) / HEAD_DIM)
        ang = torch.outer(torch.arange(8192, device=DEVICE, dtype=torch.float32), inv)
        cs = torch.cat((ang.cos(), ang.sin()), -1)
        gate_up = rnd(tokens, 2 * INTER)
        num_blocks = math.ceil(tokens / BLOCK) + 1
        kc = torch.empty(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        vc = torch.empty_like(kc)
        slots = torch.randperm(num_blocks * BLOCK, device=DEVICE, generator=gen)[:tokens]
        kv_io = 4 * tokens * KV_HEADS * HEAD_DIM * ELT
        cases = [
            ("rms_norm", lambda: layers.rms_norm(x, w, 1e-5), lambda: reference.rms_norm_ref(x, w, 1e-5),
             2 * tokens * HIDDEN * ELT),
            ("fused_add_rms_norm", lambda: layers.fused_add_rms_norm(x, res, w, 1e-5)[0],
             lambda: reference.fused_add_rms_norm_ref(x, res, w, 1e-5)[0], 4 * tokens * HIDDEN * ELT),
            ("rotary", lambda: layers.rotary_embedding(pos, q, k, cs)[0],
             lambda: reference.rotary_embedding_ref(pos, q, k, cs)[0],
             2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * ELT + tokens * HEAD_DIM * 4),
            ("silu_and_mul", lambda: layers.silu_and_mul(gate_up), lambda: reference.silu_and_mul_ref(gate_up),
             3 * tokens * INTER * ELT),
            ("write_kv", lambda: write_kv_cache(k, v, kc, vc, slots),
             lambda: reference.write_kv_ref(k, v, kc, vc, slots), kv_io),
        ]
        for name, kernel, twin, moved in cases:
            got, want = kernel(), twin()
            err = check(f"{name} t{tokens}", got, want) if got is not None else 0.0
            ms, ms_torch = timed(kernel), timed(twin)
            gbs = moved / ms / 1e6
            rows.append(dict(kernel=name, tokens=tokens, ms=ms, gbs=gbs, frac_copy_bw=gbs / copy_bw,
                             torch_ms=ms_torch, vs_torch=ms_torch / ms, max_err=err))


def fmt(row):
    shape = " ".join(f"{k}={row[k]}" for k in ("batch", "context", "prompt", "tokens") if k in row)
    rate = f"{row['gbs']:8.1f} GB/s ({100 * row['frac_copy_bw']:5.1f}% copy)" if "gbs" in row else \
        f"{row['tflops']:8.1f} TFLOP/s" + " " * 13
    base = f"x{row['vs_sdpa']:.2f} vs SDPA" if "vs_sdpa" in row else f"x{row['vs_torch']:.2f} vs torch"
    if "graph_ms" in row:
        base += f"   graph replay {row['graph_ms']:.4f} ms x{row['graph_vs_sdpa']:.2f} vs SDPA's"
    return f"{row['kernel']:<20} {shape:<34} {row['ms']:9.4f} ms {rate} {base}"


def main():
    quick = ARGS.quick
    if ARGS.interpret:
        decode_grid, prefill_grid, tokens_grid = [(2, 40)], [(1, 24, 0), (1, 8, 20)], [4]
    elif quick:
        decode_grid = [(b, c) for b in (1, 16, 64) for c in (1024, 4096)]
        prefill_grid = [(1, 2048, 0), (4, 1024, 0), (2, 512, 2048)]
        tokens_grid = [1, 256, 4096]
    else:
        decode_grid = [(b, c) for b in (1, 8, 32, 64, 128) for c in (512, 2048, 4096, 8192, 16384)]
        prefill_grid = [(1, 4096, 0), (2, 2048, 0), (8, 1024, 0), (16, 512, 0), (4, 512, 4096), (1, 8192, 0)]
        tokens_grid = [1, 64, 1024, 4096, 16384]
    copy_bw = copy_bandwidth_gbs()
    rows: list[dict] = []
    if ARGS.only != "layers":
        bench_decode(decode_grid, copy_bw, rows)
        bench_prefill(prefill_grid, rows)
    if ARGS.only != "attention":
        bench_elementwise(tokens_grid, copy_bw, rows)
    device = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"CPU interpreter ({platform.machine()})"
    print(f"device: {device}   dtype: {ARGS.dtype}   measured copy bandwidth: {copy_bw:.1f} GB/s")
    print(f"layer shape: heads={HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} hidden={HIDDEN} "
          f"intermediate={INTER} block_size={BLOCK}")
    if ARGS.interpret:
        print("(interpreter smoke run: results checked against the twins; timings are meaningless)")
    for row in rows:
        print(fmt(row))
    out = ARGS.out or ROOT / "bench" / "results" / ("kernels-interpret.json" if ARGS.interpret else "kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        device=device, dtype=ARGS.dtype, copy_bandwidth_gbs=copy_bw, torch=torch.__version__,
        triton=triton.__version__, interpret=ARGS.interpret, warmup_ms=ARGS.warmup, rep_ms=ARGS.rep,
        timer="triton.testing.do_bench",
        shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=HIDDEN, intermediate=INTER,
                   block_size=BLOCK),
        rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
