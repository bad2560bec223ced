"""Admin: the server's parallel layout, read and changed live (``/admin/parallelism``).

The admin key is checked by the app's middleware (every path under /admin/ is an admin path).
The change itself runs on the engine thread between steps (runtime/engine/data_parallel.py), so
requests arriving meanwhile wait in the engine's queue and none is refused.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .errors import APIError

MAX_BODY_BYTES = 4096


def parse_layout(raw: bytes) -> tuple[int, int]:
    """(data_parallel, tensor_parallel) from the request body; APIError 400 naming the field."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"Request body too large (limit {MAX_BODY_BYTES} bytes)")
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object like {\"data_parallel\": 2, \"tensor_parallel\": 1}")
    unknown = sorted(set(body) - {"data_parallel", "tensor_parallel"})
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown field (expected data_parallel, tensor_parallel)", param=unknown[0])
    values = []
    for name in ("data_parallel", "tensor_parallel"):
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise APIError(400, f"{name}: must be a positive integer, got {value!r}", param=name)
        values.append(value)
    return values[0], values[1]


def _engine_or_503(request: web.Request, state_key):
    state = request.app[state_key]
    engine = state.engine
    if engine is None:
        raise APIError(503, "The model is still loading.")
    if not hasattr(engine.engine, "reshape"):
        raise APIError(400, "This engine cannot change its parallel layout live.")
    return engine


def layout_of(engine) -> dict:
    return {"data_parallel": engine.data_parallel_size, "tensor_parallel": engine.tensor_parallel_size,
            "devices": engine.num_devices, "history": list(engine.reshapes)}


def handlers(state_key):
    async def get_parallelism(request: web.Request) -> web.Response:
        engine = _engine_or_503(request, state_key)
        return web.json_response(await engine.call(layout_of))

    async def post_parallelism(request: web.Request) -> web.Response:
        from kvserve.runtime.engine.data_parallel import ReshapeError

        dp, tp = parse_layout(await request.content.read(MAX_BODY_BYTES + 1))
        engine = _engine_or_503(request, state_key)
        try:
            # Shielded: a client that hangs up does not leave a reshape half done (it finishes anyway).
            record = await asyncio.shield(engine.call(lambda e: e.reshape(dp, tp)))
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise APIError(400, str(exc), param=field if field in ("data_parallel", "tensor_parallel") else None) \
                from None
        except ReshapeError as exc:
            raise APIError(500, str(exc), code="reshape_rolled_back") from None
        return web.json_response(record)

    return get_parallelism, post_parallelism

