"""Registers and spills of the attention kernels compiled for a GPU, without a GPU.

Triton compiles for a named target on any machine and ships ptxas; `ptxas -v` then reports each
kernel's registers, stack frame and spill bytes. Spills (local memory: per-thread traffic through
L1/L2) are what a CPU run can see of a launch configuration's GPU cost. Used to find why a
float32 speculative verification replay costs 16 decode replays (docs/benchmarks.md, "Why a
verification replay can cost 16 decodes").

    python bench/kernel_spills.py [--arch 90] [--head-dim 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvserve.kernels.attention import _decode_kernel, _prefill_kernel, decode_config, prefill_config  # noqa: E402
from kvserve.kernels.tree_attention import _tree_kernel  # noqa: E402
from kvserve.kernels.triton_utils import dot_precision  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLOATS = {"scale_log2", "soft_cap_log2"}


def _ptxas() -> str:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # The newest ptxas Triton ships reads the PTX version Triton emits.
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).is_file():
            return str(bin_dir / name)
    raise SystemExit("no ptxas in this Triton install")


def usage(fn, pointers: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int) -> dict:
    sig = {a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a in FLOATS else "i32")
           for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        out = subprocess.run([_ptxas(), "-v", "--gpu-name", f"sm_{arch}a" if arch == 90 else f"sm_{arch}", f.name,
                              "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    text = out.stderr + out.stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else None  # noqa: E731
    return dict(registers=num(r"Used (\d+) registers"), stack_bytes=num(r"(\d+) bytes stack frame"),
                spill_store_bytes=num(r"(\d+) bytes spill stores"), spill_load_bytes=num(r"(\d+) bytes spill loads"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "kernel_spills.json")
    args = p.parse_args(argv)
    import torch

    rows = []
    for dtype, tname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        ptr = "*" + tname
        pointers = dict(Q=ptr, KC=ptr, VC=ptr, BT="*i32", SEQ_LENS="*i32", QSL="*i32", OUT=ptr, K_SCALE="*fp32",
                        V_SCALE="*fp32", ALIBI="*fp32", MID_O="*fp32", MID_LSE="*fp32")
        flags = dict(DOT_PREC=dot_precision(dtype), DOT_F32=False, HAS_WINDOW=False, HAS_SOFT_CAP=False,
                     KV_FP8=False, HAS_ALIBI=False)
        bd, elt = args.head_dim, dtype.itemsize
        pc = prefill_config(bd, elt, is_cuda=True)
        cfg = dict(BLOCK_SIZE=16, BLOCK_M=pc["block_m"], BLOCK_N=pc["block_n"], BLOCK_D=bd,
                   CAUSAL_SPLIT=pc["causal_split"], EVEN_D=True, **flags)
        rows.append(dict(kernel="prefill", dtype=tname, config=f"{pc['block_m']}x{pc['block_n']} w{pc['num_warps']} "
                         f"s{pc['num_stages']}", **usage(_prefill_kernel, pointers, cfg, args.arch,
                                                          pc["num_warps"], pc["num_stages"])))
        dc = decode_config(bd, elt, is_cuda=True)
        cfg = dict(BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=dc["block_n"], BLOCK_D=bd, DIRECT=False, **flags)
        rows.append(dict(kernel="decode", dtype=tname, config=f"G16x{dc['block_n']} w{dc['num_warps']} "
                         f"s{dc['num_stages']}", **usage(_decode_kernel, pointers, cfg, args.arch,
                                                          dc["num_warps"], dc["num_stages"])))
        # The tree kernel (candidate-tree verification) computes in float32 whatever the model's dtype,
        # with 64 x 32 tiles on a GPU (kernels/tree_attention.py's launcher).
        tw = 4 if bd <= 64 else 8
        cfg = dict(BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=32, BLOCK_D=bd, DOT_PREC=dot_precision(torch.float32),
                   HAS_WINDOW=False, HAS_SOFT_CAP=False, KV_FP8=False, HAS_ALIBI=False)
        rows.append(dict(kernel="tree", dtype=tname, config=f"64x32 w{tw} s2",
                         **usage(_tree_kernel, dict(pointers, MASKS="*i64", DEPTHS="*i64"), cfg, args.arch, tw, 2)))
    print(f"sm_{args.arch}, head_dim {args.head_dim}, Triton {triton.__version__}: the configurations the launchers pick")
    print(f"{'kernel':8} {'dtype':5} {'config':16} {'regs':>5} {'stack B':>8} {'spill st B':>11} {'spill ld B':>11}")
    for r in rows:
        print(f"{r['kernel']:8} {r['dtype']:5} {r['config']:16} {r['registers']!s:>5} {r['stack_bytes']!s:>8} "
              f"{r['spill_store_bytes']!s:>11} {r['spill_load_bytes']!s:>11}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(arch=args.arch, head_dim=args.head_dim, triton=triton.__version__,
                                        rows=rows), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
