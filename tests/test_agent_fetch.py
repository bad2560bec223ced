"""`kvserve agent fetch`: local/PVC copies and the hub path against a locally built hub cache."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from kvserve.runtime.agent.fetch import HUB_PATTERNS, MARKER, FetchError, check_model_dir, fetch, parse_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    "text, kind, location, revision",
    [
        ("hf://org/name", "hf", "org/name", None),
        ("hf://org/name@v1.0", "hf", "org/name", "v1.0"),
        (f"hf://org/name@{COMMIT}", "hf", "org/name", COMMIT),
        ("/models/x", "local", "/models/x", None),
        ("file:///pvc/m", "local", "/pvc/m", None),
        ("hf://org/name/m.Q4_K_M.gguf", "hf", "org/name", None),
        ("hf://org/name@v2/sub/m.gguf", "hf", "org/name", "v2"),
        ("hf://org/name@refs/pr/1", "hf", "org/name", "refs/pr/1"),
    ],
)
def test_parse_source(text, kind, location, revision):
    s = parse_source(text)
    assert (s.kind, s.location, s.revision) == (kind, location, revision)
    assert s.filename == ({"hf://org/name/m.Q4_K_M.gguf": "m.Q4_K_M.gguf",
                           "hf://org/name@v2/sub/m.gguf": "sub/m.gguf"}.get(text))
    assert str(s) == text.removeprefix("file://")


@pytest.mark.parametrize("bad", ["hf://name", "hf://a/b/c", "hf://org/name@", "s3://bucket/m", "hf:///x",
                                 "hf://a/b//x.gguf", "hf://a/b/x.bin"])
def test_parse_source_rejects(bad):
    with pytest.raises(FetchError, match="source"):
        parse_source(bad)


def test_local_fetch_then_noop(tiny_llama, tmp_path):
    dest = tmp_path / "models" / "m"
    out = fetch(str(tiny_llama), str(dest))
    assert out["action"] == "fetched"
    assert check_model_dir(dest) == []
    assert (dest / MARKER).exists()
    stamp = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    assert fetch(str(tiny_llama), str(dest))["action"] == "up-to-date"
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == stamp
    # A damaged destination is repaired, not trusted.
    (dest / "tokenizer.json").unlink()
    assert fetch(str(tiny_llama), str(dest))["action"] == "fetched"
    assert check_model_dir(dest) == []


def test_source_equal_to_dest_only_verifies(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    assert fetch(str(d), str(d))["action"] == "fetched"
    assert fetch(str(d), str(d))["action"] == "up-to-date"


def _damage(d, how):
    if how == "no-config":
        (d / "config.json").unlink()
    elif how == "bad-config":
        (d / "config.json").write_text("{not json")
    elif how == "no-tokenizer":
        for p in d.glob("tokenizer*"):
            p.unlink()
    elif how == "no-weights":
        for p in d.glob("*.safetensors"):
            p.unlink()
    elif how == "truncated":
        w = next(d.glob("*.safetensors"))
        w.write_bytes(w.read_bytes()[:-100])
    elif how == "missing-shard":
        w = next(d.glob("*.safetensors"))
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": w.name, "b": "model-00002-of-00002.safetensors"}})
        )


@pytest.mark.parametrize(
    "how, words",
    [
        ("no-config", "config.json: missing"),
        ("bad-config", "config.json: unreadable"),
        ("no-tokenizer", "tokenizer"),
        ("no-weights", "weights"),
        ("truncated", "does not match its header"),
        ("missing-shard", "model-00002-of-00002.safetensors: missing"),
    ],
)
def test_incomplete_model_is_refused(tiny_llama, tmp_path, how, words):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    _damage(src, how)
    assert any(words in p for p in check_model_dir(src))
    with pytest.raises(FetchError, match="incomplete model") as err:
        fetch(str(src), str(tmp_path / "dest"))
    assert words in str(err.value)
    assert not (tmp_path / "dest" / MARKER).exists()


def _hub_cache(hf_home, model_dir, repo="kvserve-test/tiny", commit=COMMIT, ref="main"):
    """Lays a model out exactly as huggingface_hub's cache does: blobs, snapshots, refs."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():
            blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def hub_home(tiny_llama, tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    _hub_cache(home, tiny_llama)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.mark.parametrize("rev", ["", "@main", f"@{COMMIT}"])
def test_hub_fetch_from_offline_cache(hub_home, tmp_path, rev, caplog):
    dest = tmp_path / "dest"
    with caplog.at_level(logging.WARNING, logger="kvserve.runtime.agent.fetch"):
        out = fetch(f"hf://kvserve-test/tiny{rev}", str(dest))
    assert out["action"] == "fetched" and out["revision"] == COMMIT
    assert check_model_dir(dest) == []
    assert not any(p.is_symlink() for p in dest.iterdir())
    again = fetch(f"hf://kvserve-test/tiny{rev}", str(dest))
    assert again["action"] == "up-to-date"
    # A branch or tag can move under the same name: said in the log, the result and the marker.
    pinned = rev == f"@{COMMIT}"
    assert json.loads((dest / MARKER).read_text())["pinned"] is pinned
    if pinned:
        assert "warnings" not in out and "warnings" not in again and "not pinned" not in caplog.text
    else:
        for warnings in (out["warnings"], again["warnings"]):
            assert warnings == [f"hf://kvserve-test/tiny{rev} is not pinned to a commit: revision "
                                f"{rev[1:] or 'main'!r} resolved to {COMMIT}, and can move; pin it as "
                                f"hf://kvserve-test/tiny@{COMMIT} so every pod serves the same files"]
        assert "not pinned to a commit" in caplog.text


def test_code_files_are_never_fetched(tiny_llama, tmp_path, monkeypatch):
    """kvserve never runs a repository's own code, so custom modeling files stay behind, from
    the hub cache and from a local directory alike."""
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    for name in ("modeling_evil.py", "configuration_evil.py", "evil.so", "sub/run.sh"):
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_text("import os; os.system('id')\n")
    home = tmp_path / "hf_home"
    _hub_cache(home, src)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for source, dest in ((str(src), tmp_path / "local"), ("hf://kvserve-test/tiny", tmp_path / "hub")):
        fetch(source, str(dest))
        placed = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
        assert placed and not {n for n in placed if n.endswith((".py", ".so", ".sh"))}, placed
        assert check_model_dir(dest) == []
    assert not any(fnmatch.fnmatch(n, "*.py") for n in HUB_PATTERNS)


def _files_in(d):
    return sorted(p.name for p in d.rglob("*") if p.is_file())


@pytest.fixture
def small_volume(tmp_path):
    """A real 256 KiB tmpfs: the model does not fit, so a copy hits ENOSPC from the kernel."""
    mnt = tmp_path / "volume"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {exc}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False, timeout=30)


def test_disk_full_leaves_no_partial_file(tiny_llama, small_volume):
    dest = small_volume / "m"
    with pytest.raises(FetchError, match=r"dest: cannot write .*No space left on device"):
        fetch(str(tiny_llama), str(dest))
    left = _files_in(small_volume)
    assert not [n for n in left if n.endswith(".partial")], left
    assert MARKER not in left


def test_a_failed_write_removes_its_partial_file(tiny_llama, tmp_path, monkeypatch):
    """The same without root: the copy (forced: no hard link) writes half of the largest file,
    then fails as a full disk does."""
    import kvserve.runtime.agent.fetch as fetch_module

    biggest = max(tiny_llama.iterdir(), key=lambda p: p.stat().st_size).name

    def link(src, dst):
        raise OSError(errno.EXDEV, "cross-device link")

    def copyfile(src, dst):
        data = pathlib.Path(src).read_bytes()
        pathlib.Path(dst).write_bytes(data if pathlib.Path(src).name != biggest else data[: len(data) // 2])
        if pathlib.Path(src).name == biggest:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(fetch_module.os, "link", link)
    monkeypatch.setattr(fetch_module.shutil, "copyfile", copyfile)
    dest = tmp_path / "dest"
    with pytest.raises(FetchError, match="No space left on device"):
        fetch(str(tiny_llama), str(dest))
    left = _files_in(dest)
    assert biggest not in left and not [n for n in left if n.endswith(".partial")] and MARKER not in left


def test_hub_fetch_missing_from_offline_cache(hub_home, tmp_path):
    with pytest.raises(FetchError, match="HF_HUB_OFFLINE is set"):
        fetch("hf://kvserve-test/absent", str(tmp_path / "dest"))
    with pytest.raises(FetchError):
        fetch("hf://kvserve-test/tiny@v9", str(tmp_path / "dest"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_hub_fetch_falls_back_to_cache_when_hub_unreachable(hub_home, tmp_path):
    """Online mode, but the Hub endpoint refuses connections: the cached snapshot is used."""
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "kvserve.runtime.cli", "agent", "fetch", "hf://kvserve-test/tiny", str(dest)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["revision"] == COMMIT
    # Unpinned: said on stderr (the init container's log) and in the JSON line.
    assert f"pin it as hf://kvserve-test/tiny@{COMMIT}" in r.stderr
    assert "not pinned" in json.loads(r.stdout)["warnings"][0]
    assert check_model_dir(dest) == []
    r = subprocess.run(cmd[:-2] + ["hf://kvserve-test/absent", str(tmp_path / "d2")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "unreachable" in r.stderr


# ------------------------------------------------------------------------------------- GGUF


@pytest.fixture
def tiny_gguf_file(tiny_llama, tmp_path):
    from ggufmodels import write_gguf

    src = tmp_path / "src"
    src.mkdir()
    return write_gguf(tiny_llama, src / "tiny.Q8_0.gguf", "Q8_0")


def test_local_gguf_file_fetch_gives_a_servable_directory(tiny_gguf_file, tmp_path):
    from kvserve.runtime.gguf.reader import resolve_model_path

    dest = tmp_path / "dest"
    out = fetch(str(tiny_gguf_file), str(dest))
    assert out["action"] == "fetched" and out["files"] == 1
    assert sorted(p.name for p in dest.iterdir()) == [MARKER, "tiny.Q8_0.gguf"]
    assert check_model_dir(dest) == []
    assert fetch(f"file://{tiny_gguf_file}", str(dest))["action"] == "up-to-date"
    assert resolve_model_path(str(dest)) == str(dest / "tiny.Q8_0.gguf")


def test_truncated_gguf_is_refused(tiny_gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf_file.read_bytes()[:-64])
    with pytest.raises(FetchError, match="incomplete model: cut.gguf: .*truncated"):
        fetch(str(cut), str(tmp_path / "dest"))
    assert not (tmp_path / "dest" / MARKER).exists()
    two = tmp_path / "two"
    two.mkdir()
    shutil.copyfile(tiny_gguf_file, two / "a.gguf")
    shutil.copyfile(tiny_gguf_file, two / "b.gguf")
    assert "several GGUF files" in check_model_dir(two)[0]


def test_a_gguf_without_tensors_is_not_a_model(tmp_path):
    import gguf

    d = tmp_path / "m"
    d.mkdir()
    w = gguf.GGUFWriter(str(d / "empty.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert check_model_dir(d) == ["empty.gguf: has no tensors"]


def test_hub_gguf_file_from_offline_cache(tiny_gguf_file, tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    _hub_cache(home, tiny_gguf_file.parent, repo="kvserve-test/tiny-gguf")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dest = tmp_path / "dest"
    out = fetch("hf://kvserve-test/tiny-gguf/tiny.Q8_0.gguf", str(dest))
    assert out["revision"] == COMMIT and out["files"] == 1
    assert check_model_dir(dest) == [] and not (dest / "tiny.Q8_0.gguf").is_symlink()
    with pytest.raises(FetchError):
        fetch("hf://kvserve-test/tiny-gguf/other.gguf", str(tmp_path / "d2"))


def test_a_full_hub_cache_says_so_and_where(hub_home, tmp_path, monkeypatch):
    """huggingface_hub's own download failing with ENOSPC (injected at its entry point: no
    hub server runs here) becomes a message that names the cache and what to do."""
    import huggingface_hub

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    with pytest.raises(FetchError, match=r"no space left in the hub cache .*hf_home/hub .*enlarge the volume"):
        fetch("hf://kvserve-test/tiny", str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()
