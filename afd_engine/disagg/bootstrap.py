"""The prefill instance's bootstrap server: where decode ranks learn its ranks and its model.

It runs in the prefill instance's front end (a thread with a ZeroMQ REP socket on
--disaggregation-bootstrap-port). The answer lists each prefill rank's KV message address (a
request of room R is prefilled by rank R mod ranks, where the front end sends it) and the
instance's description, which the decode rank compares with its own before reserving anything.
With a cluster secret (AFD_CLUSTER_SECRET), the socket is a CURVE server that answers only
holders of the secret, as the KV message sockets are.
"""

from __future__ import annotations

import threading
import time

import msgpack
import zmq

from afd_engine.errors import AFDError, ConfigError
from comm.auth import cluster_keys, secure_socket, start_authenticator

QUERY_TIMEOUT_MS = 2000


class BootstrapError(AFDError):
    """The prefill instance's bootstrap server did not answer."""


class BootstrapServer:
    def __init__(self, host: str, port: int, ranks: list[str], description: dict) -> None:
        self.answer = msgpack.packb({"ranks": ranks, "desc": description})
        self.ctx = zmq.Context()
        keys = cluster_keys(None)
        self._auth = start_authenticator(self.ctx, keys) if keys is not None else None
        self.sock = self.ctx.socket(zmq.REP)
        secure_socket(self.sock, keys, server=True)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            self._stop_auth()
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
                self.sock.recv()  # (whatever the question: the answer is the same)
                self.sock.send(self.answer)
        self.sock.close(linger=0)

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._stop_auth()
        self.ctx.term()


class BootstrapQuery:
    """One question to a prefill instance's bootstrap server, asked without blocking: `answer()`
    is None until the answer is in, and raises BootstrapError once timeout_ms have passed."""

    def __init__(self, ctx: zmq.Context, address: str, timeout_ms: int = QUERY_TIMEOUT_MS, keys=None) -> None:
        self.address, self.timeout_ms, self.keys = address, timeout_ms, keys
        self.deadline = time.monotonic() + timeout_ms / 1000
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_socket(self.sock, keys, server=False)
        self.sock.connect(f"tcp://{address}")
        self.sock.send(b"?")

    def answer(self) -> dict | None:
        try:
            data = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            if time.monotonic() > self.deadline:
                self.close()
                secret = (
                    " (this instance has a cluster secret: the prefill instance needs the same)" if self.keys else ""
                )
                raise BootstrapError(
                    f"the prefill instance's bootstrap server at {self.address} did not answer within "
                    f"{self.timeout_ms / 1000:g} s{secret}"
                ) from None
            return None
        self.close()
        return msgpack.unpackb(data)

    def close(self) -> None:
        self.sock.close(linger=0)
