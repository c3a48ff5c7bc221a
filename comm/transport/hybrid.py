"""Shared memory to the endpoints on this host, ZeroMQ to the others: one transport for a rank whose
peers are partly on its machine (an FFN node's ranks relaying to each other, A and F on different
machines).

Both halves deliver into one inbox, so a receive (or a `recv_any` over peers of both kinds) waits in
one place; the shared-memory half then runs its receiver thread (shm_transport.py). Messages to this
endpoint itself take the shared-memory path, which puts them straight into the inbox.
"""

from __future__ import annotations

from collections.abc import Iterable

from comm.messages import Message, MsgKey
from comm.transport.base import Transport, make_inbox
from comm.transport.shm_transport import ShmTransport
from comm.transport.zmq_transport import ZmqTransport


class HybridTransport(Transport):
    """addresses: endpoint id -> ZMQ address (this endpoint's is bound; used for the remote peers);
    local: the peers on this host (reached through shared memory under `namespace`); keys: the
    cluster secret's, for the ZeroMQ links (comm/auth.py)."""

    def __init__(
        self,
        endpoint: int,
        addresses: dict[int, str],
        local: Iterable[int],
        *,
        namespace: str,
        link_delay_s: float = 0.0,
        keys=None,
        host: str = "",
        **shm_kwargs,
    ) -> None:
        self.endpoint, self.host = endpoint, host
        self.local = set(local) | {endpoint}
        self._inbox = make_inbox(endpoint, link_delay_s)
        self._shm = ShmTransport(endpoint, self.local, namespace=namespace, inbox=self._inbox, **shm_kwargs)
        try:
            self._zmq = ZmqTransport(endpoint, addresses, inbox=self._inbox, keys=keys)
        except BaseException:
            self._shm.close()
            raise

    def send(self, dst: int, msg: Message) -> None:
        (self._shm if dst in self.local else self._zmq).send(dst, msg)

    def readmit(self, peer: int, address: str, host: str, incarnation: int) -> None:
        """A replacement of `peer`: over shared memory where it runs on this host, else ZeroMQ
        (it may run somewhere else than the process it replaces)."""
        if host and host == self.host:
            self.local.add(peer)
            self._shm.readmit(peer, address, host, incarnation)
        else:
            self.local.discard(peer)
            with self._shm._pump_lock:
                self._shm._drop_peer(peer)
            self._zmq.readmit(peer, address, host, incarnation)

    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        return self._inbox.take([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        return self._inbox.take(srcs, kind, key, timeout)

    def close(self) -> None:
        self._shm.close()
        self._zmq.close()
