"""Reading bodies whole, never past a cap: a client's request body (charged against the router's
byte budgets as it arrives) and the few upstream answers the router reads whole instead of
streaming through (a pod's refusal, its model list, its load signals).
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

# What the router reads whole from a pod. Generous for what a pod really sends (a refusal is a
# few hundred bytes, a model list a few KB, /metrics tens of KB) and small next to the router's
# memory limit.
REFUSAL_LIMIT = 64 << 10
MODELS_LIMIT = 1 << 20
SIGNALS_LIMIT = 1 << 20
METRICS_LIMIT = 8 << 20


class BodyRefused(Exception):
    """The request body cannot be taken: `status` 413 (one body over its limit) or 503 (the
    router's budgets are full); `message` names the flag."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class TooLong(Exception):
    """An upstream answer longer than the router reads whole."""


async def read_request_body(content: aiohttp.StreamReader, *, declared: int | None, limit: int,
                            charge: Callable[[int], None]) -> bytearray:
    """The body, read as it arrives into one buffer (no second copy). `declared` bytes (its
    Content-Length) were charged before reading; `charge(n)` is called for every byte past that,
    before it is kept, and raises BodyRefused to stop. Past `limit` bytes: BodyRefused(413)."""
    body = bytearray()
    charged = declared or 0
    while True:
        chunk = await content.readany()
        if not chunk:
            return body
        size = len(body) + len(chunk)
        if size > limit:
            raise BodyRefused(413, f"Request body too large: more than {limit} bytes "
                                   f"(--max-request-body-bytes {limit}).")
        if size > charged:
            charge(size - charged)
            charged = size
        body += chunk


async def read_capped(content: aiohttp.StreamReader, limit: int) -> bytes:
    """An upstream body of at most `limit` bytes; TooLong past it (what was read is dropped)."""
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise TooLong(f"more than {limit} bytes")
        parts.append(chunk)
