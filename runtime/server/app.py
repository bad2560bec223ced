"""The aiohttp application: routes, auth, errors, readiness, drain.

Generation handlers run in the event loop and only wait: on a small thread pool that parses,
checks (limits.py), validates, templates and tokenizes each request, so that probes and streams
keep being answered whatever the bodies cost, and on queues fed by the engine, which runs in its
own thread (async_engine). A client that goes away cancels its handler (aiohttp
`handler_cancellation`), and the handler's `finally` aborts whatever it still had running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvserve.runtime.engine.stop_strings import compile_stops
from kvserve.runtime.structured_outputs.admission import GrammarCompileBusy

from . import parallelism, serving, structured
from .async_engine import AsyncEngine, EngineDeadError
from .auth import admin_denial, bearer_token, is_admin_path, token_matches
from .drain import effective_drain_timeout
from .errors import APIError, from_validation_error
from .limits import RequestLimitError, RequestLimits, check_request
from .lora import LoRARegistry
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, template_messages

log = logging.getLogger("kvserve.server")

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    admin_api_key: str | None = None  # None: admin routes answer 403
    max_queue_len: int = 1024
    drain_timeout_s: float = 30.0
    max_request_body_bytes: int = 8 * 1024 * 1024
    # Bodies read but not yet turned into a plan (waiting for, or on, the preprocessing pool): past
    # this a request gets 429 before its body is read, so a flood of large bodies cannot grow memory.
    max_buffered_request_bytes: int = 64 * 1024 * 1024
    retry_after_s: int = 1
    tools: structured.ToolSettings = field(default_factory=structured.ToolSettings)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Requests being parsed, validated, templated and tokenized at once; more wait their turn.
    # Small on purpose: each holds the GIL for part of its work, which the loop and the engine need.
    preprocess_threads: int = 2
    # LoRA adapters (--enable-lora): how many may be loaded at once (--max-cpu-loras); None: no LoRA.
    max_lora_adapters: int | None = None
    max_loras: int = 1  # adapters in one batch (--max-loras), for vllm:lora_requests_info


@dataclass
class ServerState:
    config: ServerConfig
    metrics: ServerMetrics
    engine: AsyncEngine | None = None
    load_error: str | None = None
    draining: bool = False
    http_in_flight: int = 0
    started_at: float = field(default_factory=time.time)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    admin_drain: asyncio.Task | None = None
    # An admin drain is over (idle, or its time box passed and the rest was aborted): this process
    # will take no more work, so /live and /health fail and the kubelet restarts the container.
    retired: bool = False
    preprocess: ThreadPoolExecutor | None = None
    buffered_request_bytes: int = 0
    lora: LoRARegistry | None = None  # with --enable-lora: the adapters clients may name

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None and not self.draining

    @property
    def limits(self) -> RequestLimits:
        return self.config.limits.for_model(self.engine.max_model_len if self.engine is not None else None)

    async def off_loop(self, fn, *args):
        """Runs fn(*args) on the preprocessing pool. A handler cancelled meanwhile (the client
        left) stops waiting; the work itself finishes and is dropped, having touched no engine."""
        return await asyncio.get_running_loop().run_in_executor(self.preprocess, fn, *args)

    def enter(self) -> None:
        self.http_in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.http_in_flight -= 1
        if self.http_in_flight == 0:
            self.idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stops admission and waits for in-flight requests; True when none is left."""
        self.draining = True
        if self.http_in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except TimeoutError:
            return self.http_in_flight == 0
        return True

    def start_admin_drain(self, timeout: float) -> asyncio.Task:
        """One drain per process; a second request joins the running one. It runs as its own task so
        that a caller who hangs up (handler cancelled) cannot leave the server draining for good."""
        if self.admin_drain is None:
            self.admin_drain = asyncio.create_task(self._drain_and_retire(timeout))
        return self.admin_drain

    async def _drain_and_retire(self, timeout: float) -> dict:
        try:
            drained = await self.drain(timeout)
            aborted = 0
            if not drained and self.engine is not None:
                aborted = self.engine.abort_all()
                log.warning("admin drain: time box of %.1fs passed, aborted %d requests", timeout, aborted)
                await self.drain(5.0)  # the handlers now finish their responses with "abort"
            return {"drained": drained, "aborted": aborted, "timeout_seconds": timeout}
        finally:
            # Whatever happened, admission is closed for good: only a restart brings the pod back.
            self.retired = True
            log.info("admin drain done: /live now fails so the container is restarted")


STATE = web.AppKey("state", ServerState)
REQUEST_ID = web.RequestKey("request_id", str)
# Set once a streamed response has sent its headers: after that an error can only end the stream.
STREAM_STARTED = web.RequestKey("stream_started", bool)


def _key_ok(request: web.Request, key: str) -> bool:
    return token_matches(bearer_token(request.headers.get("Authorization")), key)


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    rid = request.headers.get("X-Request-Id", "")
    if not _REQUEST_ID.match(rid):
        rid = uuid.uuid4().hex
    request[REQUEST_ID] = rid
    try:
        key = state.config.api_key
        # Admin routes take the admin key alone (some live under /v1/, as vLLM names them).
        if key and request.path.startswith(_PROTECTED) and not is_admin_path(request.path) and not _key_ok(request, key):
            raise APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.")
        if is_admin_path(request.path):
            denial = admin_denial(request.headers.get("Authorization"), state.config.admin_api_key,
                                  route=f"{request.method} {request.path}", user_key=key)
            if denial is not None:
                raise APIError(denial.status, denial.message)
        response = await handler(request)
    except APIError as err:
        response = err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"Not found: {request.method} {request.path}",
                   405: f"Method {request.method} is not allowed on {request.path}",
                   413: f"Request body too large (limit {state.config.max_request_body_bytes} bytes)"}
        # A 404 here is an unknown route, not an unknown model.
        code = "not_found" if exc.status == 404 else None
        response = APIError(exc.status, message.get(exc.status, exc.reason), code=code).response()
        if exc.status == 405:
            response.headers["Allow"] = exc.headers.get("Allow", "")
    except EngineDeadError as exc:
        response = APIError(503, f"The engine has stopped: {exc}").response()
    except Exception:
        if request.get(STREAM_STARTED):
            raise  # the headers are out: closing the connection is all that is left
        # A bug of ours still answers in OpenAI's error shape, with an id to find it in the log.
        log.exception("unhandled error in %s %s (request id %s)", request.method, request.path, rid)
        response = APIError(500, f"Internal server error (request id {rid}); details are in the server log.").response()
    if not response.prepared:
        response.headers["X-Request-Id"] = rid
    return response


@contextlib.asynccontextmanager
async def _request_body(request: web.Request):
    """The body, read only once its bytes fit the server's budget for bodies in memory, and counted
    against it until the caller has turned it into a plan. A body without Content-Length is
    counted at the largest size it may have."""
    state = request.app[STATE]
    config = state.config
    declared = request.content_length
    reserved = config.max_request_body_bytes if declared is None else min(declared, config.max_request_body_bytes)
    if state.buffered_request_bytes + reserved > config.max_buffered_request_bytes:
        raise APIError(429, f"The server holds {state.buffered_request_bytes} bytes of request bodies and this one "
                       f"would pass --max-buffered-request-bytes ({config.max_buffered_request_bytes}); retry shortly.",
                       headers={"Retry-After": str(config.retry_after_s)})
    state.buffered_request_bytes += reserved
    try:
        try:
            body = await request.read()  # raises 413 past client_max_size
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body does not match
            raise APIError(400, f"Invalid request body: {str(exc).strip()}") from None
        yield body
    finally:
        state.buffered_request_bytes -= reserved


# json.loads holds the GIL for its whole run (a quarter second for 8 MB): one parse at a time, so
# the event loop waits for at most one of them, not one per preprocessing thread in a row.
_PARSE_LOCK = threading.Lock()


def _parse_json(body: bytes) -> dict:
    try:
        with _PARSE_LOCK:
            obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid JSON body: {exc}") from None
    except RecursionError:  # [[[[...]]]] nested deeper than the parser's recursion limit
        raise APIError(400, "Invalid JSON body: nested too deeply") from None
    if not isinstance(obj, dict):
        raise APIError(400, "The request body must be a JSON object.")
    # JSON's \uD800-style escapes can smuggle lone surrogates into a str; the tokenizer then raises
    # a TypeError (a 500). Only bodies with such an escape pay for the check.
    if _SURROGATE_ESCAPE.search(body):
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise APIError(400, "Invalid JSON body: strings must be valid Unicode (lone surrogate escape).") from None
    return obj


def _check_limits(state: ServerState, body: dict) -> None:
    try:
        check_request(body, state.limits)
    except RequestLimitError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _check_model(state: ServerState, model: str | None) -> Any | None:
    """The LoRA adapter `model` names (a LoRARequest), None for the base model; 404 otherwise."""
    if state.lora is not None:
        return state.lora.resolve(model)
    if model is not None and model not in state.config.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(state.config.served_model_names)}.",
                       param="model")
    return None


def _check_serving(state: ServerState) -> AsyncEngine:
    if state.draining:
        raise APIError(503, "The server is shutting down.", headers={"Retry-After": "1"})
    engine = state.engine
    if engine is None:
        msg = f"The model failed to load: {state.load_error}" if state.load_error else "The model is still loading."
        raise APIError(503, msg, headers={"Retry-After": str(state.config.retry_after_s)})
    if engine.dead is not None:
        raise APIError(503, f"The engine has stopped: {engine.dead!r}")
    return engine


def _tokenize(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def _chat_prompt(tok: Any, messages: list[dict], *, add_generation_prompt: bool, continue_final_message: bool,
                 kwargs: dict | None, tools: list[dict] | None = None) -> str:
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
    try:
        # Templates that know tools render them from `tools`; the others ignore it. The request's
        # tools win over a `tools` template variable.
        extra = dict(kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # jinja raises arbitrary errors for messages the template rejects
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None


def _plan(state: ServerState, raw: bytes, kind: str) -> tuple[AsyncEngine, serving.Plan]:
    """Body -> plan, on the preprocessing pool: everything whose cost grows with the body."""
    body = _parse_json(raw)
    _check_limits(state, body)
    try:
        req = (CompletionRequest if kind == "completion" else ChatCompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    lora_request = _check_model(state, req.model)
    engine = _check_serving(state)
    tok = engine.tokenizer
    if kind == "completion":
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt: must not be empty", param="prompt")
                prompts.append((p, _tokenize(tok, p, req.add_special_tokens)))
            else:
                prompts.append((tok.decode(p) if req.echo else None, list(p)))
    else:
        try:
            messages = req.template_messages()
        except ValueError as exc:
            raise serving.engine_error(exc) from None
        text = _chat_prompt(tok, messages, add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs,
                            tools=req.template_tools())
        prompts = [(text, _tokenize(tok, text, req.add_special_tokens))]
    outputs = structured.plan_outputs(req, state.config.tools)
    plan = serving.make_plan(kind, req, state.model_name, prompts, outputs)
    if lora_request is not None:
        plan.lora_request = lora_request
        plan.model = lora_request.lora_name  # responses name the adapter the client asked for
    if req.stop:
        plan.stop_automaton = compile_stops(tuple(req.stop_list()))
    return engine, plan


async def _prepare(request: web.Request, kind: str):
    state = request.app[STATE]
    async with _request_body(request) as body:
        engine, plan = await state.off_loop(_plan, state, body, kind)
    limit = engine.max_num_seqs + state.config.max_queue_len
    wanted = sum(getattr(params, "n", 1) for _, _, params in plan.engine_requests)
    if wanted > limit:  # could never be admitted: a 429 would have the client retry forever
        raise APIError(400, f"n: this request needs {wanted} sequences (prompts x n) but the server admits at most "
                       f"{limit} (--max-num-seqs + --max-queue-len)", param="n")
    if engine.num_seqs_in_flight + wanted > limit:
        raise APIError(429, f"The server is at capacity ({engine.num_seqs_in_flight} sequences in flight); "
                       "retry later.",
                       headers={"Retry-After": str(state.config.retry_after_s)})
    return state, engine, plan


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _compile_grammar(request: web.Request, engine: AsyncEngine, outputs: structured.OutputPlan) -> None:
    """Waits (without holding the event loop or the engine thread) for the request's grammar; a
    schema, regex or grammar that does not compile (or is past a limit) is a 400 naming the field it
    came from, no room to compile it now a 429. A client that leaves lets go of the compile: the
    last one to leave stops it."""
    if outputs.structured is None:
        return
    manager = engine.structured_outputs
    # In a thread: the limits check walks the schema, tens of ms for a big one.
    acquiring = asyncio.ensure_future(asyncio.to_thread(manager.acquire, outputs.structured, client=request.remote))
    try:
        ticket = await asyncio.shield(acquiring)
    except asyncio.CancelledError:  # the client left first: let go of the hold as soon as it exists
        acquiring.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().release())
        raise
    except GrammarCompileBusy as exc:
        raise APIError(429, f"{outputs.field}: {exc}", param=outputs.field,
                       headers={"Retry-After": str(request.app[STATE].config.retry_after_s)}) from None
    try:
        # shield: this handler being cancelled must not cancel a compile other requests share;
        # release() below decides whether anyone still waits.
        await asyncio.shield(asyncio.wrap_future(ticket.future))
    except ValueError as exc:
        why = str(exc).partition(": ")[2] or str(exc)
        raise APIError(400, f"{outputs.field}: {why}", param=outputs.field) from None
    finally:
        ticket.release()


# Past this many tokens (each logprob alternative counting as one) a whole response is built and
# serialized on the preprocessing pool: n x prompts x max_tokens x top_logprobs can make it tens
# of megabytes of JSON, a second of the event loop that the probes would wait behind.
LARGE_RESPONSE_TOKENS = 16384


def _large_response(plan: serving.Plan) -> bool:
    per_token = 1 + (plan.logprobs or 0) if plan.want_logprobs else 1
    return plan.completion_tokens() * per_token > LARGE_RESPONSE_TOKENS


def _response_bytes(plan: serving.Plan) -> bytes:
    return json.dumps(serving.final_response(plan)).encode()


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state, engine, plan = await _prepare(request, kind)
    state.enter()
    stream = None
    try:
        await _compile_grammar(request, engine, plan.outputs)
        if plan.lora_request is not None:
            # Checked again right before adding: an unload that began meanwhile would otherwise
            # see the engine register the adapter again for this request.
            if state.lora.adapters.get(plan.lora_request.lora_name) is not plan.lora_request:
                raise state.lora.not_found(plan.lora_request.lora_name)
            state.lora.count(plan.lora_request)
        try:
            stream = await engine.add(plan.engine_requests, lora_request=plan.lora_request)
        except ValueError as exc:
            raise serving.engine_error(exc) from None
        by_request = plan.by_request
        if not plan.stream:
            async for out in stream:
                for choice in by_request[out.request_id]:
                    serving.apply_output(choice, out)
            if _large_response(plan):
                body = await state.off_loop(_response_bytes, plan)
                return web.Response(body=body, content_type="application/json")
            return web.json_response(serving.final_response(plan))

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request[REQUEST_ID]})
        await resp.prepare(request)
        request[STREAM_STARTED] = True
        try:
            async for out in stream:
                chunks = []
                for choice in by_request[out.request_id]:
                    serving.apply_output(choice, out)
                    chunks += serving.stream_chunks(plan, choice)
                if chunks:
                    await resp.write(b"".join(_sse(c) for c in chunks))
            if plan.include_usage:
                await resp.write(_sse(serving.usage_chunk(plan)))
        except EngineDeadError as exc:
            await resp.write(_sse(APIError(500, f"The engine has stopped: {exc}").body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        if stream is not None and stream.unfinished:
            engine.abort(list(stream.unfinished))  # client went away or an error: free the blocks now
        state.leave()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


def _model_card(state: ServerState, name: str) -> dict:
    max_len = state.engine.max_model_len if state.engine else None
    card = {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "kvserve",
            "root": name, "parent": None, "max_model_len": max_len}
    if state.lora is not None and name in state.lora.adapters:  # vLLM's shape: root = path, parent = base
        card.update(state.lora.model_card_fields(name))
    return card


def _model_names(state: ServerState) -> list[str]:
    return state.config.served_model_names + (state.lora.names() if state.lora is not None else [])


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state, n) for n in _model_names(state)]})


async def model(request: web.Request) -> web.Response:
    """OpenAI's GET /v1/models/{model} (the official client's models.retrieve)."""
    state = request.app[STATE]
    name = request.match_info["model"]
    _check_model(state, name)
    return web.json_response(_model_card(state, name))


async def _admin_body(request: web.Request) -> dict:
    async with _request_body(request) as body:
        return _parse_json(body)


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name}: required, a non-empty string", param=name)
    return value


def _lora_state(request: web.Request) -> tuple[ServerState, AsyncEngine]:
    state = request.app[STATE]
    if state.lora is None:
        raise APIError(400, "LoRA adapters are not enabled: start the server with --enable-lora")
    return state, _check_serving(state)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Admin (vLLM's route): loads an adapter from a directory the server can read. The engine
    reads and checks it (rank, target modules, base model): a bad one is a 400 saying why."""
    state, engine = _lora_state(request)
    body = await _admin_body(request)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    lora_request = state.lora.new_request(name, path, body.get("base_model_name"))
    state.lora.register(lora_request)  # held while loading: a second load of the name is refused
    try:
        await engine.call(lambda e: e.add_lora(lora_request))
    except ValueError as exc:
        state.lora.unregister(name)
        raise APIError(400, f"The lora adapter '{name}' cannot be loaded: {exc}", param="lora_path") from None
    except BaseException:
        state.lora.unregister(name)
        raise
    log.info("LoRA adapter %s loaded from %s", name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Admin (vLLM's route): unloads an adapter no unfinished request uses (409 while one does)."""
    state, engine = _lora_state(request)
    body = await _admin_body(request)
    name = _field(body, "lora_name")
    lora_request = state.lora.adapters.get(name)
    if lora_request is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    # Out of the table first: no new request can name it while the engine removes it.
    state.lora.unregister(name)
    try:
        await engine.call(lambda e: e.remove_lora(lora_request.lora_int_id))
    except ValueError as exc:
        state.lora.register(lora_request)
        raise APIError(409, f"The lora adapter '{name}' cannot be unloaded now: {exc}", param="lora_name") from None
    except BaseException:
        state.lora.register(lora_request)
        raise
    log.info("LoRA adapter %s unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    async with _request_body(request) as body:
        return web.json_response(await state.off_loop(_tokenize_body, state, body))


def _tokenize_body(state: ServerState, raw: bytes) -> dict:
    body = _parse_json(raw)
    _check_limits(state, body)
    try:
        req = TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    _check_model(state, req.model)
    engine = _check_serving(state)
    tok = engine.tokenizer
    if req.prompt is not None:
        ids = _tokenize(tok, req.prompt, req.add_special_tokens)
    else:
        try:
            messages = template_messages(req.messages)
        except ValueError as exc:
            raise serving.engine_error(exc) from None
        text = _chat_prompt(tok, messages, add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=False, kwargs=None, tools=req.template_tools())
        ids = _tokenize(tok, text, False)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    async with _request_body(request) as body:
        return web.json_response(await state.off_loop(_detokenize_body, state, body))


def _detokenize_body(state: ServerState, raw: bytes) -> dict:
    body = _parse_json(raw)
    try:
        req = DetokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    _check_model(state, req.model)
    engine = _check_serving(state)
    try:
        engine.check_token_ids(req.tokens, "tokens")
    except ValueError as exc:
        raise APIError(400, str(exc), param="tokens") from None
    return {"prompt": engine.tokenizer.decode(req.tokens)}


def _broken(state: ServerState) -> web.Response | None:
    """500 when the process can never serve (a restart might): the load failed or the engine died."""
    if state.engine is not None and state.engine.dead is not None:
        return web.json_response({"status": "engine dead", "error": repr(state.engine.dead)}, status=500)
    if state.load_error:
        return web.json_response({"status": "load failed", "error": state.load_error}, status=500)
    return None


async def health(request: web.Request) -> web.Response:
    """vLLM's meaning: 200 once the engine can serve (still while draining), 503 while loading.

    Clients and charts written for vLLM wait on /health before sending requests, and probe it for
    readiness; a 200 during loading would send them requests that get 503."""
    state = request.app[STATE]
    broken = _broken(state)
    if broken is not None:
        return broken
    if state.engine is None:
        return web.json_response({"status": "loading"}, status=503,
                                 headers={"Retry-After": str(state.config.retry_after_s)})
    if state.retired:
        return _retired()
    return web.json_response({"status": "ok"})


def _retired() -> web.Response:
    return web.json_response({"status": "drained", "error": "drained by POST /drain; waiting for a restart"},
                             status=503)


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while loading, serving or draining; 500 once the process can never serve; 503
    once an admin drain is over, so the kubelet restarts a drained runtime instead of keeping a
    pod that is alive but will never be ready again."""
    state = request.app[STATE]
    broken = _broken(state)
    if broken is not None:
        return broken
    if state.retired:
        return _retired()
    return web.json_response({"status": "loading" if state.engine is None else "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ready"})
    if state.retired:
        why = "drained"
    else:
        why = "draining" if state.draining else ("loading" if state.engine is None else "engine dead")
    return web.json_response({"status": why}, status=503)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    if engine is not None:
        await engine.refresh_stats()
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def drain(request: web.Request) -> web.Response:
    """Admin: stop admission and wait (up to ?timeout=, capped at --drain-timeout) for in-flight
    work; past the time box the rest is aborted. Either way the process then retires (/live 503).
    The admin key was checked by the middleware (is_admin_path)."""
    state = request.app[STATE]
    try:
        timeout = effective_drain_timeout(request.query.get("timeout"), state.config.drain_timeout_s)
    except ValueError as exc:
        raise APIError(400, str(exc), param="timeout") from None
    outcome = await asyncio.shield(state.start_admin_drain(timeout))
    return web.json_response({"draining": True, **outcome, "in_flight": state.http_in_flight})


def build_app(config: ServerConfig, metrics_: ServerMetrics | None = None) -> web.Application:
    app = web.Application(middlewares=[_middleware], client_max_size=config.max_request_body_bytes)
    app[STATE] = ServerState(config=config, metrics=metrics_ or ServerMetrics(config.served_model_names[0]))
    app[STATE].idle.set()
    if config.max_lora_adapters is not None:
        state = app[STATE]
        state.lora = LoRARegistry(config.served_model_names, config.max_lora_adapters, config.max_loras)
        state.metrics.lora = lambda: state.lora
    app[STATE].preprocess = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="kvserve-preprocess")

    async def stop_preprocess(app: web.Application) -> None:
        app[STATE].preprocess.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_preprocess)
    r = app.router
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model:.+}", model)  # served names may contain "/"
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_get("/health", health)
    r.add_get("/live", live)
    r.add_get("/ready", ready)
    r.add_get("/metrics", metrics)
    r.add_post("/drain", drain)
    get_parallelism, post_parallelism = parallelism.handlers(STATE)
    r.add_get("/admin/parallelism", get_parallelism)
    r.add_post("/admin/parallelism", post_parallelism)
    r.add_post("/v1/load_lora_adapter", load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    return app
