"""Hostile bytes on a rank's ZeroMQ data-plane port (issue: nobody gets in uninvited): garbage,
truncated headers, headers that claim huge or wrong-sized tensors, too many or too few frames and
oversized frames are dropped and counted, the receiver goes on, and the real messages around them
arrive exact and in order. Nothing a header claims is allocated before it is checked."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import torch
import zmq

from comm.messages import MalformedMessage, Message, MsgKey
from comm.transport.zmq_transport import ZmqTransport, free_tcp_addresses


def makers(rng: random.Random) -> list:
    """Makers of multipart messages that are not messages of the protocol, one per kind a stray or
    hostile peer could send."""
    real = Message("dispatch", MsgKey(1, 2, 0), 7, [torch.arange(6, dtype=torch.float32)]).encode()
    header = bytes(real[0])
    return [
        lambda: [rng.randbytes(rng.randrange(0, 64))],  # random bytes
        lambda: [header[: rng.randrange(1, len(header))], bytes(real[1])],  # a truncated header
        lambda: [msgpack.packb(["dispatch", 1, 2, 0, 7, {}, [["float32", [2**40, 2**20]]]]), b"x"],  # huge claim
        lambda: [msgpack.packb(["dispatch", 1, 2, 0, 7, {}, [["float32", [7]]]]), bytes(real[1])],  # wrong size
        lambda: [header],  # the tensor frame missing
        lambda: [header, bytes(real[1]), b"extra"],  # one frame too many
        lambda: [msgpack.packb(["dispatch", 1, 2, 0, 7, {}, [["complex128", [1]]]]), b"\0" * 16],  # no such dtype
        lambda: [msgpack.packb(["dispatch", "1", 2, 0, 7, {}, []])],  # a key of the wrong type
        lambda: [msgpack.packb(["dispatch", 1, 2, 0, 7, {}, [["float32", [-1]]]]), b""],  # a negative size
        lambda: [msgpack.packb({"not": "an array"})],
        lambda: [msgpack.packb(["dispatch", 1, 2, 0, 7, {}, [["float32", [1] * 9]]]), b"\0" * 4],  # 9 dims
    ]


def hostile_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    kinds = makers(rng)
    return [rng.choice(kinds)() for _ in range(n)]


@pytest.mark.parametrize("kind", range(11))
def test_each_kind_of_hostile_message_is_refused_before_any_allocation(kind):
    rng = random.Random(kind)
    make = makers(rng)[kind]
    for _ in range(50):
        with pytest.raises(MalformedMessage):
            Message.decode(make())


def test_a_flood_of_hostile_frames_is_dropped_while_real_messages_arrive_exact():
    addrs = dict(enumerate(free_tcp_addresses(2)))
    receiver, sender = ZmqTransport(0, addrs, max_frame_bytes=1 << 20), ZmqTransport(1, addrs)
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 1000)
    stranger.connect(addrs[0])
    try:
        rng = random.Random(0)
        sent = []
        for i, frames in enumerate(hostile_frames(rng, 1000)):
            stranger.send_multipart(frames)
            if i % 100 == 0:  # the deployment's own messages keep flowing meanwhile
                tensor = torch.randn(3, 5)
                sender.send(0, Message("dispatch", MsgKey(i, 0, 0), 1, [tensor]))
                sent.append((i, tensor))
        stranger.send_multipart([b"\0" * (2 << 20)])  # over max_frame_bytes: ZeroMQ disconnects the peer
        for i, tensor in sent:
            got = receiver.recv(1, "dispatch", MsgKey(i, 0, 0), timeout=10)
            assert torch.equal(got.tensors[0], tensor)
        deadline = time.monotonic() + 10
        while receiver.dropped < 1000 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.dropped == 1000  # every hostile message counted once; the oversized one never read
        later = torch.arange(4.0)
        sender.send(0, Message("combine", MsgKey(9, 9, 9), 1, [later]))
        assert torch.equal(receiver.recv(1, "combine", MsgKey(9, 9, 9), timeout=10).tensors[0], later)
    finally:
        stranger.close()
        ctx.term()
        receiver.close()
        sender.close()
