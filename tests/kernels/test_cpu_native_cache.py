"""Where the native CPU kernels are cached, and that a library someone else could have written
is never loaded: a planted `kvserve_cpu-<key>.so` (the key is predictable) runs its constructor
the moment it is dlopen'ed, so each test plants one whose constructor leaves a file behind, and
checks the file never appears while the kernels still load (from a fresh build)."""

from __future__ import annotations

import logging
import os
import pathlib
import stat
import subprocess

import pytest

from kvserve.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native CPU kernels: {native.status()}")

OTHER_UID = 54321

PLANT_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open("%s", O_WRONLY | O_CREAT, 0600);
    if (fd >= 0) close(fd);
}
"""


@pytest.fixture
def clean_state():
    """Lets a test rerun the loader and restores the loaded library afterwards."""
    saved = (native._state.lib, native._state.reason)
    native._state.lib, native._state.reason = None, "reset by test"
    yield
    native._state.lib, native._state.reason = saved


@pytest.fixture
def compiles(monkeypatch):
    """Records every compile of the kernel library (not the `--version` probes)."""
    seen: list[list[str]] = []
    real = subprocess.run

    def run(cmd, *a, **kw):
        if str(native.SOURCE) in cmd:
            seen.append(cmd)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(native.subprocess, "run", run)
    return seen


def _library_name() -> str:
    compiler = native._compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    return f"kvserve_cpu-{native.cache_key(native.SOURCE.read_bytes(), native.FLAGS, version)}.so"


def _plant(folder: pathlib.Path, tmp_path: pathlib.Path, mode: int = 0o644) -> tuple[pathlib.Path, pathlib.Path]:
    """A library at the cache's name whose constructor creates `tmp_path/pwned`."""
    folder.mkdir(parents=True, exist_ok=True)
    flag = tmp_path / "pwned"
    src = tmp_path / "plant.c"
    src.write_text(PLANT_C % flag)
    target = folder / _library_name()
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(target)], check=True)
    os.chmod(target, mode)
    return target, flag


def _assert_loaded_without(flag: pathlib.Path) -> None:
    assert native._state.reason == "loaded", native._state.reason
    assert native._state.lib.kv_abi_version() == native.ABI_VERSION
    assert not flag.exists(), "the planted library was loaded"


def test_world_writable_cache_folder_is_not_trusted(tmp_path, monkeypatch, clean_state, compiles, caplog):
    cache = tmp_path / "cache"
    planted, flag = _plant(cache, tmp_path)
    os.chmod(cache, 0o777)
    monkeypatch.setenv(native.CACHE_ENV_VAR, str(cache))
    private_root = tmp_path / "private"
    private_root.mkdir()
    monkeypatch.setattr(native.tempfile, "tempdir", str(private_root))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        native._load()
    _assert_loaded_without(flag)
    assert len(compiles) == 1
    assert "group- or world-writable" in caplog.text and native.CACHE_ENV_VAR in caplog.text
    # Built in a private folder, removed once loaded; the untrusted folder is left as it was.
    assert list(private_root.iterdir()) == []
    assert sorted(p.name for p in cache.iterdir()) == [planted.name]


def test_a_writable_library_in_a_private_cache_is_rebuilt(tmp_path, monkeypatch, clean_state, compiles):
    cache = tmp_path / "cache"
    planted, flag = _plant(cache, tmp_path, mode=0o666)
    os.chmod(cache, 0o700)
    before = planted.stat().st_ino
    monkeypatch.setenv(native.CACHE_ENV_VAR, str(cache))
    native._load()
    _assert_loaded_without(flag)
    assert len(compiles) == 1
    after = planted.stat()
    assert after.st_ino != before and after.st_uid == os.getuid() and not after.st_mode & 0o022


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("owned_by_other", ["file", "folder"])
def test_a_library_or_folder_owned_by_another_user_is_not_trusted(tmp_path, monkeypatch, clean_state, compiles,
                                                                  owned_by_other):
    cache = tmp_path / "cache"
    planted, flag = _plant(cache, tmp_path)
    os.chmod(cache, 0o700)
    os.chown(planted if owned_by_other == "file" else cache, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(native.CACHE_ENV_VAR, str(cache))
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path))
    native._load()
    _assert_loaded_without(flag)
    assert len(compiles) == 1


def test_no_fallback_to_a_shared_temp_folder(tmp_path, monkeypatch, clean_state, compiles):
    """The cache folder cannot be made (a file is in the way): the old loader then used
    $TMPDIR/kvserve, where anyone can create the library first."""
    shared = tmp_path / "shared-tmp"
    planted, flag = _plant(shared / "kvserve", tmp_path)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv(native.CACHE_ENV_VAR, str(tmp_path / "not-a-folder" / "cache"))
    monkeypatch.setattr(native.tempfile, "tempdir", str(shared))
    native._load()
    _assert_loaded_without(flag)
    assert sorted(p.name for p in shared.iterdir()) == ["kvserve"]  # the private build folder is gone


def test_the_normal_path_builds_once_into_a_private_folder_then_reuses_it(tmp_path, monkeypatch, clean_state,
                                                                           compiles):
    cache = tmp_path / "xdg" / "kvserve"
    monkeypatch.delenv(native.CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == cache
    native._load()
    assert native._state.reason == "loaded" and len(compiles) == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (built,) = cache.iterdir()
    assert built.name == _library_name() and not built.stat().st_mode & 0o022
    inode = built.stat().st_ino
    native._state.lib = None
    native._load()
    assert native._state.reason == "loaded" and len(compiles) == 1 and built.stat().st_ino == inode


@pytest.mark.parametrize("uid, mode, kind, words", [
    (1000, stat.S_IFDIR | 0o700, "folder", None),
    (1000, stat.S_IFDIR | 0o755, "folder", None),
    (1000, stat.S_IFDIR | 0o770, "folder", "group- or world-writable"),
    (1000, stat.S_IFDIR | 0o1777, "folder", "group- or world-writable"),
    (0, stat.S_IFDIR | 0o700, "folder", "owned by uid 0"),
    (1000, stat.S_IFREG | 0o700, "folder", "not a folder"),
    (1000, stat.S_IFREG | 0o755, "file", None),
    (1000, stat.S_IFREG | 0o666, "file", "group- or world-writable"),
    (1000, stat.S_IFREG | 0o620, "file", "group- or world-writable"),
    (2000, stat.S_IFREG | 0o500, "file", "owned by uid 2000"),
    (1000, stat.S_IFLNK | 0o777, "file", "not a regular file"),
])
def test_trust_rules(uid, mode, kind, words):
    st = os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))
    problem = native.untrusted(st, "x", kind, uid=1000)
    assert problem is None if words is None else words in problem
