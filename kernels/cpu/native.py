"""kvserve's native CPU kernels: kvserve_cpu.c built with the system C compiler at first use.

The library is compiled once per (source, flags, compiler) into a cache folder
(``$KVSERVE_CPU_KERNELS_CACHE``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``;
created with mode 0700) and loaded with ctypes: no torch headers, so a build takes a few seconds.
Loading a library runs its code, and its name is predictable, so a cached library is loaded only
when the folder and the file belong to this user and nobody else can write them; otherwise it is
rebuilt (into a private temporary folder when the cache folder itself is not trusted).
Every wrapper takes and returns torch CPU float32 tensors; the callers (kernels/ops.py, the
linear layers, the torch attention backend) decide when to use them through ``available()``.

Nothing here is required: without an x86-64 CPU with AVX2 and FMA, without a C compiler, or with
``KVSERVE_CPU_KERNELS=0``, ``available()`` is False (``status()`` says why) and every caller keeps
its torch path.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("kvserve_cpu.c")
ENV_VAR = "KVSERVE_CPU_KERNELS"
CACHE_ENV_VAR = "KVSERVE_CPU_KERNELS_CACHE"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
ABI_VERSION = 15
TILE = 16  # output rows per packed panel (kvserve_cpu.c's TILE)
# Query heads per KV head the decode kernels are tested with (Falcon-7B's multi-query 71 included);
# their score rows are heap-allocated per group, so the bound is a tested range, not a buffer size.
MAX_GQA_GROUP = 128

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_T = ctypes.c_int
_SIGNATURES = {
    "kv_abi_version": ([], ctypes.c_int),
    "kv_pack_f32": ([_P, _I, _I, _P, _T], None),
    "kv_gather_packed_rows_f32": ([_P, _I, _P, _I, _P], None),
    "kv_linear_f32": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _T], None),
    "kv_pack_q8": ([_P, _P, _I, _I, _I, _P, _P, _T], None),
    "kv_pack_q4": ([_P, _P, _P, _I, _I, _I, _P, _P, _P, _T], None),
    "kv_gather_rows_q8": ([_P, _I, _P, _P, _I, _I, _P], None),
    "kv_gather_rows_q4": ([_P, _I, _P, _P, _P, _I, _I, _P], None),
    "kv_linear_q8": ([_P, _I, _I, _I, _P, _P, _I, _I, _P, _I, _T], None),
    "kv_linear_q4": ([_P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _I, _T], None),
    "kv_pack_nf4": ([_P, _P, _I, _I, _I, _P, _P, _T], None),
    "kv_linear_nf4": ([_P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _I, _T], None),
    "kv_gather_rows_nf4": ([_P, _I, _P, _P, _P, _I, _I, _P], None),
    "kv_silu_and_mul_f32": ([_P, _I, _I, _I, _P, _I, _T], None),
    "kv_rms_norm_f32": ([_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _T], None),
    "kv_rotary_f32": ([_P, _I, _P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _T], None),
    "kv_write_kv_f32": ([_P, _I, _P, _I, _I, _I, _P, _P, _P], None),
    "kv_decoder_stack_workspace": ([_P, _I], ctypes.c_int64),
    "kv_decoder_stack_f32": ([_P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _T], None),
    "kv_apply_bitmask_f32": ([_P, _I, _P, _I, _P, _I, _I, _T], None),
    "kv_paged_decode_f32": ([_P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _F, _I, _F, _P, _P, _P, _T], None),
}


class _State:
    lib: ctypes.CDLL | None = None
    reason: str = "not loaded yet"


_state = _State()


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cache_dir() -> pathlib.Path:
    """Where compiled libraries are kept: $KVSERVE_CPU_KERNELS_CACHE, else
    $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    if os.environ.get(CACHE_ENV_VAR):
        return pathlib.Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or (pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "kvserve"


def cache_key(source: bytes, flags: tuple[str, ...], compiler_version: str) -> str:
    return hashlib.sha256(source + " ".join(flags).encode() + compiler_version.encode()).hexdigest()[:16]


def untrusted(st: os.stat_result, path: object, kind: str, *, uid: int | None = None) -> str | None:
    """Why a cache folder (kind "folder") or library ("file") with this stat could have been
    written by someone other than this user, or None. Loading a library runs its code, so
    anything another user could have created or replaced is refused."""
    uid = os.geteuid() if uid is None else uid
    if kind == "folder" and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class _Untrusted(Exception):
    pass


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def _compile(compiler: str, out: pathlib.Path) -> None:
    proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
    # gcc gives the output 0777 minus the umask: a umask of 0 would leave it world-writable.
    os.chmod(out, 0o700)


def _dlopen_trusted(path: pathlib.Path) -> ctypes.CDLL:
    """Loads `path` only if this user owns it and nobody else can write it. O_NOFOLLOW: a
    symbolic link could point anywhere; the inode is compared again just before dlopen (the
    folder is trusted, so nobody else can swap the file in between)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Untrusted(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        problem = untrusted(st, path, "file")
        if problem:
            raise _Untrusted(problem)
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _Untrusted(f"{path} was replaced while it was checked")
        return ctypes.CDLL(str(path))
    finally:
        os.close(fd)


def _trusted_cache(folder: pathlib.Path) -> str | None:
    """Creates the cache folder (mode 0700); why it cannot be trusted, or None."""
    try:
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        return untrusted(folder.stat(), folder, "folder")
    except OSError as exc:
        return f"{folder} cannot be created ({exc.strerror or exc})"


def _publish(compiler: str, folder: pathlib.Path, target: pathlib.Path) -> None:
    """Builds in a private folder inside the cache, then renames: a concurrent builder or loader
    never sees half a file."""
    build_dir = pathlib.Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    try:
        out = build_dir / target.name
        _compile(compiler, out)
        os.replace(out, target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def _load_library(compiler: str) -> ctypes.CDLL:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    name = f"kvserve_cpu-{cache_key(SOURCE.read_bytes(), FLAGS, version)}.so"
    folder = cache_dir()
    problem = _trusted_cache(folder)
    if problem is None:
        target = folder / name
        try:
            return _dlopen_trusted(target)
        except FileNotFoundError:
            pass
        except _Untrusted as exc:  # in our own folder: replace it with a fresh build
            log.warning("native CPU kernels: not loading %s; rebuilding it", exc)
        _publish(compiler, folder, target)
        return _dlopen_trusted(target)
    # Never a shared fallback folder (anyone could plant the library there under its
    # predictable name): a private one, gone once the library is loaded.
    log.warning("native CPU kernels: the cache folder is not safe to load from (%s); building into a private "
                "temporary folder instead (every start rebuilds). Set %s to a folder owned by this user with "
                "mode 0700 to cache the build", problem, CACHE_ENV_VAR)
    with tempfile.TemporaryDirectory(prefix="kvserve-cpu-") as private:
        out = pathlib.Path(private) / name
        _compile(compiler, out)
        return _dlopen_trusted(out)


def _load() -> None:
    if os.environ.get(ENV_VAR, "1").strip().lower() in {"0", "false", "no", "off"}:
        _state.reason = f"disabled by {ENV_VAR}=0"
        return
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        _state.reason = f"needs an x86-64 CPU (this is {platform.machine()})"
        return
    flags = _cpu_flags()
    if flags and not {"avx2", "fma"} <= flags:
        _state.reason = "needs a CPU with AVX2 and FMA"
        return
    compiler = _compiler()
    if compiler is None:
        _state.reason = "no C compiler (gcc or $CC) on PATH"
        return
    try:
        lib = _load_library(compiler)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        if lib.kv_abi_version() != ABI_VERSION:
            raise RuntimeError(f"ABI version {lib.kv_abi_version()} != {ABI_VERSION}")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError, _Untrusted) as exc:
        _state.reason = f"build or load failed: {exc}"
        log.warning("native CPU kernels unavailable (%s); using the torch path", _state.reason)
        return
    _state.lib, _state.reason = lib, "loaded"


@functools.cache
def _ensure_loaded() -> None:
    _load()


def available() -> bool:
    """True when the native kernels are built and loaded (builds them on first call)."""
    _ensure_loaded()
    return _state.lib is not None


def status() -> str:
    """'loaded', or why the native kernels are not in use."""
    _ensure_loaded()
    return _state.reason


def _lib() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {_state.reason}")
    return _state.lib  # type: ignore[return-value]


def _threads() -> int:
    return torch.get_num_threads()


def _check_f32(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise ValueError(f"{name}: native CPU kernels take float32 CPU tensors, got {t.dtype} on {t.device}")


def supports(t: torch.Tensor) -> bool:
    """Whether the native kernels can take this activation tensor (float32 on the CPU)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and available()


# ------------------------------------------------------------------------------------ matmul


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the packed panels [ceil(N / 16), K, 16] that linear() reads."""
    _check_f32("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2-D [out, in], got shape {tuple(weight.shape)}")
    w = weight.contiguous()
    n, k = w.shape
    out = torch.empty(-(-n // TILE), k, TILE, dtype=torch.float32)
    _lib().kv_pack_f32(w.data_ptr(), n, k, out.data_ptr(), _threads())
    return out


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the original weight, read out of its packed panels (an embedding lookup)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    k = packed.shape[1]
    out = torch.empty(ids.shape[0], k, dtype=torch.float32)
    _lib().kv_gather_packed_rows_f32(ids.data_ptr(), ids.shape[0], packed.data_ptr(), k, out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) over the last dimension of x, W given as pack_weight(W)."""
    _check_f32("x", x)
    k = packed.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} != the weight's in_features {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        b = None
        if bias is not None:
            b = bias.contiguous()
        _lib().kv_linear_f32(x2.data_ptr(), m, k, x2.stride(0), packed.data_ptr(), out_features,
                             None if b is None else b.data_ptr(), out.data_ptr(), out_features, _threads())
    return out.view(*lead, out_features)


# ------------------------------------------------------------------- weight-only integer matmuls


class Int8Panels:
    """An int8 weight (w = q * scale, one scale per (row, group of `group_size` inputs)) repacked
    for linear_q8: q as [ceil(N / 16), K, 16] int8 panels, scales as [ceil(N / 16), K / group, 16]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group_size: int):
        n, k = q.shape
        if k % group_size or scale.shape != (n, k // group_size):
            raise ValueError(f"int8 weight [{n}, {k}]: scale {tuple(scale.shape)} does not fit group {group_size}")
        tiles = -(-n // TILE)
        self.n, self.k, self.group_size = n, k, group_size
        self.q = torch.empty(tiles, k, TILE, dtype=torch.int8)
        self.scale = torch.empty(tiles, k // group_size, TILE, dtype=torch.float32)
        qc, sc = q.to(torch.int8).contiguous(), scale.to(torch.float32).contiguous()
        _lib().kv_pack_q8(qc.data_ptr(), sc.data_ptr(), n, k, group_size, self.q.data_ptr(), self.scale.data_ptr(),
                          _threads())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"int8_panels": self.q, "int8_panel_scales": self.scale}

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _row_ids(ids, self.n)
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        _lib().kv_gather_rows_q8(ids.data_ptr(), ids.shape[0], self.q.data_ptr(), self.scale.data_ptr(), self.k,
                                 self.group_size, out.data_ptr())
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _matmul_rows(x, self.k)
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        if x2.shape[0]:
            _lib().kv_linear_q8(x2.data_ptr(), x2.shape[0], self.k, x2.stride(0), self.q.data_ptr(),
                                self.scale.data_ptr(), self.n, self.group_size, out.data_ptr(), self.n, _threads())
        return out.view(*lead, self.n)


class Int4Panels:
    """An int4 weight (w = q * scale + offset, q in 0..15, per (row, group)) repacked for
    linear_q4: [ceil(N / 16), K, 8] bytes (row j in the low nibble of byte j, row j + 8 in its high
    nibble), scales and offsets [ceil(N / 16), K / group, 16]. The group size must be even."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int):
        n, k = q.shape
        if k % group_size or group_size % 2 or scale.shape != (n, k // group_size) or offset.shape != scale.shape:
            raise ValueError(f"int4 weight [{n}, {k}]: scale {tuple(scale.shape)} / offset {tuple(offset.shape)} "
                             f"do not fit an even group {group_size}")
        tiles = -(-n // TILE)
        self.n, self.k, self.group_size = n, k, group_size
        self.q = torch.empty(tiles, k, TILE // 2, dtype=torch.uint8)
        self.scale = torch.empty(tiles, k // group_size, TILE, dtype=torch.float32)
        self.offset = torch.empty_like(self.scale)
        qc = q.to(torch.uint8).contiguous()
        sc, oc = scale.to(torch.float32).contiguous(), offset.to(torch.float32).contiguous()
        _lib().kv_pack_q4(qc.data_ptr(), sc.data_ptr(), oc.data_ptr(), n, k, group_size, self.q.data_ptr(),
                          self.scale.data_ptr(), self.offset.data_ptr(), _threads())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"int4_panels": self.q, "int4_panel_scales": self.scale, "int4_panel_offsets": self.offset}

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _row_ids(ids, self.n)
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        _lib().kv_gather_rows_q4(ids.data_ptr(), ids.shape[0], self.q.data_ptr(), self.scale.data_ptr(),
                                 self.offset.data_ptr(), self.k, self.group_size, out.data_ptr())
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _matmul_rows(x, self.k)
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        if x2.shape[0]:
            _lib().kv_linear_q4(x2.data_ptr(), x2.shape[0], self.k, x2.stride(0), self.q.data_ptr(),
                                self.scale.data_ptr(), self.offset.data_ptr(), self.n, self.group_size,
                                out.data_ptr(), self.n, _threads())
        return out.view(*lead, self.n)


class CodebookPanels:
    """A 4-bit codebook weight (bitsandbytes NF4 / FP4: w = codebook[code] * absmax per (row,
    block)) repacked for linear_nf4: codes [N, K / 2] (first of a pair in the high nibble) become
    int4 panels [ceil(N / 16), K, 8] (Int4Panels' layout), absmax [ceil(N / 16), K / block, 16].
    The block size must be even."""

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, block: int):
        n, half = codes.shape
        k = 2 * half
        if codes.dtype != torch.uint8 or k % block or block % 2 or absmax.shape != (n, k // block) \
                or codebook.numel() != 16:
            raise ValueError(f"4-bit codebook weight [{n}, {k}]: needs uint8 codes, absmax ({n}, {k // block}) "
                             f"and 16 codebook values for an even block {block}; got {codes.dtype}, "
                             f"{tuple(absmax.shape)}, {codebook.numel()}")
        tiles = -(-n // TILE)
        self.n, self.k, self.block = n, k, block
        self.q = torch.empty(tiles, k, TILE // 2, dtype=torch.uint8)
        self.absmax = torch.empty(tiles, k // block, TILE, dtype=torch.float32)
        self.codebook = codebook.to(torch.float32).reshape(16).contiguous()
        cc, ac = codes.contiguous(), absmax.to(torch.float32).contiguous()
        _lib().kv_pack_nf4(cc.data_ptr(), ac.data_ptr(), n, k, block, self.q.data_ptr(), self.absmax.data_ptr(),
                           _threads())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"bnb4_panels": self.q, "bnb4_panel_absmax": self.absmax, "bnb4_quant_map": self.codebook}

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _row_ids(ids, self.n)
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        _lib().kv_gather_rows_nf4(ids.data_ptr(), ids.shape[0], self.q.data_ptr(), self.absmax.data_ptr(),
                                  self.codebook.data_ptr(), self.k, self.block, out.data_ptr())
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _matmul_rows(x, self.k)
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        if x2.shape[0]:
            _lib().kv_linear_nf4(x2.data_ptr(), x2.shape[0], self.k, x2.stride(0), self.q.data_ptr(),
                                 self.absmax.data_ptr(), self.codebook.data_ptr(), self.n, self.block,
                                 out.data_ptr(), self.n, _threads())
        return out.view(*lead, self.n)


def _row_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"row ids must be in [0, {n})")
    return ids


def _matmul_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Size]:
    _check_f32("x", x)
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} != the weight's in_features {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x.shape[:-1]


# ------------------------------------------------------------------------------- layer ops


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.float32)
    w = weight.contiguous()
    _lib().kv_rms_norm_f32(x2.data_ptr(), x2.stride(0), None, 0, None, w.data_ptr(), out.data_ptr(),
                           x2.shape[0], x2.shape[1], eps, _threads())
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=torch.float32)
    summed = torch.empty(x2.shape, dtype=torch.float32)
    w = weight.contiguous()
    _lib().kv_rms_norm_f32(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), summed.data_ptr(),
                           w.data_ptr(), out.data_ptr(), x2.shape[0], x2.shape[1], eps, _threads())
    return out.view(x.shape), summed.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=torch.float32)
    _lib().kv_silu_and_mul_f32(x2.data_ptr(), x2.shape[0], inter, x2.stride(0), out.data_ptr(), inter, _threads())
    return out.view(*x.shape[:-1], inter)


def _heads_view_ok(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rotary_supported(query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    return (query.dtype == key.dtype == torch.float32 and cos_sin_cache.dtype == torch.float32
            and _heads_view_ok(query) and _heads_view_ok(key) and query.shape[2] == key.shape[2]
            and cos_sin_cache.shape[1] <= query.shape[2] and cos_sin_cache.shape[1] % 2 == 0)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotate-half rotary of q [T, Hq, D] and k [T, Hk, D] (row-strided views are fine)."""
    t, hq, d = query.shape
    hk = key.shape[1]
    pos = positions.to(torch.int64).contiguous()
    cs = cos_sin_cache.contiguous()
    q_out = torch.empty(t, hq, d, dtype=torch.float32)
    k_out = torch.empty(t, hk, d, dtype=torch.float32)
    _lib().kv_rotary_f32(pos.data_ptr(), t, query.data_ptr(), query.stride(0), hq, key.data_ptr(), key.stride(0), hk,
                         d, cs.shape[1], cs.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), _threads())
    return q_out, k_out


# --------------------------------------------------------------------------------- attention


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def write_kv_supported(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (key.dtype == value.dtype == k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and _rows_contiguous(key) and _rows_contiguous(value) and key.shape == value.shape
            and key.shape[1:] == k_cache.shape[2:])


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Rows of key/value [T, Hkv, D] (row-strided views are fine) into flat cache slots; -1 skips."""
    slots = slot_mapping.to(torch.int64).contiguous()
    if not v_cache.is_contiguous():
        raise ValueError("v_cache must be contiguous")
    row = key.shape[1] * key.shape[2]
    _lib().kv_write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key.shape[0], row,
                           slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())


def decode_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (query.dtype == k_cache.dtype == torch.float32 and query.device.type == "cpu"
            and k_cache.is_contiguous() and query.shape[1] % k_cache.shape[2] == 0
            and query.shape[1] // k_cache.shape[2] <= MAX_GQA_GROUP and available())


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int = 0, softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None,
                           tree_masks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence (query [S, Hq, D]) over its paged K/V; float32 math.
    `alibi_slopes` (float32 [Hq]) adds slope_h * (j - i) to each score after soft-capping.
    `tree_masks` (int64 [S]): rows that are candidate-tree nodes (kvserve_cpu.c's
    kv_paged_decode_f32 says how a mask reads); not with a window or ALiBi."""
    q = query.contiguous()
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32).contiguous()
        if slopes.shape != (q.shape[1],):
            raise ValueError(f"alibi_slopes: expected shape ({q.shape[1]},), got {tuple(slopes.shape)}")
    s, hq, d = q.shape
    bt = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    masks = _tree_masks(tree_masks, s, window, slopes)
    out = torch.empty_like(q)
    _lib().kv_paged_decode_f32(q.data_ptr(), s, hq, k_cache.shape[2], d, k_cache.data_ptr(), v_cache.data_ptr(),
                               k_cache.shape[1], bt.data_ptr(), bt.shape[1], lens.data_ptr(), scale, window,
                               softcap, _ptr(slopes), _ptr(masks), out.data_ptr(), _threads())
    return out


def _tree_masks(tree_masks: torch.Tensor | None, rows: int, window, alibi) -> torch.Tensor | None:
    if tree_masks is None:
        return None
    if tree_masks.dtype != torch.int64 or tree_masks.shape != (rows,):
        raise ValueError(f"tree_masks: expected int64 [{rows}], got {tree_masks.dtype} {tuple(tree_masks.shape)}")
    if window or alibi is not None:
        raise ValueError("tree_masks: not with a sliding window or ALiBi (their offsets are slot distances)")
    return tree_masks.contiguous()


# ---------------------------------------------------------------------- whole decoder stacks


class _Weight(ctypes.Structure):
    _fields_ = [("data", _P), ("scale", _P), ("offset", _P), ("kind", _I), ("group", _I)]


_WEIGHTS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = ([(name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm")]
                + [(name, _Weight) for name in _WEIGHTS]
                + [(name, _P) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "cos_sin")]
                + [("rotary_dim", _I), ("k_cache", _P), ("v_cache", _P), ("window", _I), ("softcap", _F),
                   ("scale", _F), ("alibi", _P), ("input_norm_bias", _P), ("post_norm_bias", _P),
                   ("norm_kind", _I), ("mlp_kind", _I), ("clip_qkv", _F), ("parallel", _I)])

# kv_layer's norm_kind and mlp_kind (kvserve_cpu.c)
NORMS = {"rms": 0, "layer": 1}
MLPS = {"silu_gated": 0, "gelu": 1, "gelu_tanh": 2}
# kv_layer's parallel: rotary Falcon's attention beside the MLP, its MLP input ln_a(x) or ln_m(x)
PARALLEL = {None: 0, "shared_norm": 1, "two_norms": 2}


def _weight(name: str, w) -> _Weight:
    """A kv_weight for float32 panels (pack_weight), Int8Panels, Int4Panels or CodebookPanels."""
    if isinstance(w, CodebookPanels):
        return _Weight(w.q.data_ptr(), w.absmax.data_ptr(), w.codebook.data_ptr(), 3, w.block)
    if isinstance(w, Int8Panels):
        return _Weight(w.q.data_ptr(), w.scale.data_ptr(), None, 1, w.group_size)
    if isinstance(w, Int4Panels):
        return _Weight(w.q.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), 2, w.group_size)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"DecoderStack: {name} must be packed float32 panels, Int8Panels, Int4Panels or "
                         f"CodebookPanels")
    return _Weight(w.data_ptr(), None, None, 0, 0)


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("block_size", _I), ("eps", _F)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _LoRALinear(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("parts", _I), ("part_off", _I * 4), ("bf16", _I)]


class _LoRA(ctypes.Structure):
    _fields_ = [("linears", _P), ("slot_rank", _P), ("group_rows", _P), ("group_start", _P), ("group_slot", _P),
                ("num_groups", _I), ("max_rank", _I)]


class LoRASlots:
    """The adapter slots of every layer's qkv, o, gate_up and down (runtime/lora/layers.py: A^T
    [slots, in, parts x max_rank], scaled B [slots, parts x max_rank, out], float32 or bfloat16
    (lora_dtype), filled in place), for
    DecoderStack.run: each step's adapter rows are added after their base matmul, B read only in
    its parts' diagonal blocks. `layers[i]` is four (a_t, b_t, part output sizes) or None."""

    def __init__(self, layers: list, max_rank: int):
        self._keep = layers
        self.max_rank = max_rank
        self.array = (_LoRALinear * (4 * len(layers)))()
        for i, linears in enumerate(layers):
            for j, entry in enumerate(linears or ()):
                if entry is None:
                    continue
                a_t, b_t, sizes = entry
                for name, t in (("A", a_t), ("B", b_t)):
                    if (t.dtype not in (torch.float32, torch.bfloat16) or t.dtype != a_t.dtype
                            or not t.is_contiguous() or t.device.type != "cpu"):
                        raise ValueError(f"LoRASlots: layer {i} {_WEIGHTS[j]} {name} must be contiguous float32 "
                                         "or bfloat16 (both alike)")
                if len(sizes) > 3 or a_t.shape[2] != len(sizes) * max_rank or sum(sizes) != b_t.shape[2]:
                    raise ValueError(f"LoRASlots: layer {i} {_WEIGHTS[j]}: shapes do not fit {len(sizes)} parts")
                c = self.array[4 * i + j]
                c.a, c.b, c.parts = a_t.data_ptr(), b_t.data_ptr(), len(sizes)
                c.bf16 = int(a_t.dtype == torch.bfloat16)
                offsets = [0]
                for size in sizes:
                    offsets.append(offsets[-1] + size)
                for k, off in enumerate(offsets):
                    c.part_off[k] = off


def lora_step(slots: LoRASlots, row_slots: list[int], slot_ranks: list[int]) -> tuple:
    """One decode step's adapter rows for DecoderStack.run: each row's slot (-1: base model)
    grouped by slot, and each slot's rank. Built once per step, read by every layer."""
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            groups.setdefault(slot, []).append(row)
    order = sorted(groups)
    rows = [r for s in order for r in groups[s]]
    starts = [0]
    for s in order:
        starts.append(starts[-1] + len(groups[s]))
    ints = [torch.tensor(v, dtype=torch.int32) for v in (slot_ranks, rows or [0], starts, order or [0])]
    lora = _LoRA(ctypes.addressof(slots.array), ints[0].data_ptr(), ints[1].data_ptr(), ints[2].data_ptr(),
                 ints[3].data_ptr(), len(order), slots.max_rank)
    return lora, (ints, slots)  # the tensors must outlive the call


class DecoderStack:
    """Every layer of a Llama-family decoder run by one native call per decode step (no Python
    between the ops). Built from per-layer dicts of tensors: qkv/o/gate_up/down weights (float32
    panels from pack_weight, or Int8Panels / Int4Panels), optional biases, norm weights, q/k norms
    (or None), the cos/sin table, window, soft-cap and scale; for the ALiBi families also `alibi`
    slopes (then no rotary), `norm` "layer" with `input_norm_bias`/`post_norm_bias`, `mlp` "gelu" or
    "gelu_tanh" (gate_up then holds the up projection alone) and `clip_qkv`; for rotary Falcon's
    parallel layers `parallel` "shared_norm" or "two_norms" (post_norm is then the MLP's LayerNorm).
    The tensors must stay alive and unchanged (the object keeps references)."""

    def __init__(self, layers: list[dict], *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 eps: float):
        self._keep = layers
        self.num_layers = len(layers)
        self.dims = _Dims(hidden, heads, kv_heads, head_dim, inter, 0, eps)
        self.array = (_Layer * len(layers))()
        for entry, spec in zip(self.array, layers):
            for name in _WEIGHTS:
                setattr(entry, name, _weight(name, spec[name]))
            for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv_bias", "o_bias", "gate_up_bias",
                         "down_bias", "cos_sin", "alibi", "input_norm_bias", "post_norm_bias"):
                t = spec.get(name)
                if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
                    raise ValueError(f"DecoderStack: {name} must be a contiguous float32 tensor")
                setattr(entry, name, _ptr(t))
            # ALiBi layers rotate nothing (a zero rotary width copies q and k through).
            entry.rotary_dim = 0 if spec.get("alibi") is not None else spec["cos_sin"].shape[1]
            entry.norm_kind = NORMS[spec.get("norm", "rms")]
            entry.mlp_kind = MLPS[spec.get("mlp", "silu_gated")]
            entry.clip_qkv = spec.get("clip_qkv") or 0.0
            entry.parallel = PARALLEL[spec.get("parallel")]
            entry.window = spec.get("window") or 0
            entry.softcap = spec.get("softcap") or 0.0
            entry.scale = spec["scale"]
        # Candidate trees as decode rows need slot distances to mean nothing: no window, no ALiBi.
        self.takes_trees = all(not spec.get("window") and spec.get("alibi") is None for spec in layers)
        self._caches: tuple[int, ...] | None = None
        self._work: torch.Tensor | None = None
        self.lora_slots: LoRASlots | None = None  # set by the model's builder when it has adapter slots

    def accepts(self, kv_caches: list) -> bool:
        """Whether these caches can be read natively (float32, contiguous; not float8 pools)."""
        k, v = kv_caches[0][0], kv_caches[0][1]
        return k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(k.data_ptr() for k, _ in kv_caches)
        if key == self._caches:
            return
        for entry, (k, v) in zip(self.array, kv_caches):
            if k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("DecoderStack: KV caches must be contiguous float32")
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        self.dims.block_size = kv_caches[0][0].shape[1]
        self._caches = key

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: tuple | None = None,
            tree_masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's MLP output, residual stream) for embeddings hidden [m, h] of a decode step;
        `lora`: lora_step(...) for a step with adapters; `tree_masks` (int64 [m]): rows that are
        candidate-tree nodes (paged_decode_attention), only when `takes_trees`."""
        lib = _lib()
        self._bind_caches(kv_caches)
        hidden = hidden.contiguous().clone()
        m = hidden.shape[0]
        residual = torch.empty_like(hidden)
        need = lib.kv_decoder_stack_workspace(ctypes.byref(self.dims), m)
        if self._work is None or self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        if tree_masks is not None and not self.takes_trees:
            raise ValueError("tree_masks: this stack has a sliding window or ALiBi layer")
        masks = _tree_masks(tree_masks, m, 0, None)
        lib.kv_decoder_stack_f32(self.array, self.num_layers, ctypes.byref(self.dims), m, pos.data_ptr(),
                                 slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                 _ptr(masks), hidden.data_ptr(), residual.data_ptr(), self._work.data_ptr(),
                                 None if lora is None else ctypes.byref(lora[0]), _threads())
        return hidden, residual


# ---------------------------------------------------------------------------- grammar bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """In place: every logit of `rows` whose bit in `bitmask` (xgrammar's int32 layout, 1 =
    allowed) is 0 becomes -inf, for token ids below `vocab_size`; what xgrammar's
    apply_token_bitmask_inplace does, vectorized (its CPU kernel tests one bit at a time)."""
    _check_f32("logits", logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits: expected a 2-D tensor with contiguous rows")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError("bitmask: expected a 2-D int32 tensor with contiguous rows")
    vocab = min(vocab_size, logits.shape[1], bitmask.shape[1] * 32)
    if any(not 0 <= r < min(logits.shape[0], bitmask.shape[0]) for r in rows):
        raise ValueError(f"rows: out of range for {logits.shape[0]} logits rows and {bitmask.shape[0]} mask rows")
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64)
    _lib().kv_apply_bitmask_f32(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                index.data_ptr(), len(rows), vocab, _threads())
