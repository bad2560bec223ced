"""Time and memory of opening hostile GGUF files: what a header that claims little but nests or
repeats a lot costs the reader.

    python bench/gguf_reader_bounds.py                     # the current reader
    python bench/gguf_reader_bounds.py --reader OLD.py     # another reader.py (e.g. from git show)
                                                           # for a before/after table
    python bench/gguf_reader_bounds.py --reader gguf       # the gguf package's GGUFReader, which
                                                           # transformers' tokenizer conversion uses
                                                           # (minutes per case)

Each case is a ~24 MB file parsed by `GGUFFile(path)` in a fresh child process; the table gives the
wall time and the child's peak RSS above a child that parses a one-key file (same imports), so
the figure is what the parse itself touched (the mapped file's pages included). Writes bench/results/gguf_reader_bounds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZE = 24 * 2**20
U8, STRING, ARRAY = 0, 8, 9


def _header(n_kvs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kvs)


def _key(name: str) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw


def empty_arrays() -> bytes:
    """One key: an array of ~2M empty uint8 arrays (12 bytes each)."""
    n = SIZE // 12
    return _header(1) + _key("a") + struct.pack("<IIQ", ARRAY, ARRAY, n) + struct.pack("<IQ", U8, 0) * n


def keys_of_empty_arrays() -> bytes:
    """~1M distinct keys, each an empty uint8 array."""
    n = SIZE // 28
    body = b"".join(_key(f"{i:07x}") + struct.pack("<IIQ", ARRAY, U8, 0) for i in range(n))
    return _header(n) + body


def empty_strings() -> bytes:
    """One key: an array of ~3M empty strings (a vocabulary-shaped value, skipped unread)."""
    n = SIZE // 8
    return _header(1) + _key("a") + struct.pack("<IIQ", ARRAY, STRING, n) + struct.pack("<Q", 0) * n


def deep_nesting() -> bytes:
    """One key: arrays nested 2M deep (the old reader recursed once per level)."""
    n = SIZE // 12
    return _header(1) + _key("a") + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * n + \
        struct.pack("<IQ", U8, 0)


def at_the_caps() -> bytes:
    """What the caps still let through, all in one file: 16383 keys of empty arrays, one of
    65535 empty arrays, and one of as many empty strings as the element cap leaves (~2M)."""
    from kvserve.runtime.gguf.reader import MAX_ARRAY_ELEMENTS, MAX_METADATA_KEYS, MAX_NESTED_ARRAY_ELEMENTS

    keys = MAX_METADATA_KEYS - 2
    nested = MAX_NESTED_ARRAY_ELEMENTS - 1
    strings = MAX_ARRAY_ELEMENTS - nested - 1
    body = b"".join(_key(f"{i:07x}") + struct.pack("<IIQ", ARRAY, U8, 0) for i in range(keys))
    body += _key("nested") + struct.pack("<IIQ", ARRAY, ARRAY, nested) + struct.pack("<IQ", U8, 0) * nested
    body += _key("strings") + struct.pack("<IIQ", ARRAY, STRING, strings) + struct.pack("<Q", 0) * strings
    return _header(keys + 2) + body


CASES = {"2M empty arrays in one value": empty_arrays, "1M keys of empty arrays": keys_of_empty_arrays,
         "3M empty strings in one value": empty_strings, "arrays nested 2M deep": deep_nesting,
         "just under every cap (17 MB)": at_the_caps}

CHILD = r"""
import importlib.util, json, sys, time
if sys.argv[1] == "gguf":
    import gguf
    open_file = gguf.GGUFReader
else:
    spec = importlib.util.spec_from_file_location("reader_under_test", sys.argv[1])
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    open_file = mod.GGUFFile
path = sys.argv[2]
start = time.perf_counter()
outcome = "parsed"
try:
    open_file(path)
except BaseException as exc:
    outcome = type(exc).__name__ + ": " + str(exc)[-90:]
seconds = time.perf_counter() - start
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak over from the fork).
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_kib": hwm, "outcome": outcome}))
"""


def run_child(reader: Path, path: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(reader), path], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    if done.returncode != 0:
        return {"seconds": float("nan"), "peak_kib": 0, "outcome": f"child died: {done.stderr.strip()[-120:]}"}
    return json.loads(done.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reader", type=Path, default=ROOT / "runtime" / "gguf" / "reader.py",
                   help="a reader.py, or 'gguf' for the gguf package's GGUFReader")
    p.add_argument("--case", default="", help="only the cases whose name contains this")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf_reader_bounds.json")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tiny = Path(d) / "tiny.gguf"
        tiny.write_bytes(_header(1) + _key("a") + struct.pack("<IB", U8, 1))
        base = run_child(args.reader, str(tiny))["peak_kib"]
        for name, make in CASES.items():
            if args.case not in name:
                continue
            path = Path(d) / "case.gguf"
            path.write_bytes(make())
            r = run_child(args.reader, str(path))
            rows.append({"case": name, "file_mb": round(path.stat().st_size / 2**20, 1),
                         "seconds": round(r["seconds"], 2), "extra_rss_mb": round((r["peak_kib"] - base) / 1024, 1),
                         "outcome": r["outcome"]})
    print(f"reader: {args.reader}   load average: {os.getloadavg()}")
    print(f"{'case':34} {'file MB':>8} {'seconds':>8} {'extra RSS MB':>13}  outcome")
    for r in rows:
        print(f"{r['case']:34} {r['file_mb']:8} {r['seconds']:8} {r['extra_rss_mb']:13}  {r['outcome']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reader": str(args.reader), "machine": platform.processor() or platform.machine(),
                                    "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime()),
                                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
