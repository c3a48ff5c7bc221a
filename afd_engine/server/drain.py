"""Graceful draining of the HTTP front ends (`afd serve`, `afd router`) on SIGTERM or SIGINT.

The first signal starts the drain. Generation requests (GENERATION_PATHS) that arrive from then on
get 503 with `Retry-After` and `Connection: close`, and `/health` answers 503 `{"status":
"draining"}`, so that load balancers and a Kubernetes readiness probe send traffic elsewhere; the
requests in flight, streams included, run to their end for up to `--drain-timeout` seconds. Those
still running then are cut: a stream ends with an OpenAI error event and `data: [DONE]`, a request
whose answer has not started gets a 503. Then the server stops as it always did, exit status 0.

A second signal during the drain stops the server at once, without waiting for anything, with the
status a shell gives a process killed by that signal: 128 + its number (143 for SIGTERM, 130 for
SIGINT).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import uvicorn
from fastapi.responses import JSONResponse

from afd_engine.errors import ConfigError
from afd_engine.server.errors import error_body, openai_error

# the routes that start generation, on `afd serve` and `afd router` alike
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
RETRY_AFTER_S = 1
# what requests cut at the drain timeout get to send their last event; then also uvicorn's own
# graceful shutdown, for what is left on other routes
CUT_GRACE_S = 2.0


class Drain:
    """The drain's state, shared by the server (which starts it), the gate (which refuses new
    generation requests and knows those in flight) and the routes (/health, /metrics)."""

    def __init__(self, timeout: float, log: logging.Logger) -> None:
        if timeout < 0:
            raise ConfigError(f"--drain-timeout={timeout} must be at least 0 (seconds)")
        self.timeout = timeout
        self.log = log
        self.draining = False
        self._tasks: set[asyncio.Task] = set()  # the generation requests in flight
        self._cut: set[asyncio.Task] = set()
        self._idle: asyncio.Event | None = None

    @property
    def in_flight(self) -> int:
        """Generation requests running now."""
        return len(self._tasks)

    def begin(self) -> None:
        """Refuses generation requests from now on. Only sets a flag: a signal handler calls it."""
        self.draining = True

    async def run(self) -> tuple[int, int]:
        """Waits for the requests in flight, up to the timeout, then cuts the rest; returns how
        many (finished, cut). New generation requests are refused throughout and afterwards."""
        self.draining = True
        start, in_flight = time.monotonic(), self.in_flight
        self.log.info(
            "draining: new generation requests get 503; %d in flight may run for up to %g s (--drain-timeout)",
            in_flight,
            self.timeout,
        )
        self._idle = asyncio.Event()
        if not self._tasks:
            self._idle.set()
        cut = 0
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout)
        except asyncio.TimeoutError:
            cut = len(self._tasks)
            for task in self._tasks:
                self._cut.add(task)
                task.cancel()
            with contextlib.suppress(asyncio.TimeoutError):  # the cut requests' own ends: waited for briefly
                await asyncio.wait_for(self._idle.wait(), CUT_GRACE_S)
        self.log.info(
            "drained in %.1f s: %d request(s) finished, %d cut at the drain timeout",
            time.monotonic() - start,
            in_flight - cut,
            cut,
        )
        return in_flight - cut, cut

    def refusal(self) -> JSONResponse:
        """The 503 of a generation request that arrives during the drain."""
        response = openai_error(
            503,
            "the server is draining: it is shutting down and takes no new requests; retry (another replica "
            "will answer)",
            type="server_error",
        )
        # the client's retry opens a new connection, which a load balancer can send elsewhere
        response.headers.update({"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        return response

    def health(self) -> JSONResponse:
        """/health during the drain."""
        return JSONResponse({"status": "draining"}, status_code=503)

    def cut_message(self) -> str:
        return (
            "the server shut down before this request finished: it was still running when the drain "
            f"timeout (--drain-timeout {self.timeout:g} s) passed"
        )

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._cut.discard(task)
        if not self._tasks and self._idle is not None:
            self._idle.set()


class DrainGate:
    """ASGI middleware (the outermost): refuses generation requests while draining and runs each
    admitted one as a task the drain can wait for and, at its timeout, cancel."""

    def __init__(self, app, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        drain = self.drain
        if drain.draining:
            return await drain.refusal()(scope, receive, send)
        sent = _Progress(send)
        task = asyncio.ensure_future(self.app(scope, receive, sent))
        drain._tasks.add(task)
        try:
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:  # the server gave up on this request: so does the app
                task.cancel()
                raise
            if task.cancelled() and task in drain._cut:
                await sent.cut(drain.cut_message(), scope, receive)
            else:
                task.result()  # the app's own exception, as without the gate
        finally:
            drain._ended(task)


class _Progress:
    """A response's `send`, noting how far the response got (recorded once each message is sent:
    a message cancelled while waiting to be written was not)."""

    __slots__ = ("send", "started", "ended", "sse", "at_event_boundary")

    def __init__(self, send) -> None:
        self.send = send
        self.started = self.ended = self.sse = False
        self.at_event_boundary = True

    async def __call__(self, message) -> None:
        await self.send(message)
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self.at_event_boundary = bytes(body).endswith(b"\n\n")
            self.ended = not message.get("more_body", False)

    async def cut(self, message: str, scope, receive) -> None:
        """Ends a response whose request was cut: a 503 if nothing was sent yet; a stream's last
        event an OpenAI error, then [DONE] (only between events: a relayed stream may have stopped
        inside one, which then just ends); any other body just ends."""
        if self.ended:
            return
        if not self.started:
            response = openai_error(503, message, type="server_error")
            response.headers["Connection"] = "close"
            return await response(scope, receive, self.send)
        tail = b""
        if self.sse and self.at_event_boundary:
            tail = f"data: {json.dumps(error_body(message, type='server_error'))}\n\ndata: [DONE]\n\n".encode()
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains (the module's docstring) instead of
    stopping at once. `exit_status` is then 0, or 128 + the second signal's number."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        # after the drain only requests of other routes (and cut ones ending) are left to wait for
        config.timeout_graceful_shutdown = CUT_GRACE_S
        super().__init__(config)
        self.drain = drain
        self.exit_status = 0
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # (not recorded for uvicorn to raise again after it stops: the command returns the status)
        if self.should_exit or self.drain.draining:  # a second signal: stop now
            if not self.force_exit:
                self.exit_status = 128 + int(sig)
            self.force_exit = self.should_exit = True
        elif not self.started:  # still starting: nothing is in flight
            self.should_exit = True
        else:
            self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_stop())
        return await super().on_tick(counter)

    async def _drain_then_stop(self) -> None:
        await self.drain.run()
        self.should_exit = True
