"""The transport interface every data-plane backend implements.

Endpoints have integer ids. `send` never blocks on the peer (the payload is handed to a
background sender or queue); receives wait at most `timeout` seconds and raise CommTimeout.
Per (source, kind) the channel is FIFO; `recv` checks that the head message carries the expected
key and raises KeyMismatchError otherwise. `recv_any` takes whichever of several sources'
messages arrives first, which is what lets a relay forward one sender's tokens without waiting
for the others.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable

from comm.messages import CommError, CommTimeout, Message, MsgKey, check_key


class Transport(ABC):
    endpoint: int

    @abstractmethod
    def send(self, dst: int, msg: Message) -> None:
        """Queues msg for endpoint dst; the caller must not modify msg.tensors afterwards."""

    @abstractmethod
    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        """The next `kind` message from src, which must carry `key`."""

    @abstractmethod
    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        """The first `kind` message to arrive from any of srcs; it must carry `key`."""

    def close(self) -> None:
        """Stops background work; pending receives fail."""


class Inbox:
    """Received messages demultiplexed into FIFO channels per (src, kind), with blocking waits.

    Transports with a background receiver put messages here; receivers take them out.
    """

    def __init__(self, endpoint: int) -> None:
        self.endpoint = endpoint
        self._channels: dict[tuple[int, str], deque[tuple[int, Message]]] = {}
        self._arrivals = itertools.count()  # lets recv_any pick the earliest of several ready sources
        self._cond = threading.Condition()
        self._error: Exception | None = None

    def put(self, msg: Message) -> None:
        with self._cond:
            self._channels.setdefault((msg.src, msg.kind), deque()).append((next(self._arrivals), msg))
            self._cond.notify_all()

    def pending(self, src: int, kind: str) -> int:
        """Messages from src of this kind received and not yet taken."""
        with self._cond:
            return len(self._channels.get((src, kind), ()))

    def fail(self, error: Exception) -> None:
        """Wakes every waiter with `error` (the transport closed or its receiver died)."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def take(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        srcs = list(srcs)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                heads = [c for c in (self._channels.get((src, kind)) for src in srcs) if c]
                if heads:
                    first = min(heads, key=lambda c: c[0][0])
                    check_key(first[0][1], key, kind)  # a mismatch stays queued: the error is fatal anyway
                    return first.popleft()[1]
                if self._error is not None:
                    raise CommError(f"endpoint {self.endpoint}: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(
                        f"endpoint {self.endpoint} waited {timeout:.1f} s for {kind} {key} from "
                        f"endpoint(s) {srcs} and nothing came: is the peer alive and at the same step?"
                    )
                self._cond.wait(left)


class DelayedInbox(Inbox):
    """An inbox whose messages become visible `delay_s` after arrival: an injected link latency
    for pipeline experiments. One delivery thread keeps arrival order (per-message timers would
    not)."""

    def __init__(self, endpoint: int, delay_s: float) -> None:
        super().__init__(endpoint)
        self.delay_s = delay_s
        self._due: deque[tuple[float, Message]] = deque()
        self._due_cond = threading.Condition()
        threading.Thread(target=self._deliver, daemon=True, name=f"link-delay-{endpoint}").start()

    def put(self, msg: Message) -> None:
        with self._due_cond:
            self._due.append((time.monotonic() + self.delay_s, msg))
            self._due_cond.notify()

    def _deliver(self) -> None:
        while True:
            with self._due_cond:
                while not self._due:
                    self._due_cond.wait()
                due, msg = self._due[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._due_cond.wait(wait)
                    continue
                self._due.popleft()
            super().put(msg)


def make_inbox(endpoint: int, delay_s: float = 0.0) -> Inbox:
    return DelayedInbox(endpoint, delay_s) if delay_s > 0 else Inbox(endpoint)
