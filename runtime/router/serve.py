"""The router's HTTP server: aiohttp's, with a cap on open client connections.

Every open connection costs the router memory before it has sent a single complete request
(about 5 KB idle, measured: 5,000 half-sent requests took a router from 39 to 66 MB), and aiohttp
has no limit of its own, so a client that opens connections and sends its headers slowly could
grow the router without bound. Past `max_connections` a new connection is closed at once, without
an answer: the cheapest refusal there is. Shutdown is aiohttp's graceful one (what web.run_app
does): stop listening, let open requests finish for up to `shutdown_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

log = logging.getLogger("kvserve.router")


class CappedServer:
    """Wraps a web.Server's connection bookkeeping: refuses connections past the cap."""

    def __init__(self, server: web.Server, max_connections: int, *, clock=time.monotonic):
        self.server, self.max_connections, self.clock = server, max_connections, clock
        self.refused_total = 0
        self._last_warning = -float("inf")
        self._admit = server.connection_made
        server.connection_made = self.connection_made  # RequestHandler calls its manager's

    def open_connections(self) -> int:
        return len(self.server.connections)

    def connection_made(self, handler, transport) -> None:
        if self.open_connections() >= self.max_connections:
            self.refused_total += 1
            if self.clock() - self._last_warning > 10:  # one line per 10 s, not one per connection
                self._last_warning = self.clock()
                log.warning("%d client connections open (--max-connections %d): closing new ones "
                            "(%d so far)", self.open_connections(), self.max_connections, self.refused_total)
            transport.abort()  # never registered: aiohttp forgets the handler when it sees the loss
            return
        self._admit(handler, transport)


class CappedRunner(web.AppRunner):
    def __init__(self, app: web.Application, *, max_connections: int, **kwargs):
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.cap: CappedServer | None = None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self.cap = CappedServer(server, self.max_connections)
        return server


async def serve(app: web.Application, *, host: str, port: int, max_connections: int, shutdown_timeout: float,
                ready: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then shuts down gracefully. OSError when it cannot listen."""
    runner = CappedRunner(app, max_connections=max_connections, handler_cancellation=True, access_log=None,
                          shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting down: open requests get up to %gs", shutdown_timeout)
    finally:
        await runner.cleanup()
