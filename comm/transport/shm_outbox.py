"""What one shared-memory endpoint sends to one peer: the ring, its medium, its wake-up FIFO, and
what waits for room (shm_transport.py).

`send` never blocks on the peer: a frame goes straight into the ring when it has room and nothing
waits before it (the common case); else it waits here, and a flusher thread feeds it in as the
reader makes room. What waits is, per message, either the frame's bytes as parts (written in as
many turns as they take: a message longer than the ring goes through it in pieces), or, with a
payload medium (ring_medium.py), the message itself, written whole once both the host ring and
the payload area have room for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from comm.messages import CommError, Message
from comm.transport.ring_medium import HostMedium, Waiting
from comm.transport.shm_ring import ATTACHED, CLOSED
from comm.transport.shm_wake import WakeFifo

_FLUSH_PAUSE = (20e-6, 1e-3)  # a flusher waiting for room polls, backing off from the first to the second


class Outbox:
    """The sending end of the ring to `dst`; `medium` holds the opened ring."""

    def __init__(self, medium: HostMedium, wake: WakeFifo, dst: int, max_pending_bytes: int) -> None:
        self.medium, self.ring, self.wake = medium, medium.ring, wake
        self.dst, self.max_pending_bytes = dst, max_pending_bytes
        self.lock = threading.Lock()  # one writer at a time; FIFO order of whole messages
        self.pending: deque[deque[memoryview] | Waiting] = deque()  # per message, in order
        self.pending_bytes = 0
        self.flusher: threading.Thread | None = None
        self.stopped = False

    def send(self, msg: Message) -> None:
        with self.lock:
            if self.stopped:
                raise CommError(f"send to endpoint {self.dst} after close()")
            if self.ring.flag(CLOSED):  # the peer has closed: dropped, as a closed socket's would be
                return
            # Straight into the ring when it has room and nothing waits before it (the common case);
            # else bytes are written as far as they fit now, and the rest waits.
            if self.pending or not self.medium.write_frame(msg):
                item = self.medium.waiting(msg)
                if isinstance(item, Waiting):
                    self._queue(item, item.size)
                else:
                    if not self.pending:
                        self.ring.write(item)
                    if item:
                        self._queue(item, sum(len(p) for p in item))
        self.wake.signal_if_asleep(self.ring)

    def _queue(self, item: deque[memoryview] | Waiting, size: int) -> None:
        if self.pending_bytes + size > self.max_pending_bytes:
            raise CommError(
                f"{self.pending_bytes} bytes already wait for endpoint {self.dst} ({self.ring.path}): "
                "the peer is down or not keeping up"
            )
        self.pending.append(item)
        self.pending_bytes += size
        if self.flusher is None:
            self.flusher = threading.Thread(target=self._flush, name=f"shm-flush-{self.dst}", daemon=True)
            self.flusher.start()

    def _feed(self) -> int:
        """Writes what waits, in order, as far as there is room (call with the lock held); returns
        the bytes of it written."""
        written = 0
        while self.pending:
            item = self.pending[0]
            if isinstance(item, Waiting):
                if not self.medium.write_waiting(item):
                    break
                n = item.size
            else:
                n = self.ring.write(item)
            written += n
            self.pending_bytes -= n
            if not isinstance(item, Waiting) and item:  # written in part: the ring is full
                break
            self.pending.popleft()
        return written

    def _flush(self) -> None:
        """Feeds what waits into the ring as the reader frees room (polling, backing off)."""
        pause = _FLUSH_PAUSE[0]
        while True:
            with self.lock:
                if self.stopped or not self.pending or self.ring.flag(CLOSED):
                    self.pending.clear()
                    self.pending_bytes, self.flusher = 0, None
                    return
                written = self._feed()
            if written:
                self.wake.signal_if_asleep(self.ring)
                pause = _FLUSH_PAUSE[0]
            else:
                time.sleep(pause)
                pause = min(2 * pause, _FLUSH_PAUSE[1])

    def close(self, linger_s: float) -> None:
        """Waits up to linger_s for what waits to go, then drops the rest and unmaps; removes the
        names of the ring and its FIFO if its reader never opened them (they are this pair's
        alone). Idempotent."""
        flusher = self.flusher
        if flusher is not None:
            flusher.join(linger_s)
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        if flusher is not None:
            flusher.join()
        never_read = not self.ring.flag(ATTACHED)
        self.medium.close()
        self.wake.close()
        if never_read:  # the peer never started: the pair's files are this endpoint's to remove
            self.ring.unlink()
            self.wake.unlink()
