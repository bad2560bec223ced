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


def _preflight_only(monkeypatch, argv: list[str], capsys) -> tuple[int, list[str]]:
    """run_server on argv, failing the test if it gets as far as starting a server: what
    `kvserve serve` refuses before listening (exit 2, one line on stderr)."""
    from kvserve.runtime.server import main as server_main

    def no_server(coro):
        coro.close()
        raise AssertionError("the server was started; the options should have been refused first")

    monkeypatch.setattr(server_main.asyncio, "run", no_server)
    capsys.readouterr()  # what building the model fixture printed
    code = server_main.run_server(build_parser().parse_args(["serve", *argv]))
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("flags, field", [
    (["--compilation-config", "not json"], "compilation_config: not valid JSON"),
    (["-O", "2"], "compilation_config.level: must be 0"),
    (["--compilation-config", '{"cudagraph_capture_sizes": [0]}'], "compilation_config.cudagraph_capture_sizes"),
    (["--speculative-config", '{"method": "beam", "num_speculative_tokens": 2}'], "speculative_config.method"),
    (["--dtype", "float64"], "dtype: must be one of"),
    (["--device", "tpu"], "device: must be"),
    # Against the model's config: 3 does not divide the tiny Llama's 4 heads (no worker is started).
    (["--tensor-parallel-size", "3"], "tensor_parallel_size: tensor_parallel_size 3 does not divide"),
])
def test_bad_engine_options_are_refused_before_listening(tiny_llama, monkeypatch, capsys, flags, field):
    code, lines = _preflight_only(monkeypatch, [str(tiny_llama), *flags], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"kvserve serve: {field}"), lines


def test_fp8_kv_cache_with_mla_model_is_refused_before_listening(tiny_model_factory, monkeypatch, capsys):
    code, lines = _preflight_only(monkeypatch, [str(tiny_model_factory("deepseek_v2")), "--kv-cache-dtype", "fp8"],
                                  capsys)
    assert code == 2 and lines == [
        "kvserve serve: kv_cache_dtype: 'fp8' is not supported for multi-head latent attention models "
        "(DeepseekV2ForCausalLM) yet; use 'auto'"]
