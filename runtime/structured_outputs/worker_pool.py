"""A grammar-compile worker process that can be killed: both sides of its small protocol.

Python threads cannot be stopped, and xgrammar's compiler has no deadline or cancellation of its
own, so a compile that must stop (past its timeout, or nobody waits for it any more) runs in a
child process that is killed: its CPU stops at once and the OS takes back all of its memory.

The child only answers "this grammar compiles, in so many seconds": xgrammar's CompiledGrammar
does serialise (``serialize_json``), but its token-mask cache makes that text huge (81 MB and
5.8 s for a 500-branch schema that compiles in 0.06 s on SmolLM2's vocabulary), so the server
compiles the grammar again itself once the child has shown that it finishes in time. The
compile is deterministic: the server's second one does the same work, so it takes about as long
as the child's did (a load spike aside), within the timeout.

Workers fork from a small "zygote" process (started once with a clean interpreter, so no thread
of the server is copied, and no user ``__main__`` is re-imported as multiprocessing's spawn and
forkserver do) that has imported xgrammar and torch: a fresh worker after a kill is ready in
milliseconds, not the ~2.5 s an interpreter takes to import them, and shares those pages.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

POLL_S = 0.02
# A worker builds its xgrammar compiler from the vocabulary before it takes a compile; the first
# one also waits for the zygote to import xgrammar and torch.
STARTUP_TIMEOUT_S = 120.0
# A child whose resident memory grew past its start by more than this after a compile is
# replaced, so that what one big compile took is not kept by a long-lived process.
RECYCLE_GROWTH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TrialOutcome:
    """``status`` is "ok" | "error" (the grammar does not compile) | "timeout" | "memory" (past
    the growth limit) | "cancelled" | "died" (the child exited mid-compile) | "unavailable" (no
    child could be started: the server's fault, not the grammar's)."""

    status: str
    seconds: float = 0.0
    detail: str = ""


_BOOT = ("import json, os, sys; sys.path[:0] = json.loads(os.environ.pop('KVSERVE_GRAMMAR_SYS_PATH', '[]')); "
         "from kvserve.runtime.structured_outputs.worker_pool import zygote_main; zygote_main(int(sys.argv[1]))")


class _Zygote:
    """The process workers fork from; one per server process, restarted if it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._popen: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    def fork(self) -> tuple[int, Connection]:
        with self._lock:
            for attempt in (0, 1):
                if self._popen is None or self._popen.poll() is not None:
                    self._start()
                ours, theirs = socket.socketpair()
                try:
                    socket.send_fds(self._sock, [b"f"], [theirs.fileno()])
                    reply = _recv_exact(self._sock, 4)
                except OSError:
                    ours.close()
                    self._stop()
                    if attempt:
                        raise
                    continue
                finally:
                    theirs.close()
                return struct.unpack("!i", reply)[0], Connection(ours.detach())
        raise AssertionError("unreachable")

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair()
        env = dict(os.environ, KVSERVE_GRAMMAR_SYS_PATH=json.dumps([p for p in sys.path if p]))
        try:
            self._popen = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                           pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._sock = ours

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote exits when its socket closes
            self._sock = None
        if self._popen is not None:
            try:
                self._popen.wait(5)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
            self._popen = None


_zygote = _Zygote()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the grammar zygote process exited")
        data += chunk
    return data


class CompileWorker:
    """One child process. Used by one thread at a time (its slot's dispatcher)."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._start_rss = 0

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Forks a fresh child and waits until its compiler is built (not part of any compile's
        time); False if it could not start or ``should_stop()`` turned true first."""
        if self._conn is not None:
            return True
        try:
            self._pid, self._conn = _zygote.fork()
            self._conn.send(("init", self._info))
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not self._conn.poll(POLL_S):
                if should_stop() or time.monotonic() > deadline:
                    self.kill()
                    return False
            self._conn.recv()
        except (OSError, EOFError, ValueError) as exc:
            log.warning("grammar worker failed to start: %s: %s", type(exc).__name__, exc)
            self.kill()
            return False
        self._start_rss = 0
        return True

    def trial(self, params: dict, timeout_s: float, should_stop: Callable[[], bool],
              max_growth_bytes: int | None = None) -> TrialOutcome:
        """Compiles ``params`` (StructuredOutputsParams fields) in the child; kills the child if
        the deadline passes, its resident memory grows by more than ``max_growth_bytes`` or
        ``should_stop()`` turns true first."""
        if not self.start(should_stop):
            return TrialOutcome("cancelled" if should_stop() else "unavailable", detail="the worker could not start")
        base_rss = self.rss_bytes()
        started = time.monotonic()
        try:
            self._conn.send(("compile", params))
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            return TrialOutcome("died", detail=f"{type(exc).__name__}: {exc}")
        deadline = started + timeout_s
        while True:
            try:
                ready = self._conn.poll(POLL_S)
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    status, seconds, detail = self._conn.recv()
                except (OSError, EOFError):
                    self.kill()
                    return TrialOutcome("died", time.monotonic() - started, "it exited (out of memory?)")
                self._recycle_if_grown()
                return TrialOutcome(status, seconds, detail)
            if should_stop():
                self.kill()
                return TrialOutcome("cancelled", time.monotonic() - started)
            if time.monotonic() >= deadline:
                self.kill()
                return TrialOutcome("timeout", time.monotonic() - started)
            if max_growth_bytes is not None and base_rss:
                grown = self.rss_bytes() - base_rss
                if grown > max_growth_bytes:
                    self.kill()
                    return TrialOutcome("memory", time.monotonic() - started, f"{grown >> 20} MiB")

    def rss_bytes(self) -> int:
        return _rss_bytes(self.pid) if self.pid is not None else 0

    def _recycle_if_grown(self) -> None:
        rss = self.rss_bytes()
        if not self._start_rss:
            self._start_rss = rss  # after its first compile: xgrammar's lazily built state is in
            return
        if rss - self._start_rss > RECYCLE_GROWTH_BYTES:
            log.info("grammar worker %s grew to %d MiB; replacing it", self.pid, rss >> 20)
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the OS takes back its CPU and memory at once (the zygote reaps it)."""
        pid, conn, self._pid, self._conn = self._pid, self._conn, None, None
        if conn is not None:
            conn.close()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- the child -----------------------------------------------------------------------------------------


def zygote_main(fd: int) -> None:
    """Imports what every worker needs, then forks one worker per request on its socket."""
    import xgrammar  # noqa: F401  (imported once here, shared by every fork)

    from kvserve.runtime.structured_outputs import compile as _compile  # noqa: F401

    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
        if not msg:
            return  # the server closed its end: it is gone or stopping
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                serve(Connection(fds[0]))
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        sock.sendall(struct.pack("!i", pid))


def serve(conn) -> None:
    """The child's loop: one TokenizerInfo, then compile requests until the pipe closes."""
    import xgrammar as xgr

    from kvserve.runtime.structured_outputs.compile import compile_params
    from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

    try:
        _, info_json = conn.recv()
    except (EOFError, OSError):
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                   cache_enabled=False)
    try:
        conn.send(("ready", 0.0, ""))
    except (EOFError, OSError):
        return
    while True:
        try:
            _, fields = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            compiled = compile_params(compiler, StructuredOutputsParams(**fields))
            del compiled
            reply = ("ok", time.perf_counter() - start, "")
        except ValueError as exc:
            reply = ("error", time.perf_counter() - start, str(exc))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
