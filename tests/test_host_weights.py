"""Loaded weights kept in host memory (runtime/models/host_weights.py), which a live layout change
(issue 22) builds its engines from: a shard loaded again is the same tensors, gives the same
logits as a model read from the checkpoint, and never reads the checkpoint; other shards, a
checkpoint rewritten in place and released holders read the checkpoint as before."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_models import PagedCache

from kvserve.runtime.attention import TorchAttentionBackend
from kvserve.runtime.models import host_weights, load_model


def _load(model_dir, **kw):
    return load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(), **kw)


def test_a_shard_loaded_again_comes_from_host_memory_with_the_same_logits(tiny_llama, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama, model_dir)
    reference = _load(tiny_llama)  # not kept: nothing retained
    assert host_weights.keys() == []
    with host_weights.retained():
        first = _load(model_dir)
        assert len(host_weights.keys()) == 1
        for f in model_dir.glob("*.safetensors"):  # the second load cannot read the checkpoint:
            st = f.stat()                             # zeros, same size and time (the same key)
            f.write_bytes(bytes(st.st_size))
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        again = _load(model_dir)
        assert again is not first
        params = dict(first.named_parameters())
        assert all(p is params[name] for name, p in again.named_parameters())  # shared, not copied
        assert set(params) == {name for name, _ in again.named_parameters()}
        # the packed panels' attributes came along (the native kernels read them)
        packed = [n for n, m in first.named_modules() if getattr(m, "packed_out_features", None)]
        assert packed and all(dict(again.named_modules())[n].packed_out_features for n in packed)
        prompts = [[5, 9, 11, 3, 7], [17, 4]]
        want = PagedCache(reference, 32, seed=1).step(reference, list(enumerate(prompts)))
        got = PagedCache(again, 32, seed=1).step(again, list(enumerate(prompts)))
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        with pytest.raises(ValueError, match="safetensors"):  # another shard is not the kept one
            _load(model_dir, tp_rank=1, tp_size=2)
        for f in model_dir.glob("*.safetensors"):  # a checkpoint rewritten in place: never the old tensors
            os.utime(f, ns=(0, f.stat().st_mtime_ns + 1))
        with pytest.raises(ValueError, match="safetensors"):
            _load(model_dir)
    assert host_weights.keys() == []  # released: forgotten
    with pytest.raises(ValueError, match="safetensors"):
        _load(model_dir)
