"""The engine process: owns the Engine, takes requests over ZeroMQ, streams token updates back.

It steps whenever any request is in flight and otherwise waits on its socket. Every step's
updates go out in one message with the engine's counters; when idle it still sends a heartbeat
twice a second so the front end knows it is alive.
"""

from __future__ import annotations

import logging
import time

import zmq

from afd_engine.engine import Engine
from afd_engine.engine_args import EngineArgs
from afd_engine.errors import InvalidRequestError
from afd_engine.server import ipc

HEARTBEAT_S = 0.5
log = logging.getLogger("afd.engine")


class EngineLoop:
    def __init__(self, engine: Engine, requests_addr: str, outputs_addr: str) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(requests_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(outputs_addr)
        self.running = True
        self._last_sent = 0.0

    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished()
            self._receive(timeout_ms=0 if busy else int(HEARTBEAT_S * 1000))
            updates = self.engine.step_updates() if self.engine.has_unfinished() else []
            if updates or time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(ipc.StepOutput(updates, self.stats()))
        self.close()

    def stats(self) -> ipc.EngineStats:
        s, pool = self.engine.scheduler, self.engine.pool
        return ipc.EngineStats(len(s.running), len(s.waiting), pool.used_pages, pool.num_pages)

    def _receive(self, timeout_ms: int) -> None:
        if not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                msg = ipc.decode(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, ipc.AddRequest):
            try:
                self.engine.add_request(prompt_token_ids=msg.prompt_ids, params=msg.params, request_id=msg.rid)
            except InvalidRequestError as exc:
                self._send(ipc.Rejected(msg.rid, str(exc), exc.param))
        elif isinstance(msg, ipc.AbortRequest):
            self.engine.abort(msg.rid)
        elif isinstance(msg, ipc.Shutdown):
            self.running = False

    def _send(self, msg) -> None:
        self.push.send(ipc.encode(msg))
        self._last_sent = time.monotonic()

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=1000)
        self.ctx.term()


def run_engine_process(args: EngineArgs, requests_addr: str, outputs_addr: str, ready) -> None:
    """Process entry point: builds the engine, reports readiness (or the error) through `ready`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = Engine(args)
    except Exception as exc:  # any failure to start is reported to the parent, which exits
        ready.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    ready.send({"ok": True, "model_path": str(engine.model_path), "context_len": engine.context_len,
                "architecture": engine.config.architecture})
    log.info("engine ready: %s, %d KV pages of %d tokens", engine.model_path, engine.pool.num_pages,
             engine.pool.page_size)
    EngineLoop(engine, requests_addr, outputs_addr).run()
