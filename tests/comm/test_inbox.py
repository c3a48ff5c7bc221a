"""The inbox every transport delivers into: FIFO per channel, earliest arrival first, key checks."""

from __future__ import annotations

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
