"""Sweep the launch configurations of the paged attention kernels on a GPU and print the best per shape.

    python bench/kernel_sweep.py --out sweep.json            # CUDA; bounded by --budget seconds (default 140)
    python bench/kernel_sweep.py --interpret --out s.json    # CPU smoke run of the script (tiny shapes, two
                                                             # configs each; timings meaningless)

Shapes are bench/kernel_timings.py's --quick grid (a Llama-3-8B layer: 32 query heads, 8 KV heads,
head_dim 128, bf16, block size 16). Prefill sweeps BLOCK_M x BLOCK_N x num_warps x num_stages
(and, for the shipped tiles, the kernel without its unmasked/masked key split: causal_split off);
decode first sweeps BLOCK_N x num_warps x num_stages at the default split count, then, with each
shape's best of those, the split count and the smallest split. Every configuration's output is
checked once per shape against torch SDPA on gathered K/V before it is timed; one that disagrees
is reported and dropped.

Compiling dominates a sweep: each configuration is a separate Triton compile. So the kernels are
compiled first, in parallel, by worker processes that launch each configuration once on a small
input with the same integer specializations (Triton's on-disk cache then holds them), and the
timing loop in this process loads them from the cache. Configurations that need more shared memory
than the device has are skipped before compiling; the whole run stops at --budget seconds,
timing what it has. Prefill is timed with triton.testing.do_bench (median, L2 flushed); decode,
which serves under CUDA graphs, by replaying a CUDA graph of the call (do_bench_cudagraph), so
host launch overhead is not what is ranked; its eager time is reported next to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_SHAPES = [(b, c) for b in (1, 16, 64) for c in (1024, 4096)]
PREFILL_SHAPES = [(1, 2048, 0), (4, 1024, 0), (2, 512, 2048)]  # (batch, prompt, cached)
SMEM_BYTES = 227 * 1024  # Hopper's per-block dynamic shared memory


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON path for every timing and the best per shape")
    p.add_argument("--budget", type=float, default=140.0, help="seconds for the whole sweep, compiles included")
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--rep", type=int, default=25, help="do_bench measuring time per prefill config, milliseconds")
    p.add_argument("--graph-rep", type=int, default=8,
                   help="milliseconds of calls per CUDA graph (decode; each timing replays it 10 times)")
    p.add_argument("--interpret", action="store_true", help="tiny CPU smoke run under TRITON_INTERPRET=1")
    return p.parse_args(argv)


# ---- configurations -------------------------------------------------------------------------


def prefill_configs(interpret: bool) -> list[dict]:
    if interpret:
        return [dict(block_m=32, block_n=32, num_warps=4, num_stages=2, causal_split=True),
                dict(block_m=16, block_n=16, num_warps=4, num_stages=2, causal_split=False)]
    out = []
    for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        # K and V tiles per stage plus the Q tile, bf16
        if st * 2 * bn * HEAD_DIM * 2 + bm * HEAD_DIM * 2 > SMEM_BYTES:
            continue
        out.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, causal_split=True))
    # The kernel before its unmasked/masked split, at the tiles it shipped with: what the split buys.
    out.append(dict(block_m=64, block_n=64, num_warps=8, num_stages=2, causal_split=False))
    return out


def decode_kernel_configs(interpret: bool) -> list[dict]:
    if interpret:
        return [dict(block_n=32, num_warps=4, num_stages=2), dict(block_n=16, num_warps=4, num_stages=2)]
    return [dict(block_n=bn, num_warps=w, num_stages=st)
            for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
            if st * 2 * bn * HEAD_DIM * 2 <= SMEM_BYTES]


def decode_split_options(interpret: bool, block_n: int) -> list[tuple[int | None, int | None]]:
    """(num_splits, min_split_tokens): None is the kernel's own choice."""
    if interpret:
        return [(None, None), (2, 16)]
    splits = (None, 1, 2, 4, 8, 16, 32)
    mins = (None, block_n, 2 * block_n, 4 * block_n)
    return [(s, m) for s in splits for m in mins if not (s == 1 and m is not None)]


# ---- inputs -----------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def paged_cache(batch, context, device, dtype, gen, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    torch = _torch()
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def gathered(cache, tables, context):
    batch, kv_heads, head_dim = tables.shape[0], cache.shape[2], cache.shape[3]
    return cache[tables.long()].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()


class DecodeCase:
    def __init__(self, batch, context, device, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=0):
        torch = _torch()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context = batch, context
        self.k_cache, self.v_cache, self.tables = paged_cache(batch, context, device, dtype, gen, kv_heads, head_dim)
        self.q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device, generator=gen)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5
        self.out = torch.empty_like(self.q)

    def call(self, cfg, num_splits, min_split):
        from kvserve.kernels.attention import paged_decode_attention

        return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.qsl, self.seq_lens, self.tables,
                                      self.scale, max_seq_len=self.context, num_splits=num_splits,
                                      min_split_tokens=min_split, out=self.out, _config=cfg)

    def expected(self):
        torch = _torch()
        ks, vs = gathered(self.k_cache, self.tables, self.context), gathered(self.v_cache, self.tables, self.context)
        return torch.nn.functional.scaled_dot_product_attention(
            self.q.unsqueeze(2), ks, vs, scale=self.scale, enable_gqa=True).squeeze(2)


class PrefillCase:
    def __init__(self, batch, prompt, cached, device, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 seed=1):
        torch = _torch()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.prompt, self.cached = batch, prompt, cached
        self.context = cached + prompt
        self.k_cache, self.v_cache, self.tables = paged_cache(batch, self.context, device, dtype, gen, kv_heads,
                                                              head_dim)
        self.q = torch.randn(batch * prompt, heads, head_dim, dtype=dtype, device=device, generator=gen)
        self.qsl = torch.arange(0, batch * prompt + 1, prompt, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), self.context, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5
        self.out = torch.empty_like(self.q)
        self.flops = 4 * batch * sum(cached + j + 1 for j in range(prompt)) * heads * head_dim

    def call(self, cfg):
        from kvserve.kernels.attention import paged_prefill_attention

        return paged_prefill_attention(self.q, self.k_cache, self.v_cache, self.qsl, self.seq_lens, self.tables,
                                       self.scale, max_query_len=self.prompt, out=self.out, _config=cfg)

    def expected(self):
        torch = _torch()
        heads, dim = self.q.shape[1], self.q.shape[2]
        group = heads // self.k_cache.shape[2]
        ks = gathered(self.k_cache, self.tables, self.context).repeat_interleave(group, 1)
        vs = gathered(self.v_cache, self.tables, self.context).repeat_interleave(group, 1)
        q4 = self.q.view(self.batch, self.prompt, heads, dim).transpose(1, 2)
        mask = torch.ones(self.prompt, self.context, dtype=torch.bool, device=self.q.device).tril(self.cached)
        want = torch.nn.functional.scaled_dot_product_attention(q4, ks, vs, attn_mask=mask, scale=self.scale)
        return want.transpose(1, 2).reshape(self.batch * self.prompt, heads, dim)


def agrees(got, want, dtype) -> float | None:
    """Max abs error, or None when any element is beyond the tolerance."""
    torch = _torch()
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    diff = (got.float() - want.float()).abs()
    return float(diff.max()) if bool((diff <= tol * (1 + want.float().abs())).all()) else None


# ---- compiling in worker processes ----------------------------------------------------------


def _spec(n: int | None):
    """What Triton specializes an integer argument on (equal to 1, a multiple of 16): launches whose
    integers agree on this share one compiled kernel."""
    return None if n is None else 1 if n == 1 else 16 if n % 16 == 0 else 0


def compile_key(kind, cfg: dict, num_splits=None, min_split=None) -> tuple:
    # The split merge kernel is compiled per power of two of the split count (its BLOCK_S).
    merge = None if num_splits is None else 1 << max(0, num_splits - 1).bit_length()
    return (kind, tuple(sorted(cfg.items())), _spec(num_splits), merge, _spec(min_split))


def warm(task) -> tuple[tuple, str | None]:
    """Launch one configuration once on a small input with the sweep's integer specializations (every
    stride and block-table width a multiple of 16, split arguments of the same kind), so that Triton's
    cache holds its compiled kernel. Returns (task, error or None)."""
    try:
        torch = _torch()
        kind, cfg_items, num_splits, min_split = task
        cfg = dict(cfg_items)
        if kind == "prefill":
            PrefillCase(1, 64, 192, "cuda", torch.bfloat16).call(cfg)
        else:
            # A 1024-token context with 64 sequences: the sweep's split arguments are passed as they are.
            DecodeCase(2, 1024, "cuda", torch.bfloat16).call(cfg, num_splits, min_split)
        torch.cuda.synchronize()
        return task, None
    except Exception as e:  # out of shared memory, a compile error: the config is skipped
        return task, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def precompile(tasks, workers, deadline) -> dict:
    """{task: error or None} for the tasks compiled before the deadline (the others are absent)."""
    import multiprocessing

    results = {}
    if not tasks:
        return results
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(warm, t) for t in tasks]
    try:
        for fut in as_completed(futures, timeout=max(1.0, deadline - time.monotonic())):
            try:
                task, err = fut.result()
            except Exception as e:  # a worker died (BrokenProcessPool): its task is lost, not the sweep
                task, err = tasks[futures.index(fut)], f"{type(e).__name__}: {e}"
            results[compile_key(task[0], dict(task[1]), task[2], task[3])] = err
    except TimeoutError:
        pass
    # Past the budget: drop what is queued and stop the compiles still running rather than wait.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    return results


# ---- timing ------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    torch = _torch()
    if not args.interpret and not torch.cuda.is_available():
        sys.exit("bench/kernel_sweep.py sweeps GPU kernels and needs a CUDA device; --interpret runs a CPU smoke run")
    import triton
    import triton.testing

    from kvserve.kernels.attention import decode_config, decode_num_splits, device_sms, prefill_config
    from kvserve.kernels.triton_utils import interpreter_problem

    if args.interpret and interpreter_problem():
        sys.exit(interpreter_problem())

    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float32 if args.interpret else torch.bfloat16
    dims = dict(heads=4, kv_heads=2, head_dim=32) if args.interpret else {}
    head_dim = dims.get("head_dim", HEAD_DIM)
    elt = torch.empty((), dtype=dtype).element_size()
    decode_shapes = [(2, 40)] if args.interpret else DECODE_SHAPES
    prefill_shapes = [(1, 24, 0), (1, 8, 20)] if args.interpret else PREFILL_SHAPES

    def timed(fn, graph=False) -> float:
        if args.interpret:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=args.graph_rep, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=5, rep=args.rep, return_mode="median"))

    p_cfgs = prefill_configs(args.interpret)
    d_cfgs = decode_kernel_configs(args.interpret)
    kv_heads = dims.get("kv_heads", KV_HEADS)
    sms = device_sms(device)

    default_d = decode_config(max(16, 1 << (head_dim - 1).bit_length()), elt, device.type == "cuda")
    default_min_split = default_d.pop("min_split")

    def resolved_splits(batch, context, block_n, num_splits, min_split):
        """The split arguments a launch will use (the kernel's own choice worked out here, so a
        compile task carries the same integers)."""
        min_split = min_split or default_min_split
        if num_splits is None:
            num_splits = decode_num_splits(sms, batch, kv_heads, context, min_split)
        return num_splits, min_split

    def unique(tasks):
        """One task per compiled kernel (by compile_key), none already compiled."""
        out = {}
        for t in tasks:
            key = compile_key(t[0], dict(t[1]), t[2], t[3])
            if key not in compiled:
                out.setdefault(key, t)
        return list(out.values())

    compiled: set = set()
    # Stage 1 compile set: every prefill config, every decode kernel config at the default splits.
    tasks = [("prefill", tuple(sorted(c.items())), None, None) for c in p_cfgs]
    for c in d_cfgs:
        for b, ctx in decode_shapes:
            tasks.append(("decode", tuple(sorted(c.items())), *resolved_splits(b, ctx, c["block_n"], None, None)))
    tasks = unique(tasks)
    compile_errors: dict = {}
    if not args.interpret:
        # Stage 2's split variants are compiled later for each shape's best kernel config only.
        done = precompile(tasks, args.workers, t0 + 0.45 * args.budget)
        compile_errors = {t: e for t, e in done.items() if e}
        compiled |= set(done)
        print(f"compiled {len(done)}/{len(tasks)} configurations in {time.monotonic() - t0:.1f} s "
              f"({len(compile_errors)} failed) with {args.workers} processes", flush=True)
    else:
        compiled |= {compile_key(t[0], dict(t[1]), t[2], t[3]) for t in tasks}

    rows: list[dict] = []
    best: list[dict] = []

    def try_config(kind, shape_key, case, want, cfg, call, graph, extra=None):
        task_key = compile_key(kind, cfg, *(extra or (None, None)))
        if task_key in compile_errors:
            rows.append(dict(kind=kind, **shape_key, config=cfg, **_splits(extra), error=compile_errors[task_key]))
            return None
        if task_key not in compiled or time.monotonic() > deadline:
            return None
        try:
            got = call()
            err = agrees(got, want, dtype)
            if err is None:
                rows.append(dict(kind=kind, **shape_key, config=cfg, **_splits(extra), error="disagrees with SDPA"))
                return None
            ms = timed(call, graph=graph)
            row = dict(kind=kind, **shape_key, config=cfg, **_splits(extra), ms=ms, max_err=err)
            if case is not None and hasattr(case, "flops"):
                row["tflops"] = case.flops / ms / 1e9
            rows.append(row)
            return row
        except Exception as e:
            rows.append(dict(kind=kind, **shape_key, config=cfg, **_splits(extra),
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            return None

    # Prefill
    default_p = prefill_config(max(16, 1 << (head_dim - 1).bit_length()), elt, device.type == "cuda")
    for b, prompt, cached in prefill_shapes:
        case = PrefillCase(b, prompt, cached, device, dtype, **dims)
        want = case.expected()
        key = dict(batch=b, prompt=prompt, context=cached + prompt)
        sdpa = None
        if not args.interpret:
            heads_ = case.q.shape[1]
            group = heads_ // case.k_cache.shape[2]
            ks = gathered(case.k_cache, case.tables, case.context).repeat_interleave(group, 1)
            vs = gathered(case.v_cache, case.tables, case.context).repeat_interleave(group, 1)
            q4 = case.q.view(b, prompt, heads_, head_dim).transpose(1, 2)
            f = torch.nn.functional.scaled_dot_product_attention
            if cached:
                mask = torch.ones(prompt, case.context, dtype=torch.bool, device=device).tril(cached)
                sdpa = timed(lambda: f(q4, ks, vs, attn_mask=mask, scale=case.scale))  # noqa: B023
            else:
                sdpa = timed(lambda: f(q4, ks, vs, is_causal=True, scale=case.scale))  # noqa: B023
            del ks, vs
        results = []
        for cfg in [default_p] + [c for c in p_cfgs if c != default_p]:
            r = try_config("prefill", key, case, want, cfg, lambda cfg=cfg: case.call(cfg), graph=False)  # noqa: B023
            if r is not None:
                r["default"] = cfg == default_p
                results.append(r)
        if results:
            top = min(results, key=lambda r: r["ms"])
            dflt = next((r for r in results if r["default"]), None)
            best.append(dict(kind="prefill", **key, config=top["config"], ms=top["ms"], tflops=top.get("tflops"),
                             default_ms=dflt and dflt["ms"], sdpa_ms=sdpa, tried=len(results)))
        del case, want

    # Decode, stage 1: kernel configs at the default split count.
    stage1 = {}
    cases = {}
    for b, ctx in decode_shapes:
        case = cases[(b, ctx)] = DecodeCase(b, ctx, device, dtype, **dims)
        want = case.expected()
        key = dict(batch=b, context=ctx)
        results = []
        for cfg in [default_d] + [c for c in d_cfgs if c != default_d]:
            extra = resolved_splits(b, ctx, cfg["block_n"], None, None)
            r = try_config("decode", key, None, want, cfg,
                           lambda cfg=cfg, extra=extra: case.call(cfg, *extra), graph=True, extra=extra)  # noqa: B023
            if r is not None:
                r["default"] = cfg == default_d
                results.append(r)
        stage1[(b, ctx)] = (results, want)

    # Decode, stage 2: split options for each shape's best kernel config (compiled now, in parallel).
    tasks2 = []
    for (b, ctx), (results, _) in stage1.items():
        if results:
            cfg = min(results, key=lambda r: r["ms"])["config"]
            for s, m in decode_split_options(args.interpret, cfg["block_n"]):
                tasks2.append(("decode", tuple(sorted(cfg.items())), *resolved_splits(b, ctx, cfg["block_n"], s, m)))
    tasks2 = unique(tasks2)
    if not args.interpret and tasks2 and time.monotonic() < deadline - 10:
        done = precompile(tasks2, args.workers, deadline - 0.6 * (deadline - time.monotonic()))
        compile_errors.update({t: e for t, e in done.items() if e})
        compiled |= set(done)
        print(f"compiled {len(done)}/{len(tasks2)} split variants at {time.monotonic() - t0:.1f} s", flush=True)
    elif args.interpret:
        compiled |= {compile_key(t[0], dict(t[1]), t[2], t[3]) for t in tasks2}
    for (b, ctx), (results, want) in stage1.items():
        case, key = cases[(b, ctx)], dict(batch=b, context=ctx)
        if not results:
            continue
        top1 = min(results, key=lambda r: r["ms"])
        tried = list(results)
        seen = {tuple(top1.get(k) for k in ("num_splits", "min_split_tokens"))}
        for s, m in decode_split_options(args.interpret, top1["config"]["block_n"]):
            extra = resolved_splits(b, ctx, top1["config"]["block_n"], s, m)
            if extra in seen:
                continue
            seen.add(extra)
            r = try_config("decode", key, None, want, top1["config"],
                           lambda extra=extra: case.call(top1["config"], *extra), graph=True, extra=extra)  # noqa: B023
            if r is not None:
                tried.append(r)
        top = min(tried, key=lambda r: r["ms"])
        dflt = next((r for r in results if r.get("default")), None)
        eager = timed(lambda: case.call(top["config"], top["num_splits"], top["min_split_tokens"]))  # noqa: B023
        sdpa = None
        if not args.interpret:
            ks, vs = gathered(case.k_cache, case.tables, ctx), gathered(case.v_cache, case.tables, ctx)
            q4 = case.q.unsqueeze(2)
            sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: B023
                q4, ks, vs, scale=case.scale, enable_gqa=True), graph=True)  # noqa: B023
            del ks, vs
        kv_bytes = 2 * b * ctx * kv_heads * head_dim * elt
        best.append(dict(kind="decode", **key, config=top["config"], num_splits=top["num_splits"],
                         min_split_tokens=top["min_split_tokens"], ms=top["ms"], eager_ms=eager,
                         gbs=kv_bytes / top["ms"] / 1e6, default_ms=dflt and dflt["ms"], sdpa_ms=sdpa,
                         tried=len(tried)))
    cases.clear()

    elapsed = time.monotonic() - t0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU interpreter"
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}  dtype: {dtype}  "
          f"{len(rows)} timings in {elapsed:.1f} s (budget {args.budget:.0f} s)")
    print("best per shape (decode timed as CUDA graph replays; eager = one launch from Python):")
    for r in best:
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
        if r["kind"] == "prefill":
            shape = f"prefill b={r['batch']} prompt={r['prompt']} context={r['context']}"
            rate = f"{r['tflops']:6.1f} TFLOP/s" if r.get("tflops") else ""
        else:
            shape = f"decode  b={r['batch']} context={r['context']}"
            cfg += f" splits={r['num_splits']} min_split={r['min_split_tokens']}"
            rate = f"{r['gbs']:6.0f} GB/s eager {r['eager_ms']:.4f} ms"
        vs_default = f"x{r['default_ms'] / r['ms']:.2f} vs default" if r.get("default_ms") else "default untimed"
        vs_sdpa = f"x{r['sdpa_ms'] / r['ms']:.2f} vs SDPA" if r.get("sdpa_ms") else ""
        print(f"  {shape:<40} {r['ms']:8.4f} ms {rate}  {vs_default}  {vs_sdpa}  [{cfg}] ({r['tried']} tried)")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"{len(failed)} configs failed or disagreed, e.g.: {failed[0]['config']}: {failed[0]['error']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=name, torch=torch.__version__, triton=triton.__version__, dtype=str(dtype), elapsed_s=elapsed,
        budget_s=args.budget, shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK),
        timer="prefill: do_bench median; decode: do_bench_cudagraph median", best=best, rows=rows), indent=1))
    print(f"wrote {args.out}")


def _splits(extra):
    if not extra:
        return {}
    return dict(num_splits=extra[0], min_split_tokens=extra[1])


if __name__ == "__main__":
    main()
