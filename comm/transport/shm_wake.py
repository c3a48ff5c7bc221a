"""The wake-up FIFO of a shared-memory ring (shm_ring.py) and what a reader waits on.

One ring carries one direction between two endpoints, and has its own wake-up FIFO (its path plus
".wake"), shared by the same two processes and no other, so that the files of a pair can be
removed by either of its ends without touching what other endpoints use.

The wake-up byte costs a system call (and, on a virtual machine, often an interrupt to another
vCPU), so a writer writes it only when the reader may be asleep. That is a store on each side
followed by a load of the other's store (reader: asleep = 1, then head; writer: head, then
asleep), which x86-64 may reorder: both sides put a full barrier between the two (`full_fence`),
so at least one of them sees the other's store and no wake-up is lost.
"""

from __future__ import annotations

import os
import select
import threading
import time

from comm.transport.shm_ring import ASLEEP, Ring, _unlink

_FENCE = threading.Lock()


def full_fence() -> None:
    """A full memory barrier: no load after it is done before a store ahead of it is seen by the
    other cores. CPython's lock takes and gives back with atomic read-modify-write instructions
    (LOCK-prefixed on x86-64), which are full barriers there."""
    _FENCE.acquire()
    _FENCE.release()


class WakeFifo:
    """The wake-up FIFO of one ring: its writer writes a byte per message, its reader waits (in
    `Doorbells`) for any byte. Opened read-write by both ends: opening never waits for the other
    end, and the reader never sees end-of-file while no writer is connected. Made atomically and
    named only until both ends have opened it, as the ring (whichever end comes second removes
    the name)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd, created = _open_or_create_fifo(path)
        if not created:
            _unlink(path)

    def signal(self) -> None:
        _ring_bell(self.fd)

    def signal_if_asleep(self, ring: Ring) -> None:
        """After bytes were published to `ring`: wakes its reader if it may be blocked in poll()."""
        full_fence()
        if ring.flag(ASLEEP):
            _ring_bell(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        """Removes the name if it is still there (the other end never opened the FIFO)."""
        _unlink(self.path)


class Doorbells:
    """What a reader waits on: the wake-up FIFOs of its incoming rings and a pipe of its own
    (`ring`: a message it sent itself, or close). `wait` returns once any of them has a byte (or
    after `seconds`) and clears the ones that had."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._own_r, self._own_w = os.pipe()
        for fd in (self._own_r, self._own_w):
            os.set_blocking(fd, False)
        self._poll.register(self._own_r, select.POLLIN)

    def add(self, fifo: WakeFifo) -> None:
        self._poll.register(fifo.fd, select.POLLIN)

    def remove(self, fifo: WakeFifo) -> None:
        self._poll.unregister(fifo.fd)

    def ring(self) -> None:
        _ring_bell(self._own_w)

    def wait(self, seconds: float) -> None:
        for fd, _ in self._poll.poll(seconds * 1000):
            try:
                while len(os.read(fd, 65536)) == 65536:  # every byte waiting, however many
                    pass
            except BlockingIOError:  # none left: cleared
                pass

    def close(self) -> None:
        for fd in (self._own_r, self._own_w):
            if fd >= 0:
                os.close(fd)
        self._own_r = self._own_w = -1


def _ring_bell(fd: int) -> None:
    if fd < 0:  # closed: nobody waits any more
        return
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # 64 KiB of unread wake-ups: the reader is woken already
        pass


def _open_or_create_fifo(path: str) -> tuple[int, bool]:
    """A read-write, non-blocking descriptor of the FIFO at path, made if missing (under a temporary
    name, then linked into place: the other end never opens a name that is about to vanish); and
    whether this call made it."""
    flags = os.O_RDWR | os.O_NONBLOCK
    try:
        return os.open(path, flags), False
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}"
    os.mkfifo(tmp, 0o600)
    try:
        fd = os.open(tmp, flags)
        try:
            os.link(tmp, path)
        except FileExistsError:  # the other end made it first: use theirs
            os.close(fd)
            return os.open(path, flags), False
    finally:
        _unlink(tmp)
    return fd, True
