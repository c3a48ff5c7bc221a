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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from comm.messages import CommError, CommTimeout, Message, MsgKey, check_key


class Transport(ABC):
    endpoint: int
    # Where received tensors live. None: on the CPU (but a message to itself keeps its tensors'
    # devices). A device: every received tensor is on it, messages to itself included. Either
    # way `send` takes tensors on any device. Set by a transport that receives onto a device:
    # shared memory with a payload medium (ShmTransport(payload_device=...)), torch.distributed.
    payload_device: torch.device | None = None

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

    @property
    def inbox(self) -> Inbox:
        """Where this endpoint's received messages wait (every transport here files them in one)."""
        return self._inbox

    def pending(self, src: int, kind: str) -> int:
        """Messages from src of this kind received and not yet taken (what has reached the inbox)."""
        return self.inbox.pending(src, kind)

    def readmit(self, peer: int, address: str, host: str, incarnation: int) -> None:
        """Talks to a new process in place of `peer` (a replacement of a lost rank): at `address`
        (ZeroMQ) or over fresh shared-memory rings where `host` is this one's; `incarnation`
        (1 for the first replacement) names the rings, so that both ends open the same new ones.
        What the lost process sent and nobody took is dropped."""
        raise CommError(f"endpoint {self.endpoint}: {type(self).__name__} cannot take a replacement peer")

    def drop_stale(self, floors: dict[str, int]) -> None:
        """From now on, a `kind` message whose key's step is below floors[kind] is dropped when it
        reaches the head of its channel instead of being received (an aborted step's messages,
        after its peers agreed to run it again under a new step id)."""
        self.inbox.drop_stale(floors)


class Inbox:
    """Received messages demultiplexed into FIFO channels per (src, kind), with blocking waits.

    Transports with a background receiver put messages here; receivers take them out. A transport
    without one passes `pump` to `take`: a waiting thread then fetches messages itself instead of
    sleeping (one thread at a time; the others sleep until it has put something or given up the
    role), which saves the hand-over from a receiver thread on every message. `put` says when the
    pumping thread waits for the message put (sent by the process to itself): the transport must
    then wake it, as it may be blocked in its wait for data.

    A message wakes only the threads waiting on its channel (an FFN rank has three threads waiting
    on different channels: waking all of them for every message costs more than the message).
    """

    def __init__(self, endpoint: int) -> None:
        self.endpoint = endpoint
        self._channels: dict[tuple[int, str], deque[tuple[int, Message]]] = {}
        self._arrivals = itertools.count()  # lets recv_any pick the earliest of several ready sources
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []
        self._error: Exception | None = None
        self._pumping: set[tuple[int, str]] | None = None  # the channels of the taker inside `pump`
        self._floors: dict[str, int] = {}  # kind -> lowest step still received (drop_stale)

    def put(self, msg: Message) -> bool:
        """Files msg; True when the thread inside `pump` waits for it (to be woken by the transport)."""
        channel = (msg.src, msg.kind)
        with self._lock:
            self._channels.setdefault(channel, deque()).append((next(self._arrivals), msg))
            for waiter in self._waiters:
                if channel in waiter.channels:
                    waiter.cond.notify()
            return self._pumping is not None and channel in self._pumping

    def pending(self, src: int, kind: str) -> int:
        """Messages from src of this kind received and not yet taken."""
        with self._lock:
            channel = self._channels.get((src, kind))
            if channel:
                self._drop_stale_heads(channel, kind)
            return len(channel or ())

    def pop(self, src: int, kind: str) -> Message | None:
        """The head of src's `kind` channel whatever its key (None when empty): a receiver that
        keys a kind loosely takes an unexpected message out of the way with it."""
        with self._lock:
            channel = self._channels.get((src, kind))
            return channel.popleft()[1] if channel else None

    def forget(self, src: int) -> None:
        """Drops every message of src not taken yet (a lost process's)."""
        with self._lock:
            for channel in [c for c in self._channels if c[0] == src]:
                del self._channels[channel]

    def drop_stale(self, floors: dict[str, int]) -> None:
        """See Transport.drop_stale; floors only rise."""
        with self._lock:
            for kind, step in floors.items():
                self._floors[kind] = max(step, self._floors.get(kind, step))

    def _drop_stale_heads(self, channel: deque, kind: str) -> None:
        floor = self._floors.get(kind)
        while floor is not None and channel and channel[0][1].key.step < floor:
            channel.popleft()

    def fail(self, error: Exception) -> None:
        """Wakes every waiter with `error` (the transport closed or its receiver died)."""
        with self._lock:
            self._error = error
            for waiter in self._waiters:
                waiter.cond.notify()

    def take(
        self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float, pump: Callable[[float], None] | None = None
    ) -> Message:
        """The earliest ready `kind` message of srcs, waiting at most `timeout` s. `pump(seconds)`, when
        given, waits up to that long for incoming data and puts what came; it runs without the lock."""
        srcs = list(srcs)
        deadline = time.monotonic() + timeout
        waiter = None
        pumped = False  # a zero timeout still fetches what has arrived, once
        with self._lock:
            try:
                while True:
                    heads = [c for c in (self._channels.get((src, kind)) for src in srcs) if c]
                    if self._floors:
                        for c in heads:
                            self._drop_stale_heads(c, kind)
                        heads = [c for c in heads if c]
                    if heads:
                        first = min(heads, key=lambda c: c[0][0])
                        check_key(first[0][1], key, kind)  # a mismatch stays queued: the error is fatal anyway
                        return first.popleft()[1]
                    if self._error is not None:
                        raise CommError(f"endpoint {self.endpoint}: {self._error}")
                    left = deadline - time.monotonic()
                    if left <= 0 and (pumped or pump is None or self._pumping is not None):
                        raise CommTimeout(
                            f"endpoint {self.endpoint} waited {timeout:.1f} s for {kind} {key} from "
                            f"endpoint(s) {srcs} and nothing came: is the peer alive and at the same step?"
                        )
                    channels = {(src, kind) for src in srcs}
                    if pump is not None and self._pumping is None:
                        self._pump(pump, max(left, 0.0), channels)
                        pumped = True
                    else:
                        if waiter is None:
                            waiter = _Waiter(threading.Condition(self._lock), channels, pump is not None)
                            self._waiters.append(waiter)
                        waiter.cond.wait(left)
            finally:
                if waiter is not None:
                    self._waiters.remove(waiter)
                if pump is not None and self._pumping is None:  # nobody pumps now: a waiting thread takes over
                    for w in self._waiters:
                        if w.pumps:
                            w.cond.notify()
                            break

    def _pump(self, pump: Callable[[float], None], seconds: float, channels: set[tuple[int, str]]) -> None:
        """Runs pump(seconds) unlocked as the one pumping thread (take then hands the role on)."""
        self._pumping = channels
        self._lock.release()
        try:
            pump(seconds)
        finally:
            self._lock.acquire()
            self._pumping = None


@dataclass
class _Waiter:
    """A thread blocked in take: woken by messages on its channels, errors, or to pump."""

    cond: threading.Condition
    channels: set[tuple[int, str]]
    pumps: bool  # it would pump if nobody did


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

    def put(self, msg: Message) -> bool:
        with self._due_cond:
            self._due.append((time.monotonic() + self.delay_s, msg))
            self._due_cond.notify()
        return False  # never pumped (the transport runs a receiver thread)

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


def to_payload_device(msg: Message, device: torch.device | None, stream=None) -> Message:
    """Moves the tensors of a message received as host bytes to `device` (in place; None: leaves
    them). On a GPU the copies run on `stream` (the receiving thread's own, so that they do not
    queue behind compute) and are complete on return; `claim` then hands them to the consumer."""
    if device is None or device.type == "cpu":
        return msg
    with torch.cuda.stream(stream):  # None: the current stream
        msg.tensors = [t.to(device) for t in msg.tensors]
    (stream or torch.cuda.current_stream(device)).synchronize()
    return msg


def own_copy(msg: Message, device: torch.device | None) -> Message:
    """The message a transport puts in its own inbox for msg sent to itself: tensors cloned (onto
    `device` where given). On a GPU the clones are queued on the sender's current stream, and an
    event after them goes with the message: `claim` makes the consumer's stream wait for it."""
    if device is None:
        return Message(msg.kind, msg.key, msg.src, [t.clone() for t in msg.tensors], dict(msg.meta))
    tensors = [t.to(device, copy=True) for t in msg.tensors]
    own = Message(msg.kind, msg.key, msg.src, tensors, dict(msg.meta))
    if device.type == "cuda":  # the copies end on device's current stream (a copy between GPUs waits for both)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        own.ready = [(device, event)]  # not a field of Message: the receiving side's business only
    return own


def claim(msg: Message) -> Message:
    """Hands a received message's CUDA tensors to the calling thread: its current stream waits for
    a message to itself (`own_copy`), and each tensor is marked used on that stream, so that the
    allocator does not give its memory to the stream that made it (a transport's own) before the
    consumer's work is done."""
    for dev, event in getattr(msg, "ready", ()):
        torch.cuda.current_stream(dev).wait_event(event)
    for t in msg.tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    return msg


def payload_device_of(device: str | torch.device | None) -> torch.device | None:
    """device as the transport stores it: None, cpu, or cuda with its index (the current device's
    where none is given)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise CommError(f"payload_device {device}: use None, cpu or a CUDA device")
    return device
