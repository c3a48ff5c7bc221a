"""Rank discovery across machines: every rank registers its data-plane address at `--dist-init-addr`
and receives the whole table once all have registered.

The attention role's launcher hosts the rendezvous (a ZeroMQ ROUTER). Ranks may start in any
order, before or after it: ZeroMQ keeps retrying the connection. Both sides give up after a
bounded time with a message that says what is missing.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from afd_engine.errors import ConfigError

log = logging.getLogger("afd.rendezvous")


@dataclass(frozen=True)
class RendezvousSpec:
    """What a rank needs to find its peers (picklable, passed to rank processes)."""

    address: str  # "host:port" of the rendezvous
    host_ip: str  # the address peers reach this machine at
    timeout: float = 300.0


def local_ip_towards(address: str) -> str:
    """This machine's address on the route to `address` (no packet is sent)."""
    host, port = address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def register(spec: RendezvousSpec, endpoint: int) -> dict[int, str]:
    """Announces `endpoint` at a fresh port of this machine; returns every endpoint's address."""
    mine = f"tcp://{spec.host_ip}:{free_port(spec.host_ip)}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://{spec.address}")
        sock.send(json.dumps({"endpoint": endpoint, "address": mine}).encode())
        if not sock.poll(int(spec.timeout * 1000)):
            raise ConfigError(f"rank (endpoint {endpoint}) got no answer from the rendezvous at {spec.address} "
                              f"within {spec.timeout:.0f} s: start every role with the same --dist-init-addr, and "
                              "the attention role (which hosts it) on that address")
        return {int(k): v for k, v in json.loads(sock.recv()).items()}
    finally:
        sock.close(linger=0)
        ctx.term()


class RendezvousServer:
    """Collects `expected` registrations, then answers all of them with the full table."""

    def __init__(self, address: str, expected: int, timeout: float) -> None:
        self.address, self.expected, self.timeout = address, expected, timeout
        self._thread = threading.Thread(target=self._serve, daemon=True, name="rendezvous")

    def start(self) -> "RendezvousServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://{self.address}")
        waiting, table = [], {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(table) < self.expected:
                if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    log.error("only %d of %d ranks registered at %s within %.0f s (registered endpoints: %s)",
                              len(table), self.expected, self.address, self.timeout, sorted(table))
                    return
                ident, body = sock.recv_multipart()
                msg = json.loads(body)
                table[msg["endpoint"]] = msg["address"]
                waiting.append(ident)
            reply = json.dumps(table).encode()
            for ident in waiting:
                sock.send_multipart([ident, reply])
            time.sleep(0.5)  # let the replies leave before the socket closes
        finally:
            sock.close(linger=1000)
            ctx.term()
