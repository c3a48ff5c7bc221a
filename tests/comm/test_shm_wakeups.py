"""The shared-memory transport's wake-up bytes: written only while the reader may be asleep, and
never lost (a lost one would leave a receive waiting until its timeout)."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from comm.messages import Message, MsgKey
from comm.transport.shm_ring import ASLEEP
from comm.transport.shm_transport import ShmTransport, remove_namespace
from tests.comm import transport_worker as w
from tests.comm.test_transports import _SPAWN, _collect, _reap, _start


def _wake_bytes(reader: ShmTransport) -> int:
    """Wake-up bytes waiting in the FIFO of reader's one incoming ring (and clears them)."""
    _, wake = reader._readers[0]
    try:
        return len(os.read(wake.fd, 1 << 16))
    except BlockingIOError:
        return 0


def test_a_writer_wakes_the_reader_only_while_it_may_be_asleep(tmp_path):
    ns = uuid.uuid4().hex[:12]
    a, b = (ShmTransport(i, [0, 1], namespace=ns, directory=str(tmp_path)) for i in range(2))
    try:
        for i in range(3):  # nobody waits in b: no system call to wake anyone
            a.send(1, Message("x", MsgKey(i, 0, 0), 0))
        assert _wake_bytes(b) == 0
        assert [b.recv(0, "x", MsgKey(i, 0, 0), 1.0).key.step for i in range(3)] == [0, 1, 2]

        got = []
        waiter = threading.Thread(target=lambda: got.append(b.recv(0, "x", MsgKey(3, 0, 0), 10.0)))
        waiter.start()
        ring = b._readers[0][0].ring
        deadline = time.monotonic() + 5
        while not ring.flag(ASLEEP) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ring.flag(ASLEEP)  # b is about to block in poll(), or blocked
        start = time.monotonic()
        a.send(1, Message("x", MsgKey(3, 0, 0), 0, [torch.ones(2)]))
        waiter.join(5)
        assert got and torch.equal(got[0].tensors[0], torch.ones(2))
        assert time.monotonic() - start < 1.0  # woken, not left until its timeout
        assert not ring.flag(ASLEEP)
    finally:
        a.close(), b.close()


@pytest.mark.timeout(120)
def test_no_wake_up_is_lost_between_processes():
    """Round trips between two processes that sleep at once (no spinning): a wake-up lost to the
    race between a reader going to sleep and a writer deciding not to ring would stall one of
    them for the 20 s receive timeout."""
    ns, rounds = uuid.uuid4().hex[:12], 3000
    kwargs = {"peers": [0, 1], "namespace": ns, "spin_s": 0.0}
    results = _SPAWN.Queue()
    procs = [_start("echo", w.echo, results, "shm", kwargs, rounds)]
    t = ShmTransport(0, **kwargs)
    try:
        start = time.monotonic()
        for i in range(rounds):
            key = MsgKey(i, 0, 0)
            t.send(1, Message("ping", key, 0, [torch.full((4,), float(i))]))
            assert t.recv(1, "pong", key, w.WAIT).tensors[0][0].item() == i
        assert _collect(results, procs) == {"echo": {}}
        assert time.monotonic() - start < 60
    finally:
        t.close()
        _reap(procs)
        remove_namespace(ns)
