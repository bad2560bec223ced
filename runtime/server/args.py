"""`kvserve serve` flags, named as vLLM names them where vLLM has them. No heavy imports."""

from __future__ import annotations

import argparse
import os

from kvserve.runtime.capacity import WEIGHT_FORMATS


def _bounded(kind, low, high=None):
    """An argparse type that also checks the range, so a bad value is a usage error, not a traceback."""
    def parse(text: str):
        value = kind(text)  # ValueError -> argparse's "invalid value"
        if value != value or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range ({low}..{high})" if high is not None else f"{text!r} must be >= {low}")
        return value
    parse.__name__ = kind.__name__
    return parse


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# kvserve.runtime.server.tool_parsers.PARSERS (named here so that parsing flags imports nothing).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


ADMIN_KEY_HELP = {
    "serve": "require `Authorization: Bearer KEY` on admin routes (POST /drain, /admin/*); must differ from "
             "--api-key; without one, admin routes answer 403",
    "agent": "require `Authorization: Bearer KEY` on the agent's POST /drain, and send it on to the runtime's; "
             "without one, /drain answers 403",
    "client": "send `Authorization: Bearer KEY` (the pod's admin key)",
}


def add_admin_key_flags(p: argparse.ArgumentParser, role: str = "serve") -> None:
    """The admin credential, shared by `kvserve serve` and `kvserve agent serve|drain` (`role`, a key
    of ADMIN_KEY_HELP). Defaults stay None so that kvserve.runtime.server.auth can tell a flag from
    the environment."""
    p.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help=f"{ADMIN_KEY_HELP[role]} (default: $KVSERVE_ADMIN_API_KEY)")
    p.add_argument("--admin-api-key-file", default=None, metavar="PATH",
                   help="read the admin key from this file (its content, stripped) instead of --admin-api-key "
                        "(default: $KVSERVE_ADMIN_API_KEY_FILE)")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument("model", help="model directory (config.json, *.safetensors, tokenizer), a .gguf file, "
                                  "or a directory holding one .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=8000, help="0: a free port")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the `model` field; the first is reported (default: MODEL)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="layers split into this many stages, tensor-parallel-size ranks each (docs/pipeline-parallel.md)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines in this server, each of --tensor-parallel-size ranks; the server owns "
                        "DP x TP devices and POST /admin/parallelism changes the split live")
    p.add_argument("--reshape-spare-workers", action="store_true",
                   help="keep DP x TP - 1 tensor-parallel worker interpreters started while a data-parallel "
                        "layout runs, so a live reshape to tensor parallelism skips their start-up")
    p.add_argument("--quantization", "-q", default=None, type=lambda v: v.lower().replace("_", "-"),
                   choices=WEIGHT_FORMATS,
                   help="weight format (default: the checkpoint's quantization_config, else full precision); "
                        "int8/int4/fp8 quantize a full-precision checkpoint at load")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory sizing)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="KV cache storage: auto (the model dtype) or float8 (half of bf16, twice the tokens); "
                        "fp8 is fp8_e4m3")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of cached prompt prefixes (on by default)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}\'')
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every step eagerly: no CUDA graphs for decode steps (they are on by default on a GPU)")
    p.add_argument("--async-scheduling", action="store_true", default=None,
                   help="overlap: run the next step's forward pass while this step's tokens are detokenized "
                        "and streamed (outputs are the same)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
                   help="one block table for all layers of a model mixing local and global layers (Gemma 2/3): "
                        "its local layers then hold the whole context instead of their window")
    p.add_argument("--kv-offload-bytes", type=_bounded(int, 0), default=None, metavar="N",
                   help="bytes (per rank) of a second KV tier that keeps blocks evicted from the pool and loads "
                        "them back on a prefix hit (default 0: off)")
    p.add_argument("--kv-offload-dir", default=None, metavar="PATH",
                   help="keep the offload tier in files under PATH (local disk, a PVC): a restarted server "
                        "finds its prefixes again; without it the tier is host memory (pinned on CUDA)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='vLLM\'s offloading connector form of the two flags above, e.g. \'{"kv_connector": '
                        '"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
                        '{"cpu_bytes_to_use": 1000000000}}\' (docs/kv-offload.md)')
    p.add_argument("--swap-space", type=_bounded(float, 0.0), default=None, metavar="GiB",
                   help="CPU swap space (GiB per rank) for the KV blocks of preempted requests: swapped out "
                        "and back in instead of recomputed when that is cheaper (default 0: recompute)")
    p.add_argument("--compilation-config", "-O", default=None, metavar="JSON",
                   help='e.g. \'{"cudagraph_capture_sizes": [1, 2, 4, 8], "level": 0}\'; a bare 3 turns on '
                        "torch.compile of the model (GPU)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events (vLLM\'s KVEventsConfig), e.g. \'{"enable_kv_cache_events": true, '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (docs/kv-events.md)')
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (or set KVSERVE_API_KEY)")
    add_admin_key_flags(p)
    p.add_argument("--max-queue-len", type=_bounded(int, 0), default=1024,
                   help="sequences allowed to wait beyond --max-num-seqs; more get 429")
    p.add_argument("--drain-timeout", type=_bounded(float, 0.0), default=30.0,
                   help="seconds SIGTERM or POST /drain waits for in-flight requests before aborting them "
                        "(a /drain ?timeout= can only shorten it)")
    p.add_argument("--max-request-body-bytes", type=_bounded(int, 1), default=8 * 1024 * 1024,
                   help="bigger request bodies get 413")
    p.add_argument("--max-buffered-request-bytes", type=_bounded(int, 1), default=64 * 1024 * 1024,
                   help="request bodies held in memory at once, read but not yet planned; past it a new request "
                        "gets 429 before its body is read")
    p.add_argument("--max-stop-strings", type=_bounded(int, 1), default=64,
                   help="stop strings one request may give (each at most 1024 characters); more get 400")
    p.add_argument("--max-messages", type=_bounded(int, 1), default=4096,
                   help="messages one chat request may give; more get 400 before templating")
    p.add_argument("--max-prompt-chars", type=_bounded(int, 1), default=None,
                   help="characters one prompt (a chat request's messages and tools) may have; more get 400 "
                        "before tokenizing (default: 32 x --max-model-len, more than any prompt that fits)")
    p.add_argument("--max-schema-chars", type=_bounded(int, 1), default=64 * 1024,
                   help="JSON characters of each tool, response_format, structured_outputs and "
                        "chat_template_kwargs; more get 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto", the default when tools are '
                        "given); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read out of the model's text: hermes (<tool_call> tags: Qwen, "
                        "Hermes), llama3_json (Llama 3.1+), mistral ([TOOL_CALLS]), pythonic ([f(a=1)])")
    add_structured_outputs_flags(p)
    add_lora_flags(p)
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    return p


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (vLLM's flags; docs/lora.md)."""
    from .lora import lora_module_arg

    g = p.add_argument_group("LoRA adapters", "many fine-tunes of the model served at once")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters: clients pick one by its name in `model`")
    g.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=None, metavar="MODULE",
                   help='adapters to load at start: name=path, or \'{"name": ..., "path": ..., '
                        '"base_model_name": ...}\' (needs --enable-lora)')
    g.add_argument("--max-loras", type=_bounded(int, 1, 256), default=None, metavar="N",
                   help="distinct adapters in one batch (default 1)")
    g.add_argument("--max-lora-rank", type=_bounded(int, 1, 512), default=None, metavar="R",
                   help="largest adapter rank accepted (default 16); a larger one is refused")
    g.add_argument("--lora-dtype", choices=("auto", "float32", "float16", "bfloat16"), default=None,
                   help="the adapters' dtype (default auto: the model's); bfloat16 under a float32 model "
                        "halves the adapter bytes a step reads")
    g.add_argument("--max-cpu-loras", type=_bounded(int, 1, 4096), default=None, metavar="N",
                   help="adapters loaded at once (host memory; default --max-loras); POST /v1/load_lora_adapter "
                        "past it answers 400")


def add_structured_outputs_flags(p: argparse.ArgumentParser) -> None:
    """Limits and sharing of grammar compiles (response_format, structured_outputs, tool_choice)."""
    g = p.add_argument_group("structured outputs", "what one grammar may cost, and how compiles are shared")
    g.add_argument("--structured-outputs-compile-timeout", type=_bounded(float, 0.001), default=10.0, metavar="S",
                   help="seconds a grammar may take to compile; a slower one is stopped (its worker process "
                        "killed) and refused with 400")
    g.add_argument("--structured-outputs-compile-max-memory", type=_bounded(int, 1), default=2 * 1024**3,
                   metavar="BYTES", help="memory one grammar compile may take (its worker's growth); past it the "
                                         "worker is killed and the grammar refused with 400")
    g.add_argument("--structured-outputs-compile-workers", type=_bounded(int, 1, 64), default=2, metavar="N",
                   help="grammar-compile worker processes (one client may use at most N-1 of them at once)")
    g.add_argument("--structured-outputs-max-compiles-per-client", type=_bounded(int, 1), default=4, metavar="N",
                   help="grammar compiles one client address may have waiting or running; more get 429")
    g.add_argument("--structured-outputs-max-queued-compiles", type=_bounded(int, 1), default=64, metavar="N",
                   help="grammar compiles allowed to wait for a worker; more get 429")
    g.add_argument("--structured-outputs-max-schema-bytes", type=_bounded(int, 1), default=256 * 1024,
                   metavar="BYTES", help="largest JSON schema (compact JSON) accepted; larger get 400")
    g.add_argument("--structured-outputs-max-depth", type=_bounded(int, 1), default=64, metavar="N",
                   help="deepest JSON nesting of a schema accepted; deeper get 400")
    g.add_argument("--structured-outputs-max-alternatives", type=_bounded(int, 1), default=2048, metavar="N",
                   help="anyOf/oneOf/allOf/enum/prefixItems entries and type lists summed over a schema, or "
                        "choices, accepted; more get 400")
    g.add_argument("--structured-outputs-max-grammar-bytes", type=_bounded(int, 1), default=64 * 1024,
                   metavar="BYTES", help="longest regex, EBNF grammar or total of choices accepted; longer get 400")
    g.add_argument("--structured-outputs-cache-entries", type=_bounded(int, 1), default=256, metavar="N",
                   help="compiled grammars kept for reuse (least recently used go first)")
    g.add_argument("--structured-outputs-cache-bytes", type=_bounded(int, 1), default=512 * 1024 * 1024,
                   metavar="BYTES", help="memory the kept compiled grammars may hold (xgrammar's own estimate)")


def structured_outputs_config(args: argparse.Namespace):
    """The flags as (GrammarLimits, CompileSettings)."""
    from kvserve.runtime.structured_outputs.admission import CompileSettings
    from kvserve.runtime.structured_outputs.limits import GrammarLimits

    limits = GrammarLimits(max_schema_bytes=args.structured_outputs_max_schema_bytes,
                           max_depth=args.structured_outputs_max_depth,
                           max_alternatives=args.structured_outputs_max_alternatives,
                           max_grammar_bytes=args.structured_outputs_max_grammar_bytes)
    settings = CompileSettings(workers=args.structured_outputs_compile_workers,
                               timeout_s=args.structured_outputs_compile_timeout,
                               max_per_client=args.structured_outputs_max_compiles_per_client,
                               max_queued=args.structured_outputs_max_queued_compiles,
                               cache_entries=args.structured_outputs_cache_entries,
                               cache_bytes=args.structured_outputs_cache_bytes,
                               max_compile_bytes=args.structured_outputs_compile_max_memory)
    return limits, settings
