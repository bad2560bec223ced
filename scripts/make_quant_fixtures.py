"""Writes tests/fixtures/quant/: tiny quantized checkpoints made by the tools users quantize with.

Run once, in a separate environment that has the quantizers (they pin transformers versions of
their own, so they stay out of kvserve's dependencies):

    python3 -m venv build/qvenv && build/qvenv/bin/pip install torch==2.13.0
    build/qvenv/bin/pip install -c <(echo torch==2.13.0) llmcompressor compressed-tensors gptqmodel
    PYTHONPATH=tests build/qvenv/bin/python scripts/make_quant_fixtures.py

Each fixture directory holds the quantized checkpoint (config.json with its quantization_config,
model.safetensors, tokenizer), and ``expected.pt``: the quantizing library's own model, run on
CPU right after quantizing, on fixed prompts (last-position logits and 12 greedy tokens). The
tests compare kvserve against that, so CI needs none of these tools. ``PROVENANCE.json`` records
the tool versions.

- ``ct-w4a16-g32``, ``ct-w4a16-asym-g32``, ``ct-w8a16``, ``ct-fp8-dynamic``: llm-compressor's
  ``oneshot`` with a QuantizationModifier (round-to-nearest, no calibration data needed), saved
  compressed (pack-quantized / float-quantized); expected outputs from transformers loading the
  saved directory (compressed-tensors decompresses it on CPU).
- ``gptq-g32``, ``gptq-g32-actorder``: GPTQModel's GPTQ on a few calibration sentences, saved in
  the classic ``gptq`` checkpoint format; expected outputs from GPTQModel's own dequantization of
  each layer (``dequantize_weight``) in a float32 model.
  (Run with GPTQMODEL_CPU_WORKERS=2 on a 2-core machine: its default thread plan asks for more
  workers than such a machine has.)
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "quant"

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 37, 250, 3, 77]]
# Hidden 64 and intermediate 128: group 32 divides every input; vocab 512.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def base_model(tmp: pathlib.Path) -> pathlib.Path:
    from kvserve.testing.tinymodels import build_tiny_model

    return build_tiny_model(tmp / "base", "llama", **TINY)


@torch.no_grad()
def expected_outputs(model) -> dict:
    model.eval()
    logits, greedy = [], []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        logits.append(model(x).logits[0, -1].float().clone())
        out = list(ids)
        for _ in range(12):
            nxt = int(model(torch.tensor([out])).logits[0, -1].argmax())
            out.append(nxt)
        greedy.append(out[len(ids):])
    return {"prompts": PROMPTS, "last_logits": torch.stack(logits), "greedy": greedy}


def compressed_tensors_fixture(base: pathlib.Path, name: str, config_groups: dict) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = OUT / name
    shutil.rmtree(dest, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    recipe = QuantizationModifier(config_groups=config_groups, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(dest, save_compressed=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(dest)
    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    torch.save(expected_outputs(reloaded), dest / "expected.pt")


def gptq_fixture(base: pathlib.Path, name: str, desc_act: bool) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    dest = OUT / name
    shutil.rmtree(dest, ignore_errors=True)
    from kvserve.testing.tinymodels import _CORPUS

    calibration = [line for line in _CORPUS.splitlines() if line.strip()] * 4
    cfg = QuantizeConfig(bits=4, group_size=32, desc_act=desc_act, sym=True)
    model = GPTQModel.load(str(base), cfg, device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(str(dest))
    # GPTQModel's CPU kernels take bfloat16 activations; the oracle is its own dequantization
    # (QuantLinear.dequantize_weight) in a float32 model, so greedy near-ties do not hinge on
    # bf16 rounding.
    quantized = GPTQModel.load(str(dest), device="cpu", dtype=torch.float32)
    model = quantized.model
    for name, module in list(model.named_modules()):
        if hasattr(module, "dequantize_weight"):
            w = module.dequantize_weight().float().t().contiguous()  # [out, in]
            dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=getattr(module, "bias", None) is not None)
            with torch.no_grad():
                dense.weight.copy_(w)
                if dense.bias is not None:
                    dense.bias.copy_(module.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, dense)
    torch.save(expected_outputs(model.float()), dest / "expected.pt")


def main() -> None:
    import importlib.metadata as md
    import tempfile

    OUT.mkdir(parents=True, exist_ok=True)
    which = set(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        base = base_model(pathlib.Path(tmp))
        w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
        cases = {
            "ct-w4a16-g32": lambda: compressed_tensors_fixture(base, "ct-w4a16-g32", {
                "group_0": {"targets": ["Linear"], "weights": w4}}),
            "ct-w4a16-asym-g32": lambda: compressed_tensors_fixture(base, "ct-w4a16-asym-g32", {
                "group_0": {"targets": ["Linear"], "weights": dict(w4, symmetric=False)}}),
            "ct-w8a16": lambda: compressed_tensors_fixture(base, "ct-w8a16", {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                               "strategy": "channel"}}}),
            "ct-fp8-dynamic": lambda: compressed_tensors_fixture(base, "ct-fp8-dynamic", {
                "group_0": {"targets": ["Linear"],
                            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                  "strategy": "token", "dynamic": True}}}),
            "gptq-g32": lambda: gptq_fixture(base, "gptq-g32", desc_act=False),
            "gptq-g32-actorder": lambda: gptq_fixture(base, "gptq-g32-actorder", desc_act=True),
        }
        done = {}
        for name, make in cases.items():
            if which and name not in which:
                continue
            make()
            done[name] = "ok"
            print("wrote", OUT / name)
    provenance_path = OUT / "PROVENANCE.json"
    provenance = json.loads(provenance_path.read_text()) if provenance_path.is_file() else {}
    versions = {}
    for pkg in ("llmcompressor", "compressed-tensors", "gptqmodel", "transformers", "torch"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    for name in done:
        provenance[name] = {"made_by": "scripts/make_quant_fixtures.py", "versions": versions,
                            "base": {"arch": "llama", **TINY, "seed": 0}}
    provenance_path.write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
