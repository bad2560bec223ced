"""What model a pod serves, read from its model directory: the agent reports it in /v1/signals.

The operator records it in the InferenceService's status and plans tensor parallelism with it
when the spec has no `model.config` (an hf:// model the operator cannot read itself). The config
is passed on as config.json's own fields, so the operator reads the shape through the same
`ModelShape.from_hf_config` as everyone else.

`describe(config, ...)` is pure. `read_model_info(directory)` does the I/O: a Hugging Face
directory (config.json, safetensors headers) is read in-process; a GGUF file's metadata in a
child process (`kvserve agent model-info DIR`), because the GGUF reader's package imports torch,
which the agent, a small sidecar, does not carry.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_VALUE_LIMIT = 1024  # bytes of JSON per config field passed on (drops label maps and the like)
CONFIG_LIMIT = 16 * 1024   # bytes of JSON for the whole config passed on


def _int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _planning_quantization_config(qc: Mapping[str, Any]) -> dict[str, Any]:
    """A quantization_config without what planning never reads (GPTQModel's provenance `meta`,
    llm-compressor's `ignore` list), a GGUF file's per-tensor types cut to the first layer's plus
    the embedding and LM head: `kvserve.runtime.capacity.weight_format` gives the same format from
    it when every layer has the same types (llama.cpp's `_M` mixes vary a little by layer)."""
    out = {k: v for k, v in qc.items() if k not in ("meta", "ignore")}
    types = out.get("tensor_types")
    if isinstance(types, Mapping):
        out["tensor_types"] = {n: t for n, t in types.items() if ".layers." not in n or ".layers.0." in n}
    return out


def compact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json without its bulky fields (label maps, code references), at most CONFIG_LIMIT.
    A quantization_config over the per-field budget is reduced to what planning reads, not dropped
    (without it the operator would plan a 4-bit model as full precision)."""
    out: dict[str, Any] = {}
    size = 2
    for key in sorted(config):
        if key in ("id2label", "label2id", "auto_map", "task_specific_params", "_name_or_path"):
            continue
        value = config[key]
        if key == "quantization_config" and isinstance(value, Mapping) \
                and len(json.dumps(value, sort_keys=True)) > CONFIG_VALUE_LIMIT:
            value = _planning_quantization_config(value)
        text = json.dumps({key: value}, sort_keys=True)
        if len(text) > CONFIG_VALUE_LIMIT or size + len(text) > CONFIG_LIMIT:
            continue
        out[key] = value
        size += len(text)
    return out


def describe(config: Mapping[str, Any], *, weight_bytes: int | None, fmt: str,
             quantization: str | None = None) -> dict[str, Any]:
    """The summary the agent reports (snake_case, like the rest of /v1/signals)."""
    # Multimodal configs keep the language model's fields in text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    heads = _int(text, "num_attention_heads", "n_head")
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    head_dim = _int(text, "head_dim") or (hidden // heads if hidden and heads else None)
    architectures = config.get("architectures")
    quant = config.get("quantization_config")
    if quantization is None and isinstance(quant, Mapping):
        quantization = quant.get("quant_method") or quant.get("format") or "unknown"
    return {
        "architecture": architectures[0] if isinstance(architectures, list) and architectures else None,
        "model_type": config.get("model_type"),
        "num_layers": _int(text, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": _int(text, "num_key_value_heads", "num_kv_heads") or heads,
        "head_dim": head_dim,
        "intermediate_size": _int(text, "intermediate_size", "n_inner"),
        "vocab_size": _int(text, "vocab_size"),
        "dtype": config.get("dtype") or config.get("torch_dtype") or text.get("torch_dtype"),
        "quantization": quantization,
        "weight_bytes": weight_bytes,
        "format": fmt,
        "config": compact_config(config),
    }


def safetensors_data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (the file minus its header)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path.name}: truncated safetensors file")
        (header,) = struct.unpack("<Q", raw)
    return path.stat().st_size - 8 - header


def _weight_bytes(directory: Path) -> int | None:
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return sum(safetensors_data_bytes(p) for p in shards)
    bins = sorted(directory.glob("pytorch_model*.bin"))
    return sum(p.stat().st_size for p in bins) if bins else None


def read_hf_dir(directory: Path) -> dict[str, Any]:
    config = json.loads((directory / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    has_safetensors = any(directory.glob("*.safetensors"))
    return describe(config, weight_bytes=_weight_bytes(directory),
                    fmt="safetensors" if has_safetensors else "pytorch")


def read_gguf(path: Path) -> dict[str, Any]:
    """In-process (imports the GGUF reader, hence torch): `kvserve agent model-info` runs it."""
    from collections import Counter

    from kvserve.runtime.gguf.config import hf_config
    from kvserve.runtime.gguf.reader import GGUFFile

    with GGUFFile(path) as gf:
        config, _ = hf_config(gf)
        matrices = Counter(info.type_name for info in gf.tensors.values() if len(info.shape) > 1)
        weight_bytes = sum(info.nbytes for info in gf.tensors.values())
    main = matrices.most_common(1)[0][0] if matrices else None
    quantization = None if main in (None, "F32", "F16", "BF16") else f"gguf-{main}"
    return describe(config, weight_bytes=weight_bytes, fmt="gguf", quantization=quantization)


def read_model_dir(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads in this process whatever the directory holds (the CLI's path)."""
    d = Path(directory)
    if (d / "config.json").exists():
        return read_hf_dir(d)
    ggufs = sorted(d.glob("*.gguf")) if d.is_dir() else ([d] if d.suffix.lower() == ".gguf" else [])
    if len(ggufs) == 1:
        return read_gguf(ggufs[0])
    raise ValueError(f"{d}: no config.json and not exactly one .gguf file")


def read_model_info(directory: str | os.PathLike, *, timeout: float = 120.0) -> dict[str, Any] | None:
    """The agent's path: None while the directory holds no model yet; raises when it holds one
    that cannot be read. GGUF metadata is read by a child process (see the module doc)."""
    d = Path(directory)
    if (d / "config.json").exists():
        return read_hf_dir(d)
    if not d.is_dir() or not any(d.glob("*.gguf")):
        return None
    done = subprocess.run([sys.executable, "-m", "kvserve.runtime.cli", "agent", "model-info", str(d)],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ValueError((done.stderr.strip().splitlines() or ["kvserve agent model-info failed"])[-1])
    return json.loads(done.stdout)
