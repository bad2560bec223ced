"""`kvserve serve`: listen first, load the engine in the background, drain on SIGTERM, exit 0.

Listening before the model is loaded lets /live answer (the process is alive) while /health and
/ready say 503, so Kubernetes neither kills a slow-loading pod nor routes traffic to it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .app import STATE, ServerConfig, build_app
from .args import structured_outputs_config
from .async_engine import AsyncEngine
from .auth import AdminKeyError, load_admin_key
from .limits import RequestLimits
from .structured import ToolSettings

log = logging.getLogger("kvserve.server")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the CLI flags (unset flags keep the engine's defaults)."""
    kw: dict[str, Any] = dict(model=args.model, dtype=args.dtype, device=args.device,
                              tensor_parallel_size=args.tensor_parallel_size, seed=args.seed)
    if getattr(args, "pipeline_parallel_size", 1) != 1:
        kw["pipeline_parallel_size"] = args.pipeline_parallel_size
    for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                 "kv_cache_memory_bytes", "gpu_memory_utilization", "kv_cache_dtype",
                 "kv_offload_bytes", "kv_offload_dir", "kv_transfer_config", "swap_space"):
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = value
    if getattr(args, "enable_prefix_caching", None) is not None:
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    if getattr(args, "speculative_config", None):
        kw["speculative_config"] = args.speculative_config  # JSON; the engine validates it
    if getattr(args, "enforce_eager", None):
        kw["enforce_eager"] = True
    if getattr(args, "async_scheduling", None):
        kw["async_scheduling"] = True
    if getattr(args, "disable_hybrid_kv_cache_manager", None):
        kw["disable_hybrid_kv_cache_manager"] = True
    if getattr(args, "kv_events_config", None):
        kw["kv_events_config"] = args.kv_events_config  # JSON; the engine validates it
    if getattr(args, "compilation_config", None):
        kw["compilation_config"] = args.compilation_config  # JSON or a level; the engine validates it
    if getattr(args, "enable_lora", None):  # without it the engine config is the base model's alone
        kw["enable_lora"] = True
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype"):
            if getattr(args, name, None) is not None:
                kw[name] = getattr(args, name)
    return kw


def lora_problem(args: argparse.Namespace) -> str | None:
    """LoRA flags that only make sense together (the one-line reason, or None)."""
    if getattr(args, "enable_lora", None):
        return None
    for flag in ("lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype"):
        if getattr(args, flag, None):
            return f"--{flag.replace('_', '-')} needs --enable-lora"
    return None


def _load_in_daemon_thread(factory: Callable[[], Any]) -> Future:
    # A daemon thread, not asyncio.to_thread: SIGTERM during a long load must not wait for it.
    fut: Future = Future()

    def run():
        try:
            fut.set_result(factory())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="kvserve-load", daemon=True).start()
    return fut


def _with_static_adapters(factory: Callable[[], Any], registry, modules) -> Callable[[], Any]:
    """The engine, with --lora-modules loaded on the loading thread before it serves."""
    from .lora import load_static

    def build():
        engine = factory()
        try:
            load_static(engine, registry, modules)
        except BaseException:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            raise
        return engine

    return build


@dataclass
class Server:
    """One server's lifecycle; `serve()` returns the process exit code."""

    args: argparse.Namespace
    engine_factory: Callable[[], Any] | None = None
    install_signals: bool = True

    def __post_init__(self):
        self.stop_event: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None
        self.listening = threading.Event()
        self.state = None

    def request_stop(self) -> None:
        """Thread-safe: begins the drain-and-exit sequence (what SIGTERM does)."""
        if self.loop is not None and self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)

    async def serve(self) -> int:
        a = self.args
        self.loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        try:
            admin_api_key = admin_key_from_args(a)
        except AdminKeyError as exc:
            log.error("%s", exc)
            self.listening.set()
            return 2
        config = ServerConfig(
            served_model_names=a.served_model_name or [a.model],
            api_key=a.api_key,
            admin_api_key=admin_api_key,
            max_queue_len=a.max_queue_len,
            drain_timeout_s=a.drain_timeout,
            max_request_body_bytes=a.max_request_body_bytes,
            max_buffered_request_bytes=a.max_buffered_request_bytes,
            limits=RequestLimits(max_stop_strings=a.max_stop_strings, max_messages=a.max_messages,
                                 max_prompt_chars=a.max_prompt_chars, max_schema_chars=a.max_schema_chars),
            tools=ToolSettings(enable_auto_tool_choice=getattr(a, "enable_auto_tool_choice", False),
                               tool_call_parser=getattr(a, "tool_call_parser", None)),
            max_lora_adapters=(getattr(a, "max_cpu_loras", None) or getattr(a, "max_loras", None) or 1
                               if getattr(a, "enable_lora", None) else None),
            max_loras=getattr(a, "max_loras", None) or 1,
        )
        app = build_app(config)
        state = self.state = app[STATE]
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, a.host, a.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:  # port in use, unknown host: a clear line and exit 1, not a traceback
            log.error("cannot listen on %s:%d: %s", a.host, a.port, exc.strerror or exc)
            await runner.cleanup()
            self.listening.set()
            return 1
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("listening on http://%s:%d (model loading)", a.host, self.port)
        if admin_api_key is None:  # say it once here rather than leave a 403 on /drain to explain it
            log.info("no admin key (--admin-api-key or --admin-api-key-file): admin routes such as "
                     "POST /drain answer 403")
        self.listening.set()
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(sig, self.stop_event.set)

        exit_code = 0
        factory = self.engine_factory or self._default_factory()
        if state.lora is not None and getattr(a, "lora_modules", None):
            factory = _with_static_adapters(factory, state.lora, a.lora_modules)
        load = asyncio.wrap_future(_load_in_daemon_thread(factory))
        stop = asyncio.create_task(self.stop_event.wait())
        await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            try:
                engine = load.result()
            except Exception as exc:
                log.error("model failed to load: %s", exc)
                state.load_error = f"{type(exc).__name__}: {exc}"
                exit_code = 1
                self.stop_event.set()
            else:
                grammars = getattr(engine, "structured_outputs", None)
                if grammars is not None and hasattr(a, "structured_outputs_compile_timeout"):
                    # Workers start with the first compile: a pod that never sees a schema keeps the
                    # ~300 MiB and the seconds of start-up CPU they cost.
                    grammars.configure(*structured_outputs_config(a), start_workers=False)
                state.engine = AsyncEngine(engine, on_stats=state.metrics.update)
                state.engine.start()
                log.info("ready: serving %s as %s", a.model, ", ".join(config.served_model_names))
        await stop

        log.info("draining: up to %.1fs for %d in-flight requests", config.drain_timeout_s, state.http_in_flight)
        drained = await state.drain(config.drain_timeout_s)
        if not drained and state.engine is not None:
            log.warning("drain timeout: aborting %d requests", state.engine.abort_all())
            await state.drain(5.0)  # the handlers now finish their responses with "abort"
        await runner.cleanup()
        if state.engine is not None:
            await state.engine.stop()
            await state.engine.close()  # tensor-parallel workers are processes: reap them before exiting
        log.info("stopped")
        return exit_code

    def _default_factory(self) -> Callable[[], Any]:
        kwargs = engine_kwargs(self.args)

        dp = getattr(self.args, "data_parallel_size", 1) or 1
        spares = bool(getattr(self.args, "reshape_spare_workers", False))

        def build():
            from kvserve.runtime.config import EngineConfig
            from kvserve.runtime.engine.data_parallel import DataParallelEngine

            # Always the data-parallel engine, even of one: the layout may change live later.
            return DataParallelEngine(EngineConfig.from_args(**kwargs), dp, spare_workers=spares)

        return build


def preflight(args: argparse.Namespace) -> str | None:
    """Checks what can be refused before listening and returns the one-line reason, or None: every
    engine option on its own (JSON of --compilation-config / --speculative-config, --dtype, ...),
    then the options against the checkpoint's config (weight format, device, KV cache dtype, the
    tensor-parallel degree against the heads and MLP sizes). A model directory that cannot be
    read, or weights that do not load, are left to the load, which reports it on /ready and exits 1."""
    from kvserve.runtime.config import EngineConfig

    if (problem := lora_problem(args)) is not None:
        return problem
    try:
        EngineConfig.from_args(**engine_kwargs(args))
    except ValueError as exc:
        return str(exc)
    try:
        from kvserve.runtime.gguf.reader import resolve_model_path
        from kvserve.runtime.model_config import ModelConfig

        model_config = ModelConfig.from_pretrained(resolve_model_path(args.model))
    except ValueError:
        return None
    from kvserve.runtime.engine import check_kv_cache_dtype_for_model
    from kvserve.runtime.executor.multiproc import check_tensor_parallel
    from kvserve.runtime.models.quantization import check_quantization

    try:
        check_quantization(args.quantization, model_config.hf_config, args.device, args.dtype)
        check_kv_cache_dtype_for_model(args.kv_cache_dtype or "auto", model_config)
        check_tensor_parallel(model_config, args.tensor_parallel_size)
        if getattr(args, "pipeline_parallel_size", 1) != 1:
            from kvserve.runtime.executor.pipeline_worker import check_pipeline_parallel

            check_pipeline_parallel(model_config, args.pipeline_parallel_size)
            if getattr(args, "data_parallel_size", 1) != 1:
                # Rank 0 of every stage group joins this process's one torch.distributed group.
                raise ValueError("pipeline_parallel_size: cannot be combined with --data-parallel-size > 1 "
                                 "(one pipeline group per server process); run replicas instead")
        from kvserve.runtime.engine.layout import Layout, check_layout

        layout = Layout(getattr(args, "data_parallel_size", 1), args.tensor_parallel_size)
        check_layout(layout, layout.devices)
    except ValueError as exc:
        return str(exc)
    return None


def admin_key_from_args(args: argparse.Namespace) -> str | None:
    return load_admin_key(getattr(args, "admin_api_key", None), getattr(args, "admin_api_key_file", None),
                          user_key=args.api_key)


def run_server(args: argparse.Namespace) -> int:
    try:
        admin_key_from_args(args)  # a bad admin key is a usage error, before anything loads
    except AdminKeyError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    problem = preflight(args)
    if problem is not None:
        print(f"kvserve serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:  # torch logs FakeTensor cache stats at INFO on every exit
        logging.getLogger("torch").setLevel(logging.WARNING)
    return asyncio.run(Server(args).serve())


class ServerThread:
    """An in-process server on its own event loop thread (tests and benchmarks)."""

    def __init__(self, argv: list[str], engine_factory: Callable[[], Any] | None = None):
        from kvserve.runtime.cli import build_parser

        self.args = build_parser().parse_args(["serve", *argv])
        self.server = Server(self.args, engine_factory=engine_factory, install_signals=False)
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-server", daemon=True)

    def _run(self) -> None:
        self.exit_code = asyncio.run(self.server.serve())

    def start(self, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self.server.listening.wait(timeout):
            raise RuntimeError("server did not start listening")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def stop(self, timeout: float = 60.0) -> int | None:
        self.server.request_stop()
        self._thread.join(timeout)
        return self.exit_code
