"""The two request-cost attacks against a real `kvserve serve`, measured: how long another user's
30-token chat request takes beside a request with many stop strings, and how long /health takes
to answer while three big chat bodies are being handled. Prints a table and writes JSON under
bench/results/.

    python bench/request_bounds.py                       # the code of this checkout
    PYTHONPATH=/tmp/old python bench/request_bounds.py --label before   # another checkout's code
                                                          # (/tmp/old/kvserve/{runtime,kernels,operator})
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_MODEL = ROOT / "build" / "smollm2" / "SmolLM2-135M-Instruct"
KEY = "bench-key"
VICTIM = {"messages": [{"role": "user", "content": "Tell me about cats."}], "max_tokens": 30, "temperature": 0,
          "ignore_eos": True}


def post(url: str, path: str, body: bytes | dict, timeout: float = 600) -> tuple[int, float, bytes]:
    u = urllib.parse.urlsplit(url)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, time.perf_counter() - t0, raw
    finally:
        conn.close()


def get(url: str, path: str, timeout: float = 60) -> tuple[int, float]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - t0
    finally:
        conn.close()


def launch(model: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvserve.runtime.cli", "serve", str(model), "--port", "0", "--api-key", KEY, *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = None
    for line in proc.stderr:
        if (m := re.search(r"listening on (http://[\d.]+:\d+)", line)):
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        raise SystemExit("the server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if get(url, "/ready", timeout=2)[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server never became ready")


def victim_beside(url: str, attack: dict | None) -> dict:
    """The victim's latency, alone or started 0.5 s after the attacking request."""
    out: dict = {}
    thread = None
    if attack is not None:
        def run():
            status, seconds, raw = post(url, "/v1/chat/completions", attack)
            out["attack_status"], out["attack_s"] = status, round(seconds, 2)
            if status != 200:
                out["attack_error"] = json.loads(raw)["error"]["message"][:100]
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
    status, seconds, _ = post(url, "/v1/chat/completions", VICTIM)
    out["victim_status"], out["victim_s"] = status, round(seconds, 2)
    if thread is not None:
        thread.join()
    return out


def probes_during(url: str, body: bytes, clients: int = 3) -> dict:
    latencies: list[float] = []
    statuses: list = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            status, seconds = get(url, "/health")
            latencies.append(seconds)
            if status != 200:
                statuses.append(status)
            time.sleep(0.05)

    results: list = [None] * clients

    def attack(i):
        status, seconds, raw = post(url, "/v1/chat/completions", body)
        results[i] = (status, round(seconds, 2), json.loads(raw)["error"]["message"][:100] if status != 200 else "")

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.3)
    attackers = [threading.Thread(target=attack, args=(i,)) for i in range(clients)]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    time.sleep(0.3)
    stop.set()
    prober.join()
    return {"health_p50_s": round(statistics.median(latencies), 3), "health_max_s": round(max(latencies), 3),
            "health_probes": len(latencies), "health_not_200": statuses[:5],
            "attack_results": results}


def stop_matching_cost(stops: list[str], tokens: int = 1000) -> dict:
    """The engine thread's detokenizer cost per generated token (add it, read its visible text),
    with a text no stop ever matches: the matching alone, no model; and the setup per request."""
    try:
        from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer
    except ImportError:  # --label before: code from before the engine became a package (main at 602a5fd)
        from kvserve.runtime.detokenizer import IncrementalDetokenizer  # noqa: F401 - that old path on purpose

    decode = lambda ids, skip: "".join("a" if t else "b" for t in ids)  # noqa: E731
    t0 = time.perf_counter()
    d = IncrementalDetokenizer(decode, [0], stop=stops)
    t1 = time.perf_counter()
    for _ in range(tokens):
        d.add_token(1)
        d.visible_text(False)
    return {"us_per_token": round((time.perf_counter() - t1) / tokens * 1e6, 1),
            "setup_ms": round((t1 - t0) * 1e3, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--label", default="after")
    p.add_argument("--server-args", default="", help="extra flags for the server")
    args = p.parse_args(argv)

    rows: dict[str, dict] = {}
    load = {"start": os.getloadavg()}
    for name, stops in (("no stops", []), ("64 stops x 1,024 chars", [chr(0x4E00 + i) * 1024 for i in range(64)]),
                        ("50,000 stops x 8 chars", [f"zq{i:05d}z" for i in range(50_000)])):
        rows[f"stop matching per token, {name}"] = stop_matching_cost(stops)
    proc, url = launch(args.model_dir, args.server_args.split())
    try:
        post(url, "/v1/chat/completions", VICTIM)  # warm-up
        rows["victim alone"] = victim_beside(url, None)
        chat = {"messages": [{"role": "user", "content": "Write a long story."}], "n": 8, "max_tokens": 32,
                "temperature": 1.0, "seed": 0, "ignore_eos": True}
        rows["victim beside n=8, no stops"] = victim_beside(url, chat)
        rows["victim beside 50,000 stops, n=8"] = victim_beside(url, {**chat, "stop": [f"zq{i}qz" for i in range(50_000)]})
        rows["victim beside 64 stops x 1,024 chars, n=8"] = victim_beside(
            url, {**chat, "stop": [chr(0x4E00 + i) * 1024 for i in range(64)]})
        big = json.dumps({"messages": [{"role": "user", "content": f"hello number {i}"} for i in range(150_000)],
                          "max_tokens": 4}).encode()
        rows[f"/health under 3 x {len(big) / 1e6:.1f} MB bodies (150k messages)"] = (
            probes_during(url, big) | {"body_bytes": len(big)})
        # Just within the default limits of an 8,192-token context: 4,096 messages, 262,144 characters.
        per = 32 * 8192 // 4096 - 20
        near = json.dumps({"messages": [{"role": "user", "content": "word " * (per // 5)} for _ in range(4096)],
                           "max_tokens": 4}).encode()
        rows["/health under 3 bodies just within the limits (4,096 messages, 250k chars)"] = (
            probes_during(url, near) | {"body_bytes": len(near)})
        streams = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 32,
                              "ignore_eos": True, "stream": True}).encode()
        rows["/health under 32 concurrent streams (32 tokens each)"] = probes_during(url, streams, clients=32)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    load["end"] = os.getloadavg()

    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    print(f"\n{args.label}: {args.model_dir.name}, {os.cpu_count()} cores, "
          f"avx512f={'avx512f' in flags}, load average {load['start'][0]:.2f} -> {load['end'][0]:.2f}")
    print(f"{'scenario':<72} result")
    for name, row in rows.items():
        if "us_per_token" in row:
            print(f"{name:<72} {row['us_per_token']} us (setup {row['setup_ms']} ms)")
        elif "victim_s" in row:
            extra = f", attacker {row['attack_status']} in {row['attack_s']} s" if "attack_status" in row else ""
            print(f"{name:<72} victim {row['victim_status']} in {row['victim_s']} s{extra}")
        else:
            statuses = sorted({r[0] for r in row["attack_results"]})
            slowest = max(r[1] for r in row["attack_results"])
            print(f"{name:<72} /health p50 {row['health_p50_s']} s, max {row['health_max_s']} s; "
                  f"bodies {statuses} within {slowest} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"request_bounds_{args.label}.json"
    out.write_text(json.dumps({"label": args.label, "model": str(args.model_dir), "machine": platform.machine(),
                               "cores": os.cpu_count(), "avx512f": "avx512f" in flags, "loadavg": load,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
