"""`kvserve serve` flags, named as vLLM names them where vLLM has them. No heavy imports."""

from __future__ import annotations

import argparse
import os


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument("model", help="model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the `model` field; the first is reported (default: MODEL)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory sizing)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of cached prompt prefixes (on by default)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}\'')
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on /v1/* (or set KVSERVE_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests admitted but not finished beyond which new ones get 429")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before exiting")
    p.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="bigger request bodies get 413")
    p.add_argument("--log-level", default="info")
    return p
