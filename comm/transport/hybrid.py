"""Shared memory to the endpoints on this host, ZeroMQ to the others: one transport for a rank whose
peers are partly on its machine (an FFN node's ranks relaying to each other, A and F on different
machines).

Both halves deliver into one inbox, so a receive (or a `recv_any` over peers of both kinds) waits in
one place; the shared-memory half then runs its receiver thread (shm_transport.py). Messages to this
endpoint itself take the shared-memory path, which puts them straight into the inbox.

`payload_device`: the shared-memory half carries tensors on it (ring_medium.py); the ZeroMQ half
carries host bytes (device tensors are copied to the host at send) and moves what it receives to
it, so that every received tensor is on it whichever half brought it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from comm.messages import Message, MsgKey
from comm.transport.base import Transport, claim, make_inbox
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
        payload_device: str | torch.device | None = None,
        **shm_kwargs,
    ) -> None:
        self.endpoint, self.host = endpoint, host
        self.local = set(local) | {endpoint}
        self._inbox = make_inbox(endpoint, link_delay_s)
        self._shm = ShmTransport(
            endpoint, self.local, namespace=namespace, inbox=self._inbox, payload_device=payload_device, **shm_kwargs
        )
        self.payload_device = self._shm.payload_device
        self._claims = self.payload_device is not None and self.payload_device.type == "cuda"
        try:
            self._zmq = ZmqTransport(
                endpoint, addresses, inbox=self._inbox, keys=keys, payload_device=self.payload_device
            )
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
        return self.recv_any([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        msg = self._inbox.take(srcs, kind, key, timeout)
        return claim(msg) if self._claims else msg

    def close(self) -> None:
        self._shm.close()
        self._zmq.close()
