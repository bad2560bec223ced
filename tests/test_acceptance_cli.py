"""Acceptance regressions for the `kvserve` command line: bad flags and unusable listen addresses
give a clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvserve.runtime.cli import build_parser


def _kvserve(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.runtime.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flag, value", [
    ("--port", "-1"), ("--port", "70000"), ("--log-level", "loud"), ("--max-queue-len", "-1"),
    ("--drain-timeout", "-5"), ("--drain-timeout", "nan"), ("--max-request-body-bytes", "0"),
])
def test_out_of_range_serve_flags_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/m", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_serve_flag_values_still_accepted():
    args = build_parser().parse_args(["serve", "/m", "--port", "0", "--log-level", "DEBUG", "--max-queue-len", "0",
                                      "--drain-timeout", "0.5", "--max-request-body-bytes", "1"])
    assert (args.port, args.log_level, args.max_queue_len, args.drain_timeout) == (0, "debug", 0, 0.5)


def test_port_in_use_is_one_line_and_exit_1(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model is never loaded: listening comes first, so a missing directory is fine here.
        proc = _kvserve("serve", str(tmp_path), "--port", str(port))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_unknown_host_is_one_line_and_exit_1(tmp_path):
    proc = _kvserve("serve", str(tmp_path), "--host", "no-such-host.invalid", "--port", "0")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "cannot listen on no-such-host.invalid" in proc.stderr



def test_serve_quiets_torch_info_logs_unless_debug(monkeypatch):
    """torch logs FakeTensor cache stats at INFO at every exit; only --log-level debug keeps them."""
    import logging

    from kvserve.runtime.server import main as server_main

    monkeypatch.setattr(server_main.asyncio, "run", lambda coro: coro.close() or 0)
    torch_logger, root = logging.getLogger("torch"), logging.getLogger()
    monkeypatch.setattr(torch_logger, "level", logging.NOTSET)
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(root, "handlers", [])
    server_main.run_server(build_parser().parse_args(["serve", "/m"]))
    assert torch_logger.level == logging.WARNING
    torch_logger.setLevel(logging.NOTSET)
    root.handlers = []
    server_main.run_server(build_parser().parse_args(["serve", "/m", "--log-level", "debug"]))
    assert torch_logger.level == logging.NOTSET
