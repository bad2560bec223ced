"""Admin credential: where the key comes from, and whether a request carries it.

Shared by the runtime server and the sidecar agent. Loopback is deliberately not a credential: a
pod's containers share one network namespace, so "from 127.0.0.1" says nothing about who sent it.
Only the key does. No aiohttp here: callers pass the Authorization header's value.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ADMIN_KEY_ENV = "KVSERVE_ADMIN_API_KEY"
ADMIN_KEY_FILE_ENV = "KVSERVE_ADMIN_API_KEY_FILE"
# A key file holds one token; anything much bigger is the wrong file, not a key.
MAX_KEY_FILE_BYTES = 4096
HOW_TO_CONFIGURE = (f"start it with --admin-api-key KEY or --admin-api-key-file PATH "
                    f"(or set {ADMIN_KEY_ENV} / {ADMIN_KEY_FILE_ENV})")


# vLLM's names for loading and unloading LoRA adapters: admin routes under /v1/.
ADMIN_V1_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def is_admin_path(path: str) -> bool:
    """Admin routes: POST /drain, everything under /admin/, and the LoRA load/unload routes.
    Checked before routing, so a route added there later is protected without remembering to,
    and probing for one without the key learns nothing (401/403, never 404)."""
    return path == "/drain" or path == "/admin" or path.startswith("/admin/") or path in ADMIN_V1_PATHS


class AdminKeyError(ValueError):
    """A key that cannot be used; the message names the flag or variable it came from."""


def is_header_token(text: str) -> bool:
    """A key travels in an HTTP header: anything but visible ASCII would never match what a client
    sends. Shared by every credential kvserve reads (admin key, the router's user keys)."""
    return all("\x21" <= ch <= "\x7e" for ch in text)


def check_key_text(key: str, source: str) -> str:
    """The key as it will be compared: it travels in an HTTP header, so it must be a non-empty run of
    visible ASCII (a space, a newline or a non-ASCII letter would never match what a client sends)."""
    if not key:
        raise AdminKeyError(f"{source}: the admin key is empty")
    if not is_header_token(key):
        raise AdminKeyError(f"{source}: the admin key must be visible ASCII characters only "
                            "(no spaces, control characters or non-ASCII)")
    return key


def read_key_file(path: str, source: str) -> str:
    """The file's content, stripped of surrounding whitespace (a trailing newline is normal)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise AdminKeyError(f"{source}: {path} does not exist") from None
    except IsADirectoryError:
        raise AdminKeyError(f"{source}: {path} is a directory, not a key file") from None
    except OSError as exc:
        raise AdminKeyError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise AdminKeyError(f"{source}: {path} is larger than {MAX_KEY_FILE_BYTES} bytes; is it the key file?")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise AdminKeyError(f"{source}: {path} is not ASCII text") from None
    return check_key_text(text, f"{source} ({path})")


@dataclass(frozen=True)
class KeySource:
    """Where the admin key comes from: `kind` is "key" (the value itself) or "file" (a path)."""

    kind: str
    value: str
    origin: str  # the flag or variable, for error messages


def pick_admin_key_source(key_flag: str | None, file_flag: str | None,
                          environ: Mapping[str, str]) -> KeySource | None:
    """Flags win over the environment; two sources at the same level are refused rather than
    guessed between (a pod with both would otherwise depend on an undocumented order)."""
    if key_flag is not None and file_flag is not None:
        raise AdminKeyError("--admin-api-key and --admin-api-key-file: give one of them, not both")
    if key_flag is not None:
        return KeySource("key", key_flag, "--admin-api-key")
    if file_flag is not None:
        return KeySource("file", file_flag, "--admin-api-key-file")
    env_key, env_file = environ.get(ADMIN_KEY_ENV), environ.get(ADMIN_KEY_FILE_ENV)
    if env_key and env_file:
        raise AdminKeyError(f"{ADMIN_KEY_ENV} and {ADMIN_KEY_FILE_ENV} are both set: set one of them")
    if env_key:
        return KeySource("key", env_key, ADMIN_KEY_ENV)
    if env_file:
        return KeySource("file", env_file, ADMIN_KEY_FILE_ENV)
    return None


def load_admin_key(key_flag: str | None = None, file_flag: str | None = None,
                   environ: Mapping[str, str] | None = None, *, user_key: str | None = None) -> str | None:
    """The admin key from flags or environment, or None when none is configured (admin routes then
    answer 403). Raises AdminKeyError for an unusable key, or one equal to the user key: a user
    key that also drains the server would make every API user an admin."""
    source = pick_admin_key_source(key_flag, file_flag, os.environ if environ is None else environ)
    if source is None:
        return None
    key = (read_key_file(source.value, source.origin) if source.kind == "file"
           else check_key_text(source.value, source.origin))
    if user_key and hmac.compare_digest(key.encode(), user_key.encode()):
        raise AdminKeyError(f"{source.origin}: the admin key must differ from the API key (--api-key)")
    return key


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def token_matches(token: str | None, key: str | None) -> bool:
    """Constant-time, so response timing does not reveal how much of a guess was right."""
    if token is None or not key:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


@dataclass(frozen=True)
class Denial:
    status: int
    message: str


def admin_denial(authorization: str | None, admin_key: str | None, *, route: str,
                 user_key: str | None = None) -> Denial | None:
    """None when the request may use the admin route; otherwise the status and message to answer.

    403 when no admin key is configured (nothing a client sends can help: the operator of the
    server must configure one) or when the client showed the user key (known, but not allowed);
    401 when the credential is missing or wrong."""
    if not admin_key:
        return Denial(403, f"{route} is an admin route and no admin key is configured: {HOW_TO_CONFIGURE}.")
    token = bearer_token(authorization)
    if token_matches(token, admin_key):
        return None
    if token_matches(token, user_key):
        return Denial(403, f"{route} needs the admin key; the API key (--api-key) is not an admin credential.")
    return Denial(401, f"{route} needs the admin key: send `Authorization: Bearer <admin key>`.")


def generate_token() -> str:
    """32 random bytes, URL-safe base64 (43 characters): valid in a header and in a file as is."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | os.PathLike, token: str | None = None) -> Path:
    """Writes a fresh token readable only by its owner (0400) and returns the path.

    The token is written to a private temporary file beside the target and renamed over it, so a
    reader never sees a partial token and the write never follows a link planted at the target.
    An existing regular file is replaced (an init container runs again when its pod restarts and
    keeps its emptyDir); anything else at the path (a link, a directory) is refused."""
    target = Path(path)
    token = check_key_text(token if token is not None else generate_token(), "token")
    try:
        info = target.lstat()
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise AdminKeyError(f"--out: {target} exists and is not a regular file; refusing to replace it")
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fchmod(f.fileno(), 0o400)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
