"""Live layout changes (issue 22) on the real SmolLM2, CPU: what a reshape costs against a pod
restart with the new TP, and a low -> high -> low load ramp served with live layouts against the
two fixed ones.

G is the smallest TP > 1 the model's heads allow (SmolLM2-135M: 9 heads, 3 KV heads, so G = 3:
3 x TP1 <-> 1 x TP3).

1. Restart vs reshape: the time from starting `kvserve serve -tp G` to /ready (what a rolling
   restart to TP G pays per pod, before any image pull or model download), against
   POST /admin/parallelism G x TP1 -> 1 x TP G on a running `-dp G` server, idle and with streams
   in flight (the reshape's own `seconds` and the HTTP call's wall time).
2. Ramp: phases of concurrency 1 (low), N (high), 1 (low), each a fixed number of streaming
   requests of random token-id prompts (ignore_eos: every request generates exactly its output
   length). Served by a fixed G x TP1 server, a fixed 1 x TP G server, and a live one that reshapes
   to 1 x TP G before each low phase and to G x TP1 before the high one (what the operator's policy does;
   the reshape counts in the phase's time). Per phase: TTFT, TPOT, output tokens per second.

Every server process and worker gets one torch thread (OMP_NUM_THREADS=1), so each layout uses
G cores. Prints tables, writes bench/results/reshape.json.

    python bench/reshape.py                      # both parts
    python bench/reshape.py --part restart       # part 1 only
    python bench/reshape.py --quick              # smaller ramp
    python bench/reshape.py --device cuda --model DIR --devices 2   # a GPU host: G GPUs, NCCL
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ADMIN = "bench-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model}; {os.cpu_count()} cpus; {' '.join(keep)}"


# After a reshape to G x TP1 the spare workers start again, import torch and (on the CPU) load
# their future shard: a reshape to TP G sooner than that waits for what is left (--spare-wait).
SPARE_WAIT_S = 20.0

DEVICE = "cpu"  # --device: a GPU host runs the same comparison over NCCL (engine i on cuda:i*TP..)


class Server:
    def __init__(self, model: Path, dp: int, tp: int, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KVSERVE_ADMIN_API_KEY": ADMIN}
        if DEVICE == "cpu":
            env["OMP_NUM_THREADS"] = "1"
        kvserve = str(Path(sys.executable).parent / "kvserve")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([kvserve, "serve", str(model), "--port", str(self.port), "--device", DEVICE,
                                      "--served-model-name", "m", "--data-parallel-size", str(dp),
                                      "--tensor-parallel-size", str(tp), "--log-level", "warning", *extra],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self, timeout: float = 600) -> float:
        async with aiohttp.ClientSession() as session:
            deadline = time.perf_counter() + timeout
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}")
                try:
                    async with session.get(self.url + "/ready") as r:
                        if r.status == 200:
                            return time.perf_counter() - self.t0
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError("server not ready")

    async def reshape(self, dp: int, tp: int) -> tuple[float, dict]:
        t = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/admin/parallelism", json={"data_parallel": dp, "tensor_parallel": tp},
                                    headers={"Authorization": f"Bearer {ADMIN}"},
                                    timeout=aiohttp.ClientTimeout(total=600)) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"reshape: HTTP {r.status}: {body}")
        return time.perf_counter() - t, body

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def stream_one(session, url: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    ttft = times[0] - t0 if times else float("nan")
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    # The longest wait between two tokens: across a reshape, the pause this stream saw.
    gap = max((b - a for a, b in zip(times, times[1:])), default=float("nan"))
    return {"ttft": ttft, "tpot": tpot, "tokens": len(times), "e2e": time.perf_counter() - t0, "max_gap": gap}


async def run_phase(url: str, concurrency: int, prompts: list[list[int]], out_len: int) -> dict:
    queue = list(prompts)
    results = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        async def worker():
            while queue:
                p = queue.pop(0)
                results.append(await stream_one(session, url, p, out_len))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0

    def mean(key):
        vals = [r[key] for r in results if r[key] == r[key]]
        return sum(vals) / len(vals) if vals else float("nan")

    tokens = sum(r["tokens"] for r in results)
    gaps = [r["max_gap"] for r in results if r["max_gap"] == r["max_gap"]]
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "ttft_ms": 1000 * mean("ttft"), "tpot_ms": 1000 * mean("tpot"),
            "max_gap_ms": 1000 * max(gaps) if gaps else float("nan")}


def make_prompts(n: int, in_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(in_len)] for _ in range(n)]


def smallest_tp(model: Path) -> int:
    """The smallest TP > 1 the model's heads allow (SmolLM2's 9 heads / 3 KV heads: 3)."""
    from kvserve.runtime.executor.multiproc import check_tensor_parallel
    from kvserve.runtime.model_config import ModelConfig

    config = ModelConfig.from_pretrained(str(model))
    for tp in range(2, 9):
        try:
            check_tensor_parallel(config, tp)
            return tp
        except ValueError:
            continue
    raise SystemExit("the model cannot be split by any TP in 2..8")


async def part_restart(model: Path, g: int, in_flight: int, out_len: int) -> dict:
    out: dict = {"devices": g}
    # A restart with the new TP: process start, imports, weights (page cache warm), pools, ready.
    srv = Server(model, 1, g, [])
    try:
        out["restart_tp_s"] = await srv.ready()
    finally:
        srv.stop()
    # Without spare workers: the new layout's ranks start as fresh interpreters.
    srv = Server(model, g, 1, [])
    try:
        await srv.ready()
        await srv.reshape(1, g)  # once, so the page cache and the allocator are as warm as below
        await srv.reshape(g, 1)
        wall, body = await srv.reshape(1, g)
        out["reshape_idle_to_tp_no_spares"] = {"wall_s": wall, "seconds": body["seconds"],
                                               "phases": body.get("phases", {})}
    finally:
        srv.stop()
    srv = Server(model, g, 1, ["--reshape-spare-workers"])
    try:
        out["start_dp_s"] = await srv.ready()
        await run_phase(srv.url, 1, make_prompts(1, 16, 0), 4)  # warm
        await srv.reshape(1, g)
        await srv.reshape(g, 1)
        await asyncio.sleep(SPARE_WAIT_S)  # the spares started after that reshape import torch, load their shard
        wall, body = await srv.reshape(1, g)
        out["reshape_idle_to_tp"] = {"wall_s": wall, "seconds": body["seconds"], "phases": body.get("phases", {})}
        wall, body = await srv.reshape(g, 1)
        out["reshape_idle_to_dp"] = {"wall_s": wall, "seconds": body["seconds"], "phases": body.get("phases", {})}
        await asyncio.sleep(SPARE_WAIT_S)
        # With streams in flight: they pause, the layout changes, they resume by recompute.
        prompts = make_prompts(in_flight, 64, 1)
        load = asyncio.create_task(run_phase(srv.url, in_flight, prompts, out_len))
        await asyncio.sleep(2.0)
        wall, body = await srv.reshape(1, g)
        out["reshape_loaded_to_tp"] = {"wall_s": wall, "seconds": body["seconds"],
                                       "resumed_requests": body["resumed_requests"], "phases": body.get("phases", {})}
        phase = await load
        out["loaded_requests_completed"] = phase["requests"]
        out["loaded_max_gap_s"] = phase["max_gap_ms"] / 1000  # the longest pause a stream saw
    finally:
        srv.stop()
    out["restart_over_reshape"] = out["restart_tp_s"] / out["reshape_idle_to_tp"]["seconds"]
    out["restart_over_reshape_loaded"] = out["restart_tp_s"] / out["reshape_loaded_to_tp"]["seconds"]
    return out


async def part_tier(model: Path, g: int, in_flight: int, out_len: int, tier_dir: Path) -> dict:
    """The loaded reshape of part 1 twice, without and with a file KV tier (--kv-offload-dir): with
    it the resumed requests read their whole blocks back at the new TP degree instead of
    prefilling them again. Reports the reshape and the longest pause a stream saw."""
    out: dict = {}
    for label, extra in (("recompute", []),
                         ("file tier", ["--kv-offload-dir", str(tier_dir), "--kv-offload-bytes", str(1 << 30)])):
        srv = Server(model, g, 1, ["--reshape-spare-workers", *extra])
        try:
            await srv.ready()
            await run_phase(srv.url, 1, make_prompts(1, 16, 0), 4)  # warm
            await asyncio.sleep(SPARE_WAIT_S)
            load = asyncio.create_task(run_phase(srv.url, in_flight, make_prompts(in_flight, 64, 1), out_len))
            await asyncio.sleep(2.0)
            wall, body = await srv.reshape(1, g)
            phase = await load
            out[label] = {"wall_s": wall, "seconds": body["seconds"], "resumed_requests": body["resumed_requests"],
                          "phases": body.get("phases", {}), "max_gap_s": phase["max_gap_ms"] / 1000,
                          "completed": phase["requests"]}
        finally:
            srv.stop()
    return out


async def part_transient(model: Path, g: int, in_flight: int, out_len: int, rounds: int) -> dict:
    """No configured tier: streams in flight across G x TP1 -> 1 x TP G and back, their KV moved
    by the transient tier (runtime/engine/reshape_kv.py) or recomputed (the server started with
    KVSERVE_RESHAPE_KV_BYTES=0). The two alternate, `rounds` times each, one server at a time."""
    runs = []
    for i in range(rounds):
        for label in ("recompute", "transient"):
            env_before = os.environ.get("KVSERVE_RESHAPE_KV_BYTES")
            if label == "recompute":
                os.environ["KVSERVE_RESHAPE_KV_BYTES"] = "0"
            srv = Server(model, g, 1, ["--reshape-spare-workers"])
            if env_before is None:
                os.environ.pop("KVSERVE_RESHAPE_KV_BYTES", None)
            else:
                os.environ["KVSERVE_RESHAPE_KV_BYTES"] = env_before
            run: dict = {"label": label, "round": i, "load_before": os.getloadavg()[0]}
            try:
                await srv.ready()
                await run_phase(srv.url, 1, make_prompts(1, 16, 0), 4)  # warm
                await asyncio.sleep(SPARE_WAIT_S)
                for key, (dp, tp) in (("to_tp", (1, g)), ("to_dp", (g, 1))):
                    load = asyncio.create_task(run_phase(srv.url, in_flight, make_prompts(in_flight, 64, 1 + i),
                                                         out_len))
                    await asyncio.sleep(2.0)
                    wall, body = await srv.reshape(dp, tp)
                    phase = await load
                    run[key] = {"wall_s": wall, "seconds": body["seconds"], "resumed_requests": body["resumed_requests"],
                                "phases": body.get("phases", {}), "max_gap_s": phase["max_gap_ms"] / 1000,
                                "completed": phase["requests"], "tok_per_s": phase["tok_per_s"]}
                async with aiohttp.ClientSession() as session:  # the moves' records, read blocks filled in
                    async with session.get(srv.url + "/admin/parallelism",
                                           headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                        history = (await r.json())["history"]
                for key, rec in zip(("to_tp", "to_dp"), history[-2:]):
                    run[key]["kv"] = rec.get("kv")
            finally:
                srv.stop()
            run["load_after"] = os.getloadavg()[0]
            runs.append(run)
    return {"in_flight": in_flight, "out_len": out_len, "runs": runs}


def print_transient(r: dict) -> None:
    print(f"\n== {r['in_flight']} streams in flight across G x TP1 -> 1 x TP G -> G x TP1, no configured tier: "
          "recompute vs transient KV tier ==")
    print(f"{'resume by':10s} {'rnd':>3s} {'load':>9s} {'direction':9s} {'reshape s':>9s} {'wall s':>7s} "
          f"{'longest pause s':>15s} {'moved/written/read blocks':>26s}")
    for run in r["runs"]:
        for key in ("to_tp", "to_dp"):
            row = run.get(key)
            if row is None:
                continue
            kv = row.get("kv") or {}
            moved = f"{kv.get('requests', 0)}/{kv.get('written_blocks', 0)}/{kv.get('read_blocks', 0)}"
            print(f"{run['label']:10s} {run['round']:3d} {run['load_before']:4.1f}-{run['load_after']:<4.1f} "
                  f"{key:9s} {row['seconds']:9.2f} {row['wall_s']:7.2f} {row['max_gap_s']:15.2f} {moved:>26s}")


def print_tier(r: dict) -> None:
    print("\n== reshape G x TP1 -> 1 x TP G with streams in flight: recompute vs file KV tier ==")
    print(f"{'resume by':12s} {'reshape s':>9s} {'HTTP wall s':>11s} {'longest stream pause s':>22s} {'resumed':>7s}")
    for label, row in r.items():
        print(f"{label:12s} {row['seconds']:9.2f} {row['wall_s']:11.2f} {row['max_gap_s']:22.2f} "
              f"{row['resumed_requests']:7d}")


async def part_ramp(model: Path, g: int, high: int, n_low: int, n_high: int, in_len: int, out_len: int) -> dict:
    phases = [("low", 1, make_prompts(n_low, in_len, 10)), ("high", high, make_prompts(n_high, in_len, 11)),
              ("low again", 1, make_prompts(n_low, in_len, 12))]
    out: dict = {}
    reshape_phases: list[tuple[str, dict]] = []
    for name, (dp, tp, live) in {f"fixed {g}xTP1": (g, 1, False), f"fixed 1xTP{g}": (1, g, False),
                                 "live": (g, 1, True)}.items():
        srv = Server(model, dp, tp, ["--reshape-spare-workers"] if live else [])
        try:
            await srv.ready()
            await run_phase(srv.url, 2, make_prompts(2, 16, 99), 4)  # warm
            rows = []
            total_tokens, total_wall = 0, 0.0
            for phase, conc, prompts in phases:
                t0 = time.perf_counter()
                reshape_s = 0.0
                if live:
                    want = (g, 1) if conc > 1 else (1, g)
                    _, body = await srv.reshape(*want)
                    reshape_s = body["seconds"]
                    if body.get("changed"):
                        reshape_phases.append((f"ramp {phase}: to {want[0]}xTP{want[1]}", body))
                row = await run_phase(srv.url, conc, prompts, out_len)
                row["wall_s"] = time.perf_counter() - t0  # with the reshape
                row["tok_per_s"] = row["tokens"] / row["wall_s"]
                row.update(phase=phase, concurrency=conc, reshape_s=reshape_s)
                rows.append(row)
                total_tokens += row["tokens"]
                total_wall += row["wall_s"]
            out[name] = {"phases": rows, "tok_per_s": total_tokens / total_wall, "wall_s": total_wall}
        finally:
            srv.stop()
    out["live"]["reshapes"] = [{"label": label, **rec} for label, rec in reshape_phases]
    return out


def print_restart(r: dict) -> None:
    g = r["devices"]
    print(f"\n== restart with TP {g} vs live reshape (G = {g}, CPU) ==")
    print(f"{'what':48s} {'seconds':>9s}")
    print(f"{f'restart: kvserve serve -tp {g} until /ready':48s} {r['restart_tp_s']:9.2f}")
    for key, label in (("reshape_idle_to_tp_no_spares", f"reshape {g}xTP1 -> 1xTP{g}, idle, no spares"),
                       ("reshape_idle_to_tp", f"reshape {g}xTP1 -> 1xTP{g}, idle"),
                       ("reshape_idle_to_dp", f"reshape 1xTP{g} -> {g}xTP1, idle"),
                       ("reshape_loaded_to_tp", f"reshape {g}xTP1 -> 1xTP{g}, streams in flight")):
        print(f"{label:48s} {r[key]['seconds']:9.2f}  (HTTP wall {r[key]['wall_s']:.2f})")
    print("(reshapes with --reshape-spare-workers unless said otherwise)")
    print_phases([(label, r[key]) for key, label in (
        ("reshape_idle_to_tp_no_spares", f"{g}xTP1 -> 1xTP{g}, no spares"), ("reshape_idle_to_tp", f"{g}xTP1 -> 1xTP{g}"),
        ("reshape_idle_to_dp", f"1xTP{g} -> {g}xTP1"), ("reshape_loaded_to_tp", f"{g}xTP1 -> 1xTP{g}, loaded"))])
    print(f"restart / reshape to TP {g}: {r['restart_over_reshape']:.1f}x idle, "
          f"{r['restart_over_reshape_loaded']:.1f}x with {r['reshape_loaded_to_tp'].get('resumed_requests')} "
          f"requests resumed ({r['loaded_requests_completed']} completed); the longest pause a stream saw "
          f"between two tokens: {r.get('loaded_max_gap_s', float('nan')):.2f}s")


def print_phases(rows: list[tuple[str, dict]]) -> None:
    """Where each reshape's seconds went (runtime/engine/data_parallel.py's phases): stop (the
    step in flight finishes, requests detach), free (old engines closed), start (the new layout's
    engines: processes, weights, KV pools), resume (requests re-admitted)."""
    names = ("stop", "free", "start", "resume")
    print(f"\n{'reshape phases, seconds':32s} " + " ".join(f"{n:>7s}" for n in names))
    for label, rec in rows:
        ph = rec.get("phases", {})
        print(f"{label:32s} " + " ".join(f"{ph.get(n, float('nan')):7.2f}" for n in names))


def print_ramp(r: dict) -> None:
    print("\n== load ramp: low -> high -> low ==")
    print(f"{'layout':12s} {'phase':10s} {'conc':>4s} {'TTFT ms':>9s} {'TPOT ms':>9s} {'tok/s':>8s} {'reshape s':>9s}")
    for name, res in r.items():
        if "phases" not in res:
            continue
        for row in res["phases"]:
            print(f"{name:12s} {row['phase']:10s} {row['concurrency']:4d} {row['ttft_ms']:9.1f} {row['tpot_ms']:9.1f} "
                  f"{row['tok_per_s']:8.1f} {row['reshape_s']:9.2f}")
        print(f"{name:12s} {'whole ramp':10s} {'':4s} {'':9s} {'':9s} {res['tok_per_s']:8.1f}")
    if r.get("live", {}).get("reshapes"):
        print_phases([(rec["label"], rec) for rec in r["live"]["reshapes"]])


def main(argv=None) -> int:
    global DEVICE, SPARE_WAIT_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: the real SmolLM2)")
    p.add_argument("--part", choices=["all", "restart", "ramp", "tier", "transient"], default="all",
                   help="tier (not in all): the loaded reshape with and without a file KV tier; "
                        "transient (not in all): no tier, KV moved through RAM vs recomputed")
    p.add_argument("--rounds", type=int, default=2, help="--part transient: alternations of the two")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a host with G GPUs")
    p.add_argument("--devices", type=int, default=None,
                   help="G: layouts G x TP1 and 1 x TP G (default: the smallest TP > 1 the model's heads allow)")
    p.add_argument("--spare-wait", type=float, default=SPARE_WAIT_S,
                   help="seconds between a reshape to G x TP1 and the next one to TP G (spares get ready)")
    args = p.parse_args(argv)
    DEVICE = args.device
    SPARE_WAIT_S = args.spare_wait
    model = args.model
    if model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    result = {"machine": cpu_flags(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model": str(model), "command": "python bench/reshape.py " + " ".join(argv or sys.argv[1:])}
    g = args.devices or smallest_tp(model)
    result["devices"] = g
    if args.part in ("all", "restart"):
        result["restart"] = asyncio.run(part_restart(model, g, in_flight=8, out_len=64))
        print_restart(result["restart"])
    if args.part == "tier":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvserve-reshape-tier-") as tier:
            result["tier"] = asyncio.run(part_tier(model, g, in_flight=8, out_len=64, tier_dir=Path(tier)))
        print_tier(result["tier"])
    if args.part == "transient":
        result["transient"] = asyncio.run(part_transient(model, g, in_flight=8, out_len=64, rounds=args.rounds))
        print_transient(result["transient"])
    if args.part in ("all", "ramp"):
        n_low, n_high, high = (3, 16, 8) if args.quick else (6, 48, 16)
        result["ramp"] = asyncio.run(part_ramp(model, g, high, n_low, n_high, in_len=64, out_len=32))
        print_ramp(result["ramp"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reshape.json").write_text(json.dumps(result, indent=1))
    print(f"\nmachine: {result['machine']}\nwrote {RESULTS / 'reshape.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
