"""In-process transport: endpoints in one process (threads) exchange messages through inboxes.

The reference backend for unit tests: no serialization, same semantics as the real ones.
Tensors are cloned on send so that a sender reusing its buffers cannot corrupt a receiver.
"""

from __future__ import annotations

from collections.abc import Iterable

from comm.messages import CommError, Message, MsgKey
from comm.transport.base import Inbox, Transport


class InProcessFabric:
    """The shared medium: one inbox per endpoint."""

    def __init__(self) -> None:
        self.inboxes: dict[int, Inbox] = {}

    def endpoint(self, endpoint: int) -> InProcessTransport:
        self.inboxes.setdefault(endpoint, Inbox(endpoint))
        return InProcessTransport(self, endpoint)


class InProcessTransport(Transport):
    def __init__(self, fabric: InProcessFabric, endpoint: int) -> None:
        self.fabric, self.endpoint = fabric, endpoint
        self._inbox = fabric.inboxes[endpoint]

    def send(self, dst: int, msg: Message) -> None:
        inbox = self.fabric.inboxes.get(dst)
        if inbox is None:
            raise CommError(f"endpoint {self.endpoint}: no endpoint {dst} on this fabric")
        inbox.put(Message(msg.kind, msg.key, msg.src, [t.clone() for t in msg.tensors], dict(msg.meta)))

    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        return self.fabric.inboxes[self.endpoint].take([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        return self.fabric.inboxes[self.endpoint].take(srcs, kind, key, timeout)

    def close(self) -> None:
        self.fabric.inboxes[self.endpoint].fail(CommError("transport closed"))
