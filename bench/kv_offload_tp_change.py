"""What reading the file tier across a tensor-parallel change costs, per block.

    python bench/kv_offload_tp_change.py                 # SmolLM2-135M's KV shape, 200 blocks
    python bench/kv_offload_tp_change.py --blocks 400 --repeats 5

A restart at another TP degree reads a block from the old layout's files (runtime/kv_offload/
heads.py): joined from several shards (TP t -> 1) or sliced out of a wider file (TP 1 -> t).
This times `FileStore.get` (open, read, check the CRC, slice or join) for the three cases
against a read of the layout's own file, on the same blocks of one directory (the page cache
warm: what a returning conversation's read-ahead meets on a busy node; a cold disk adds its own
latency to each file, so joining t files costs t reads there).

Geometry by default SmolLM2-135M's (30 layers, K and V, 3 KV heads of 64 float32 values, blocks
of 16 tokens: 720 KiB a block at TP 1); TP 3 is the degree it shards at. Prints a table and
writes bench/results/kv_offload_tp_change.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.runtime.kv_offload.heads import HeadGeometry, head_range
from kvserve.runtime.kv_offload.namespace import Namespace
from kvserve.runtime.kv_offload.store import FileStore

ROOT = Path(__file__).resolve().parent.parent


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni")
                return " ".join(f for f in wanted if f in line.split())
    except OSError:
        pass
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tp", type=int, default=3, help="the other layout's degree")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_offload_tp_change.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    heads, tp = args.kv_heads, args.tp
    geo = HeadGeometry(num_kv_heads=heads, segments=(args.layers * 2,), block_size=args.block_size,
                       value_bytes=args.head_dim * 4)
    full = (0, heads)
    base = Namespace("bench", "w", "float32", "float32", args.block_size, full, "l")
    keys = [bytes([0]) + i.to_bytes(8, "little") for i in range(args.blocks)]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as root:
        # Both layouts wrote every block: TP 1 one file, TP t one file per rank.
        wide = FileStore(root, base, fsync=False)
        shards = [FileStore(root, base.for_heads(head_range(heads, tp, r)), fsync=False) for r in range(tp)]
        for key in keys:
            block = torch.randint(0, 256, (geo.segments[0], args.block_size, heads, geo.value_bytes),
                                  dtype=torch.uint8)
            wide.put(key, block.reshape(-1))
            for r, s in enumerate(shards):
                h0, h1 = head_range(heads, tp, r)
                s.put(key, block[:, :, h0:h1, :].contiguous().reshape(-1))
        for s in [wide, *shards]:
            s.close()
        # Readers. "joined": a TP 1 rank with only the shards (its own directory empty: another root
        # holds a copy of the shards). "sliced": TP t rank 0 reading the wide file.
        joined_root = Path(root) / "joined"
        joined_root.mkdir()
        for r in range(tp):
            ns = base.for_heads(head_range(heads, tp, r))
            (Path(root) / ns.dirname).rename(joined_root / ns.dirname)
        sliced_root = Path(root) / "sliced"
        sliced_root.mkdir()
        (Path(root) / base.dirname).rename(sliced_root / base.dirname)
        cases = {
            f"own file (TP 1, {heads} heads)": FileStore(sliced_root, base, geometry=geo),
            f"joined from {tp} shards (TP {tp} -> 1)": FileStore(joined_root, base, geometry=geo),
            f"sliced from the TP 1 file (TP 1 -> {tp}, rank 0)":
                FileStore(sliced_root, base.for_heads(head_range(heads, tp, 0)), geometry=geo),
            f"own shard (TP {tp}, rank 0)": FileStore(joined_root, base.for_heads(head_range(heads, tp, 0)),
                                                       geometry=geo),
        }
        for name, store in cases.items():
            assert all(store.get(k) is not None for k in keys[:2]), name
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for key in keys:
                    store.get(key)
                times.append((time.perf_counter() - t0) / len(keys))
            nbytes = store.get(keys[0]).numel()
            rows[name] = {"us_per_block": statistics.median(times) * 1e6, "block_bytes": nbytes,
                          "files_per_block": 1 if "own" in name or "sliced" in name else tp}
            store.close()
    ref = rows[f"own file (TP 1, {heads} heads)"]["us_per_block"]
    print(f"{'read':48} {'bytes':>9} {'files':>5} {'us/block':>9} {'vs own TP 1':>11}")
    for name, r in rows.items():
        print(f"{name:48} {r['block_bytes']:>9} {r['files_per_block']:>5} {r['us_per_block']:>9.0f} "
              f"{r['us_per_block'] / ref:>10.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "machine": {"cpu_flags": cpu_flags(), "python": platform.python_version()},
                                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
