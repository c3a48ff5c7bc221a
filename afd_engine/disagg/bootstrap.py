"""The prefill instance's bootstrap server: where decode ranks learn its ranks and its model.

It runs in the prefill instance's front end (a thread with a ZeroMQ REP socket on
--disaggregation-bootstrap-port). The answer lists each prefill rank's KV message address (a
request of room R is prefilled by rank R mod ranks, where the front end sends it) and the
instance's description, which the decode rank compares with its own before reserving anything.
"""

from __future__ import annotations

import threading
import time

import msgpack
import zmq

from afd_engine.errors import AFDError, ConfigError

QUERY_TIMEOUT_MS = 2000


class BootstrapError(AFDError):
    """The prefill instance's bootstrap server did not answer."""


class BootstrapServer:
    def __init__(self, host: str, port: int, ranks: list[str], description: dict) -> None:
        self.answer = msgpack.packb({"ranks": ranks, "desc": description})
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            self.ctx.term()
            raise ConfigError(
                f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port} ({exc}); choose a free port"
            ) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="afd-bootstrap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(200):
                self.sock.recv()
                self.sock.send(self.answer)
        self.sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.ctx.term()


class BootstrapQuery:
    """One question to a prefill instance's bootstrap server, asked without blocking: `answer()`
    is None until the answer is in, and raises BootstrapError once timeout_ms have passed."""

    def __init__(self, ctx: zmq.Context, address: str, timeout_ms: int = QUERY_TIMEOUT_MS) -> None:
        self.address, self.timeout_ms = address, timeout_ms
        self.deadline = time.monotonic() + timeout_ms / 1000
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        self.sock.send(b"?")

    def answer(self) -> dict | None:
        try:
            data = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            if time.monotonic() > self.deadline:
                self.close()
                raise BootstrapError(
                    f"the prefill instance's bootstrap server at {self.address} did not answer within "
                    f"{self.timeout_ms / 1000:g} s"
                ) from None
            return None
        self.close()
        return msgpack.unpackb(data)

    def close(self) -> None:
        self.sock.close(linger=0)
