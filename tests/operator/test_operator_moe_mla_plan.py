"""The operator plans tensor parallelism for MoE and MLA models from their configs alone: all
experts resident (so a Mixtral does not fit one 80 GiB GPU), DeepSeek-V3's latent KV cache (per
GPU it does not shrink with TP, so a higher degree only frees weight memory), degrees that divide
heads and expert intermediate sizes."""

from __future__ import annotations

import pathlib
import sys

from kvserve.operator.autoscaler import AutoscalerState, Observation, PodSignals, decide, valid_degrees
from kvserve.operator.spec import model_shape, parse_spec
from kvserve.runtime.capacity import GiB, dtype_bytes, kv_bytes_per_token, plan_capacity, weight_bytes_per_gpu

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_capacity_moe_mla import DEEPSEEK_V3, MIXTRAL_8X7B  # noqa: E402

TP_ON = {"minReplicas": 1, "maxReplicas": 2, "targetKVCacheUtilization": 0.5, "targetQueueDepth": 4,
         "panicThreshold": 100, "tensorParallel": {"enabled": True}}


def make_spec(config, tensor, gpu_memory="80Gi"):
    spec = parse_spec({"model": {"uri": "hf://org/m", "config": config}, "gpu": {"memory": gpu_memory},
                       "autoscaling": TP_ON, "parallelism": {"tensor": tensor}})
    return spec, model_shape(spec)


def hot(n, tp, capacity):
    return tuple(PodSignals(f"p{i}", ready=True, stale=False, kv_cache_utilization=0.97, queue_depth=12,
                            requests_running=30, kv_cache_capacity_tokens=capacity, tensor_parallel_size=tp)
                 for i in range(n))


def test_mixtral_needs_two_80gb_gpus_and_tp_grows_capacity():
    spec, shape = make_spec(MIXTRAL_8X7B, {"min": 1, "max": 8, "initial": 2})
    assert shape.moe is not None and spec.runtime.block_size
    # 46.7B parameters in bfloat16 (all 8 experts resident) exceed one GPU's 0.9 x 80 GiB.
    assert weight_bytes_per_gpu(shape, 2) > 0.9 * 80 * GiB
    assert valid_degrees(spec, shape) == [2, 4, 8]
    plans = {tp: plan_capacity(shape, dtype_size=dtype_bytes("bfloat16"), block_size=spec.runtime.block_size,
                               tp=tp, gpu_memory_bytes=80 * GiB) for tp in (2, 4)}
    # GQA KV heads split across ranks: capacity more than doubles from 2 to 4 (weights shrink too).
    assert plans[4].kv_tokens > 2 * plans[2].kv_tokens
    state = AutoscalerState()
    tps = []
    for t in range(0, 60, 10):
        d = decide(spec, shape, Observation(t, 2, 2 if not tps else tps[-1], hot(2, tps[-1] if tps else 2, 100_000)),
                   state)
        state = d.state
        tps.append(d.tp)
    assert tps[0] == 2 and 4 in tps and set(tps) <= {2, 4}


def test_deepseek_v3_degrees_follow_gpu_memory_and_latent_kv():
    spec80, shape = make_spec(DEEPSEEK_V3, {"min": 1, "max": 64, "initial": 32})
    spec141, _ = make_spec(DEEPSEEK_V3, {"min": 1, "max": 64, "initial": 16}, gpu_memory="141Gi")
    # 1.34 TB of bfloat16 weights: 32 x 80 GiB or 16 x 141 GiB GPUs at least.
    assert valid_degrees(spec80, shape) == [32, 64]
    assert valid_degrees(spec141, shape) == [16, 32, 64]
    size = dtype_bytes("bfloat16")
    p16, p32 = (plan_capacity(shape, dtype_size=size, block_size=16, tp=tp, gpu_memory_bytes=141 * GiB)
                for tp in (16, 32))
    # Every rank holds the whole 576-value latent of every layer: 68.6 KiB per token at any degree.
    assert p16.kv_bytes_per_token_per_gpu == p32.kv_bytes_per_token_per_gpu == kv_bytes_per_token(shape, size) == 70272
    # So a higher degree adds tokens only through the weight memory it frees: tokens grow exactly
    # as the per-GPU KV budget does (here 2x, because half of 86 GB of weights is freed).
    budget_ratio = p32.kv_cache_bytes_per_gpu / p16.kv_cache_bytes_per_gpu
    assert abs(p32.kv_tokens / p16.kv_tokens - budget_ratio) < 1e-3
    assert p16.kv_tokens > 600_000  # ~40 GiB left for latents at 68.6 KiB per token


def test_deepseek_v3_tp_goes_up_at_max_replicas_to_a_valid_degree():
    spec, shape = make_spec(DEEPSEEK_V3, {"min": 16, "max": 64, "initial": 16}, gpu_memory="141Gi")
    state, tp = AutoscalerState(), 16
    seen = []
    for t in range(0, 200, 10):
        d = decide(spec, shape, Observation(t, 2, tp, hot(2, tp, 1_200_000)), state)
        state, tp = d.state, d.tp
        seen.append(d.tp)
    assert seen[0] == 16 and 32 in seen and set(seen) <= {16, 32, 64}
