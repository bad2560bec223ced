"""The admin credential's pure parts (kvserve.runtime.server.auth) and the drain's time box."""

from __future__ import annotations

import math
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.runtime.server.auth import (
    AdminKeyError,
    KeySource,
    admin_denial,
    bearer_token,
    check_key_text,
    generate_token,
    is_admin_path,
    load_admin_key,
    pick_admin_key_source,
    write_token_file,
)
from kvserve.runtime.server.drain import effective_drain_timeout

ENV_KEY, ENV_FILE = "KVSERVE_ADMIN_API_KEY", "KVSERVE_ADMIN_API_KEY_FILE"


@pytest.mark.parametrize("key_flag, file_flag, environ, want", [
    (None, None, {}, None),
    ("k", None, {ENV_KEY: "e", ENV_FILE: "/f"}, KeySource("key", "k", "--admin-api-key")),  # a flag wins
    (None, "/p", {ENV_KEY: "e"}, KeySource("file", "/p", "--admin-api-key-file")),
    (None, None, {ENV_KEY: "e"}, KeySource("key", "e", ENV_KEY)),
    (None, None, {ENV_FILE: "/f"}, KeySource("file", "/f", ENV_FILE)),
    (None, None, {ENV_KEY: "", ENV_FILE: "/f"}, KeySource("file", "/f", ENV_FILE)),  # empty = unset
])
def test_pick_admin_key_source(key_flag, file_flag, environ, want):
    assert pick_admin_key_source(key_flag, file_flag, environ) == want


@pytest.mark.parametrize("key_flag, file_flag, environ, says", [
    ("k", "/p", {}, "give one of them, not both"),
    (None, None, {ENV_KEY: "e", ENV_FILE: "/f"}, "are both set"),
])
def test_two_sources_at_one_level_are_refused(key_flag, file_flag, environ, says):
    with pytest.raises(AdminKeyError, match=says):
        pick_admin_key_source(key_flag, file_flag, environ)


@pytest.mark.parametrize("key, ok", [
    ("abc", True), ("A-_~.0+/=", True), ("", False), ("two words", False), ("tab\there", False),
    ("new\nline", False), ("clé", False), ("\x7f", False),
])
def test_key_text_must_fit_a_header(key, ok):
    if ok:
        assert check_key_text(key, "--admin-api-key") == key
    else:
        with pytest.raises(AdminKeyError, match="^--admin-api-key: "):
            check_key_text(key, "--admin-api-key")


def test_load_admin_key_from_files(tmp_path):
    good = tmp_path / "token"
    good.write_text("  s3cret-token\n")
    assert load_admin_key(None, str(good), {}) == "s3cret-token"
    assert load_admin_key(None, None, {ENV_FILE: str(good)}) == "s3cret-token"
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path): "is a directory",
    }
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    cases[str(big)] = "larger than 4096 bytes"
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe")
    cases[str(binary)] = "not ASCII text"
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    cases[str(empty)] = "the admin key is empty"
    for path, says in cases.items():
        with pytest.raises(AdminKeyError, match=f"^--admin-api-key-file.*{says}"):
            load_admin_key(None, path, {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key_file_names_the_flag(tmp_path):
    locked = tmp_path / "locked"
    locked.write_text("k")
    locked.chmod(0)
    with pytest.raises(AdminKeyError, match="^--admin-api-key-file: cannot read"):
        load_admin_key(None, str(locked), {})


def test_admin_key_must_differ_from_the_user_key(tmp_path):
    assert load_admin_key("admin-k", None, {}, user_key="user-k") == "admin-k"
    with pytest.raises(AdminKeyError, match="^--admin-api-key: the admin key must differ"):
        load_admin_key("same", None, {}, user_key="same")
    with pytest.raises(AdminKeyError, match=f"^{ENV_KEY}: the admin key must differ"):
        load_admin_key(None, None, {ENV_KEY: "same"}, user_key="same")


@pytest.mark.parametrize("path, admin", [
    ("/drain", True), ("/admin", True), ("/admin/", True), ("/admin/load_lora_adapter", True),
    ("/drain/", False), ("/v1/drain", False), ("/administrator", False), ("/live", False), ("/", False),
])
def test_is_admin_path(path, admin):
    assert is_admin_path(path) is admin


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc"), ("Bearer", None), ("Bearer ", None),
    ("Basic abc", None), ("abc", None), ("", None), (None, None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


@pytest.mark.parametrize("header, admin_key, user_key, status", [
    ("Bearer adm", "adm", "usr", None),
    ("Bearer adm", "adm", None, None),
    (None, "adm", "usr", 401),
    ("Bearer wrong", "adm", "usr", 401),
    ("Bearer ad", "adm", "usr", 401),  # a prefix is not the key
    ("Basic adm", "adm", "usr", 401),
    ("Bearer usr", "adm", "usr", 403),  # the user key: known, not allowed
    ("Bearer usr", "adm", None, 401),  # the agent does not know the user key
    ("Bearer adm", None, "usr", 403),  # no admin key configured: nothing a client sends helps
    (None, None, None, 403),
    ("Bearer ", "adm", "", 401),
])
def test_admin_denial(header, admin_key, user_key, status):
    denial = admin_denial(header, admin_key, route="POST /drain", user_key=user_key)
    assert (denial.status if denial else None) == status
    if denial is not None:
        assert denial.message.startswith("POST /drain ")
    if admin_key is None:
        assert "--admin-api-key" in denial.message and "KVSERVE_ADMIN_API_KEY_FILE" in denial.message


def test_generated_tokens_are_long_random_header_safe():
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100
    for token in tokens:
        assert len(token) == 43 and check_key_text(token, "t") == token


def test_write_token_file(tmp_path):
    target = tmp_path / "run" / "admin" / "token"  # the directory is created
    write_token_file(target)
    first = target.read_text()
    assert first.endswith("\n") and len(first.strip()) == 43
    assert stat.S_IMODE(target.stat().st_mode) == 0o400
    assert load_admin_key(None, str(target), {}) == first.strip()
    write_token_file(target)  # an init step that runs again replaces it
    assert target.read_text() != first and stat.S_IMODE(target.stat().st_mode) == 0o400
    assert sorted(p.name for p in target.parent.iterdir()) == ["token"]  # no temporary file left

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not yours")
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    for path in (link, tmp_path / "run"):
        with pytest.raises(AdminKeyError, match="is not a regular file; refusing"):
            write_token_file(path)
    assert elsewhere.read_text() == "not yours"


@pytest.mark.parametrize("raw, cap, want", [
    (None, 30.0, 30.0), ("5", 30.0, 5.0), ("0", 30.0, 0.0), ("3600", 30.0, 30.0), ("1e9", 2.5, 2.5),
    ("0.25", 0.5, 0.25),
])
def test_effective_drain_timeout(raw, cap, want):
    assert effective_drain_timeout(raw, cap) == want


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "-inf", "", "soon", "1s"])
def test_effective_drain_timeout_refuses(raw):
    with pytest.raises(ValueError, match=r"^timeout: must be a number of seconds >= 0 \(at most 30 are used\)"):
        effective_drain_timeout(raw, 30.0)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=3600))
def test_a_request_can_only_shorten_the_drain(value, cap):
    try:
        got = effective_drain_timeout(repr(value), cap)
    except ValueError:
        assert not math.isfinite(value) or value < 0
    else:
        assert 0 <= got <= cap and got == min(value, cap)


@given(st.text(max_size=60), st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e),
                                     min_size=1, max_size=60))
def test_only_the_admin_key_itself_passes(header, admin_key):
    denial = admin_denial(header, admin_key, route="POST /drain", user_key="user-key")
    assert (denial is None) == (bearer_token(header) == admin_key)
    assert admin_denial(f"Bearer {admin_key}", admin_key, route="POST /drain") is None
