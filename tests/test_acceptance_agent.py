"""Acceptance regressions for `kvserve agent fetch`: bad destinations are a FetchError, not a traceback
and never a model dumped into the working directory."""

from __future__ import annotations

import os

import pytest

from kvserve.runtime.agent.fetch import FetchError, fetch
from kvserve.runtime.cli import main


@pytest.mark.parametrize("source, dest, field", [("{model}", "", "dest"), ("", "{tmp}/d", "source"),
                                                 ("{model}", "  ", "dest")])
def test_empty_arguments_are_refused(tiny_llama, tmp_path, monkeypatch, source, dest, field):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FetchError, match=f"^{field}: must not be empty"):
        fetch(source.format(model=tiny_llama, tmp=tmp_path), dest.format(model=tiny_llama, tmp=tmp_path))
    assert os.listdir(tmp_path) == []


def test_dest_that_is_a_file_is_a_clear_error(tiny_llama, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FetchError, match="^dest: cannot write"):
        fetch(str(tiny_llama), str(blocker))
    assert main(["agent", "fetch", str(tiny_llama), str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert "dest: cannot write" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["serve", "--interval", "0"], ["serve", "--interval", "-1"], ["serve", "--scrape-timeout", "0"],
    ["serve", "--stale-after", "-2"], ["serve", "--port", "70000"], ["serve", "--tensor-parallel-size", "0"],
    ["serve", "--drain-timeout", "7200"], ["drain", "--timeout", "-1"],
])
def test_bad_agent_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["agent", *argv])
    assert exc.value.code == 2
    assert argv[1] in capsys.readouterr().err


def test_agent_port_in_use_is_one_line_and_exit_1():
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kvserve.runtime.cli", "agent", "serve", "--host", "127.0.0.1",
                               "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
