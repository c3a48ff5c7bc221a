"""Draining in process (server/drain.py): what a generation request gets while the server drains,
and how one still running at the drain timeout ends (the signals, the real server and the exit
statuses are in test_drain.py); and, with the same in-process router, the JSON error a client gets
when the router itself fails."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from afd_engine.errors import ConfigError
from afd_engine.server.api_server import build_app
from afd_engine.server.drain import Drain, DrainGate
from afd_engine.server.pd_router import PDRouter, build_router_app
from afd_engine.server.serve import ServerArgs

DRAINING = "the server is draining: it is shutting down and takes no new requests; retry (another replica will answer)"
BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "/generate": {"text": "hi"},
}
log = logging.getLogger("test.drain")


async def _call(app, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def check_refused(app, drain: Drain) -> None:
    drain.begin()
    for path, body in BODIES.items():
        resp = asyncio.run(_call(app, "POST", path, json=body))
        assert resp.status_code == 503, (path, resp.text)
        assert resp.headers["retry-after"] == "1" and resp.headers["connection"] == "close"
        assert resp.json() == {"error": {"message": DRAINING, "type": "server_error", "param": None, "code": None}}
    health = asyncio.run(_call(app, "GET", "/health"))
    assert (health.status_code, health.json()) == (503, {"status": "draining"})


def test_the_server_refuses_generation_while_draining(tiny_v3):
    app = build_app(tiny_v3, "tiny", ServerArgs(drain_timeout=3), lambda: {}, None, None)
    drain = app.state.drain
    assert drain.timeout == 3 and not drain.draining
    check_refused(app, drain)


def test_the_router_refuses_generation_while_draining():
    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    drain = Drain(2.0, log)
    app = build_router_app(router, drain=drain)
    check_refused(app, drain)
    metrics = asyncio.run(_call(app, "GET", "/metrics")).text
    assert "afd_router_draining 1.0" in metrics


def test_a_negative_drain_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"--drain-timeout=-1 must be at least 0 \(seconds\)"):
        ServerArgs(drain_timeout=-1)
    with pytest.raises(ConfigError, match=r"--drain-timeout=-0.5 must be at least 0"):
        Drain(-0.5, log)


def endless_app(drain: Drain) -> FastAPI:
    """A stream that never ends (/v1/completions), an answer that never comes (/generate) and one
    that comes at once (/v1/chat/completions)."""
    app = FastAPI()

    async def events():
        yield 'data: {"n": 0}\n\n'
        while True:
            await asyncio.sleep(0.01)
            yield 'data: {"n": 1}\n\n'

    @app.post("/v1/completions")
    async def stream():
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def forever():
        await asyncio.Event().wait()

    @app.post("/v1/chat/completions")
    async def quick():
        return {"ok": True}

    app.add_middleware(DrainGate, drain=drain)
    return app


def test_requests_still_running_at_the_drain_timeout_are_cut():
    drain = Drain(0.3, log)
    app = endless_app(drain)

    async def scenario():
        stream = asyncio.ensure_future(_call(app, "POST", "/v1/completions"))
        whole = asyncio.ensure_future(_call(app, "POST", "/generate"))
        quick = await _call(app, "POST", "/v1/chat/completions")  # ended before the drain: not counted
        assert quick.json() == {"ok": True}
        while drain.in_flight < 2:
            await asyncio.sleep(0.01)
        drain.begin()
        counts = await drain.run()
        return counts, await stream, await whole

    (finished, cut), stream, whole = asyncio.run(scenario())
    assert (finished, cut) == (0, 2) and drain.in_flight == 0
    message = (
        "the server shut down before this request finished: it was still running when the drain timeout "
        "(--drain-timeout 0.3 s) passed"
    )
    events = [line.removeprefix("data: ") for line in stream.text.split("\n\n") if line]
    assert stream.status_code == 200 and events[0] == '{"n": 0}' and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {
        "error": {"message": message, "type": "server_error", "param": None, "code": None}
    }
    assert whole.status_code == 503 and whole.json()["error"]["message"] == message


def test_a_router_failure_reaches_the_client_as_a_json_error(monkeypatch):
    # an exception inside the router (a bug, not an instance's answer) is OpenAI's 500 shape, not
    # Starlette's plain "Internal Server Error" that an OpenAI client cannot parse
    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])

    async def broken(job, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("afd_engine.server.pd_failover.open_request", broken)
    app = build_router_app(router, drain=Drain(2.0, log))
    for path, body in BODIES.items():
        resp = asyncio.run(_call(app, "POST", path, json=body))
        assert resp.status_code == 500, (path, resp.text)
        assert resp.json()["error"] == {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": None,
        }


class FakeTry:
    """A try of a request as the router's relay and open_request use it, recording its close."""

    kv_arrived = True

    def __init__(self) -> None:
        self.closed = False

    async def wait(self, work) -> None:
        await asyncio.wait({work})

    async def close(self) -> None:
        self.closed = True


class FailingAttempt(FakeTry):
    """A try whose decode stream sends one event, then fails inside the router (a bug: not an
    httpx error, which would be the instance's failure)."""

    def __init__(self) -> None:
        super().__init__()

        async def events():
            yield b'data: {"id": "cmpl-1", "choices": []}\n\n'
            raise RuntimeError("boom")

        self.response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


def test_a_router_failure_mid_stream_ends_the_stream_with_an_error_event(monkeypatch, caplog):
    # not a cut connection (the client's read raising); the try is closed, the cause logged
    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    attempt = FailingAttempt()

    async def opened(*args, **kwargs):
        return attempt

    monkeypatch.setattr("afd_engine.server.pd_failover.open_request", opened)
    app = build_router_app(router, drain=Drain(2.0, log))
    with caplog.at_level(logging.ERROR, logger="afd.router"):
        resp = asyncio.run(_call(app, "POST", "/v1/chat/completions", json=BODIES["/v1/chat/completions"]))
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert resp.status_code == 200 and len(events) == 3 and events[-1] == "[DONE]", resp.text
    assert events[0] == '{"id": "cmpl-1", "choices": []}'
    assert json.loads(events[1]) == {
        "error": {
            "message": "the router failed while relaying this stream (its log has the cause)",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert attempt.closed
    assert "RuntimeError: boom" in caplog.text and "the router failed a stream of /v1/chat/completions" in caplog.text


class BrokenTry(FakeTry):
    """A try the router fails on while it waits for the decode instance's answer."""

    async def wait(self, work) -> None:
        raise RuntimeError("boom")


def test_a_router_failure_before_the_answer_closes_the_try(monkeypatch):
    # its requests on the instances are aborted (they would hold KV pages until they finished)
    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    tries = []

    def start(*args, **kwargs):
        tries.append(BrokenTry())
        return tries[-1]

    monkeypatch.setattr("afd_engine.server.pd_failover.start", start)
    monkeypatch.setattr("afd_engine.server.pd_failover.Attempt", BrokenTry)
    app = build_router_app(router, drain=Drain(2.0, log))
    resp = asyncio.run(_call(app, "POST", "/v1/completions", json=BODIES["/v1/completions"]))
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error", resp.text
    assert len(tries) == 1 and tries[0].closed
