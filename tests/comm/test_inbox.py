"""The inbox every transport delivers into: FIFO per channel, earliest arrival first, key checks,
and the pumping protocol of transports without a receiver thread."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from comm.messages import KeyMismatchError, Message, MsgKey
from comm.transport.base import Inbox

K = MsgKey(1, 2, 0)


def test_recv_any_takes_the_earliest_arrival_among_ready_sources():
    inbox = Inbox(9)
    for src in (3, 1, 2):
        inbox.put(Message("dispatch", K, src, [torch.tensor([src])]))
    assert [inbox.take([1, 2, 3], "dispatch", K, 1).src for _ in range(3)] == [3, 1, 2]


def test_mismatch_raises_and_keeps_the_message():
    inbox = Inbox(0)
    inbox.put(Message("combine", MsgKey(1, 2, 1), 4))
    with pytest.raises(KeyMismatchError, match=r"expected combine \(step 1, layer 2, micro-batch 0\) from endpoint 4"):
        inbox.take([4], "combine", K, 1)
    assert inbox.pending(4, "combine") == 1
    assert inbox.take([4], "combine", MsgKey(1, 2, 1), 1).src == 4


def test_channels_are_fifo_per_source_and_kind():
    inbox = Inbox(0)
    for mb in range(3):
        inbox.put(Message("forward", MsgKey(0, 0, mb), 5))
    assert [inbox.take([5], "forward", MsgKey(0, 0, mb), 1).key.micro_batch for mb in range(3)] == [0, 1, 2]


# -- takers that pump (transports without a receiver thread) -------------------------------


def test_one_taker_pumps_and_hands_the_role_on_when_it_leaves():
    """The pump puts what "arrives" (here: what the test queues); while one thread pumps, another
    waits without pumping, and takes the role over once the first has its message."""
    inbox, arrivals, pumpers = Inbox(0), queue.Queue(), []

    def pump(seconds: float) -> None:
        pumpers.append(threading.current_thread().name)
        try:
            inbox.put(arrivals.get(timeout=seconds))
        except queue.Empty:
            pass

    got = {}

    def take(kind: str) -> None:
        got[kind] = inbox.take([1], kind, K, 30, pump).kind

    first = threading.Thread(target=take, args=("a",), name="first")
    first.start()
    time.sleep(0.1)  # "first" is pumping now
    second = threading.Thread(target=take, args=("b",), name="second")
    second.start()
    time.sleep(0.1)
    assert pumpers == ["first"]  # the second one waits
    arrivals.put(Message("a", K, 1))
    first.join(5)
    time.sleep(0.1)
    start = time.monotonic()
    arrivals.put(Message("b", K, 1))
    second.join(5)
    assert got == {"a": "a", "b": "b"} and pumpers[-1] == "second"
    assert time.monotonic() - start < 1.0  # pumped at once, not after waiting for its timeout


def test_put_says_whether_the_pumping_taker_waits_for_it():
    inbox, entered, release = Inbox(0), threading.Event(), threading.Event()

    def pump(seconds: float) -> None:
        entered.set()
        release.wait(5)

    taker = threading.Thread(target=lambda: inbox.take([0], "own", K, 5, pump))
    taker.start()
    assert entered.wait(5)
    assert inbox.put(Message("other", K, 0)) is False  # nobody pumps for it: no wake-up needed
    assert inbox.put(Message("own", K, 0)) is True  # the transport must wake the pumping thread
    release.set()
    taker.join(5)
    assert not taker.is_alive()


def test_messages_of_a_step_given_up_are_dropped_below_the_floor():
    """After an aborted step runs again under a new id, its old messages never reach a receiver
    (they would read as out of step): what is below the floor of its kind is dropped."""
    inbox = Inbox(0)
    for step in (3, 4, 7):
        inbox.put(Message("combine", MsgKey(step, 2, 0), 4))
    inbox.put(Message("sync", MsgKey(1, -2, 0), 4))
    inbox.drop_stale({"combine": 7})
    inbox.drop_stale({"combine": 5})  # floors only rise
    assert inbox.pending(4, "combine") == 1
    assert inbox.take([4], "combine", MsgKey(7, 2, 0), 1).key.step == 7
    inbox.put(Message("combine", MsgKey(6, 2, 0), 4))  # a late one of the old step
    inbox.put(Message("combine", MsgKey(8, 2, 0), 4))
    assert inbox.take([4], "combine", MsgKey(8, 2, 0), 1).key.step == 8
    assert inbox.take([4], "sync", MsgKey(1, -2, 0), 1).key.step == 1  # other kinds untouched


def test_pop_takes_the_head_whatever_its_key():
    inbox = Inbox(0)
    assert inbox.pop(4, "heartbeat") is None
    inbox.put(Message("heartbeat", MsgKey(9, -5, 0), 4))
    inbox.put(Message("heartbeat", MsgKey(0, -5, 0), 4))
    assert inbox.pop(4, "heartbeat").key.step == 9
    assert inbox.take([4], "heartbeat", MsgKey(0, -5, 0), 1).key.step == 0
