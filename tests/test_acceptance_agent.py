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
