"""What the router lets through (pure): which routes a user may reach, and with which credential.

The router stands in front of every pod of a service, so whatever it forwards, every user can do
to every pod. It forwards only the user routes a runtime serves, each sent upstream by the route's
own path (a constant here), never by the path the client wrote: a client path with dot segments,
empty segments, backslashes, or an encoded dot, slash, backslash, percent or NUL is refused, not
cleaned up. Cleaning up is what a pod or an HTTP client library may do differently, and one that
turns `/v1/%2e%2e/drain` into `/drain` after the router allowed `/v1/...` is how an admin route
becomes reachable.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.runtime.server.auth import is_header_token


@dataclass(frozen=True)
class Route:
    path: str  # the upstream path: the allowlist's own string
    method: str
    kind: str  # "completion", "chat" (placed by the policy), "models", "model", "forward"


# The user routes of `kvserve serve` (runtime/server/app.py) that the router serves. /v1/models is
# answered by the router itself (the union of the pods' lists); the rest are forwarded.
ROUTES = {
    "/v1/completions": Route("/v1/completions", "POST", "completion"),
    "/v1/chat/completions": Route("/v1/chat/completions", "POST", "chat"),
    "/tokenize": Route("/tokenize", "POST", "forward"),
    "/detokenize": Route("/detokenize", "POST", "forward"),
    "/v1/models": Route("/v1/models", "GET", "models"),
}
MODEL_PREFIX = "/v1/models/"  # GET /v1/models/{id}; ids may contain "/" (org/name)

# Encoded ".", "/", "\", "%" (a second decoding) and NUL, in either case.
_ENCODED = re.compile(r"%(2e|2f|5c|25|00)", re.IGNORECASE)


class RouteRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def resolve_route(method: str, raw_path: str) -> tuple[Route, str | None]:
    """The allowlisted route for a request line's target, and for `/v1/models/{id}` the id.

    `raw_path` is the target as the client sent it (aiohttp's `request.raw_path`, query included;
    the query is dropped: no forwarded route takes one). RouteRefused(404) for anything not on the
    list or not in canonical form; RouteRefused(405) for a listed path with the wrong method.
    """
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    not_found = RouteRefused(404, f"Not found: {method} {_printable(path)}. The router serves POST "
                                  f"/v1/completions, /v1/chat/completions, /tokenize, /detokenize and GET "
                                  f"/v1/models[/{{model}}].")
    if not _canonical(path):
        raise not_found
    route = ROUTES.get(path)
    model = None
    if route is None and path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
        route = Route("/v1/models", "GET", "model")
        model = _decode(path[len(MODEL_PREFIX):])
    if route is None:
        raise not_found
    if method != route.method and not (route.method == "GET" and method == "HEAD"):
        raise RouteRefused(405, f"Method {method} is not allowed on {path}; use {route.method}.")
    return route, model


def _canonical(path: str) -> bool:
    if not path.startswith("/") or path.endswith("/") or "\\" in path or "//" in path or _ENCODED.search(path):
        return False
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in path):
        return False
    return all(segment not in (".", "..") for segment in path.split("/"))


def _decode(text: str) -> str:
    from urllib.parse import unquote

    return unquote(text)


def _printable(path: str) -> str:
    return path[:200].encode("ascii", "backslashreplace").decode()


# --- the credential --------------------------------------------------------------------------

def parse_api_keys(text: str | None) -> tuple[str, ...]:
    """`--api-key K1,K2` (or $KVSERVE_API_KEY): the keys a client may present, any of them."""
    if not text:
        return ()
    keys = tuple(k.strip() for k in text.split(","))
    for i, key in enumerate(keys):
        if not key:
            raise ValueError(f"api-key: key {i + 1} of {len(keys)} in the comma-separated list is empty")
        if not is_header_token(key):
            raise ValueError(f"api-key: key {i + 1} of {len(keys)} must be visible ASCII characters only "
                             "(no spaces, control characters or non-ASCII)")
    return keys


def bearer_ok(authorization: str | None, keys: Iterable[str]) -> bool:
    """`Authorization: Bearer KEY` with one of the keys; compared in constant time, every key
    tried, so the time taken says nothing about which key came close."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented, key.encode())
    return ok
