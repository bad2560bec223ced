"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # the agent renders these errors too, and starts without pydantic's import time
    from pydantic import ValidationError

# status -> (OpenAI error type, default code)
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("service_unavailable_error", "service_unavailable"),
}


class APIError(Exception):
    """Raised anywhere in request handling; rendered once by the error middleware."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _KINDS.get(status, ("", None))[1]
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _KINDS.get(self.status, ("invalid_request_error", None))[0]

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "function-after", "literal"):
            continue  # union branch names pydantic puts in locations
        else:
            out += f".{part}"
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first bad field; all problems go in the message."""
    errors = exc.errors(include_url=False)
    msgs = []
    params = []
    for e in errors[:5]:
        where = _loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not where and ": " in msg and " " not in msg.split(": ", 1)[0]:
            where, msg = msg.split(": ", 1)  # model-level checks name their field first
        params.append(where or None)
        msgs.append(f"{where}: {msg}" if where else msg)
    param = params[0]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return APIError(400, "; ".join(msgs) + more, param=param)
