"""The shared-memory ring's payload media (ring_medium.py) through the host twin, which runs the ring
logic of the CUDA medium on a CPU tensor over host shared memory: frames whose tensors live in a
payload area, its reuse, the fallback of frames larger than the area, the checks on what a frame
claims, and `payload_device` through the transports and the factory."""

from __future__ import annotations

import uuid

import pytest
import torch

from comm.messages import CommError, MalformedMessage, Message, MsgKey
from comm.transport.factory import make_transport, peer_transport
from comm.transport.hybrid import HybridTransport
from comm.transport.ring_medium import PAYLOAD_FRAME, HostMedium, HostTensorMedium
from comm.transport.shm_ring import PTAIL, FrameReader
from comm.transport.shm_transport import ShmTransport
from comm.transport.zmq_transport import ZmqTransport, free_tcp_addresses
from tests.comm import transport_worker as w
from tests.comm.test_transports import _assert_same

K = MsgKey(0, 0, 0)


def _pair(tmp_path, area: int, ring: int = 4096):
    """A writer's medium and a reader over one ring with a payload area of `area` bytes."""
    out = HostTensorMedium(area)
    out.open(str(tmp_path / "r"), ring)
    into = HostTensorMedium(1 << 20)  # the reader takes the area's size from the file, not from this
    return out, FrameReader(into.open(str(tmp_path / "r"), 0), into)


def _odd() -> list[torch.Tensor]:
    """Tensors that are not a plain contiguous block: strided, 0-dim, bool, requiring grad."""
    return [
        torch.arange(12.0).view(3, 4).t(),
        torch.tensor(2.5),
        torch.tensor([True, False, True]),
        torch.ones(5, requires_grad=True),
    ]


def test_payload_frames_round_trip_exactly_and_reuse_the_area_across_its_end(tmp_path):
    out, reader = _pair(tmp_path, area=4096)
    tensors = w.sample_tensors()[:-1] + _odd()  # every dtype, empty ones included; ~600 bytes of values
    for i in range(60):  # ~7 spans per turn of the area: they start over at its end again and again
        assert out.write_frame(Message("x", MsgKey(i, 1, 2), 3, tensors, {"i": i}))
        (got,) = reader.read()
        assert (got.kind, got.key, got.src, got.meta) == ("x", MsgKey(i, 1, 2), 3, {"i": i})
        _assert_same(w.wire(got.tensors), [t.detach() for t in tensors])
        assert reader.ring.load(PTAIL) == out._phead  # read, and its span given back
    assert out._phead > 8 * 4096 and out.inline == 0
    assert reader.ring.capacity == 4096 and reader.medium.area.numel() == 4096  # from the file


def test_the_host_ring_carries_only_headers_and_spans(tmp_path):
    out, reader = _pair(tmp_path, area=1 << 20, ring=512)
    big = torch.randn(100_000)  # 400 KB of values through a 512-byte host ring, in one turn
    assert out.write_frame(Message("x", K, 0, [big, torch.zeros(3, dtype=torch.bfloat16)]))
    assert reader.ring.readable() < 200
    got = reader.read()[0].tensors
    assert torch.equal(got[0], big) and torch.equal(got[1], torch.zeros(3, dtype=torch.bfloat16))


def test_received_tensors_are_the_receivers_own(tmp_path):
    """A received tensor is a copy: the writer reusing the span does not change it."""
    out, reader = _pair(tmp_path, area=256)
    out.write_frame(Message("x", K, 0, [torch.full((16,), 1.0)]))
    first = reader.read()[0].tensors[0]
    for i in range(8):  # the same span is written again and again
        out.write_frame(Message("x", K, 0, [torch.full((16,), float(i + 2))]))
        assert reader.read()[0].tensors[0][0].item() == i + 2
    assert torch.equal(first, torch.full((16,), 1.0))


def test_a_writer_waits_for_room_in_the_area_and_publishes_nothing_meanwhile(tmp_path):
    out, reader = _pair(tmp_path, area=1024)
    assert out.write_frame(Message("a", K, 0, [torch.zeros(150)]))  # 600 of 1024 bytes
    published = reader.ring.readable()
    assert not out.write_frame(Message("b", K, 0, [torch.ones(150)]))  # 640 more do not fit
    assert reader.ring.readable() == published
    assert [m.kind for m in reader.read()] == ["a"]
    assert out.write_frame(Message("b", K, 0, [torch.ones(150)]))  # the reader gave the span back
    assert torch.equal(reader.read()[0].tensors[0], torch.ones(150))


def test_a_frame_larger_than_the_area_goes_as_bytes_and_arrives_whole(tmp_path):
    out, reader = _pair(tmp_path, area=1024, ring=1 << 20)
    big = [torch.randn(1000).bfloat16(), torch.arange(7)]  # 2,000 bytes of values: more than the area
    assert out.write_frame(Message("big", K, 0, big))
    assert out.inline == 1 and out._phead == 0  # the area was not used
    _assert_same(w.wire(reader.read()[0].tensors), big)


def test_frames_claiming_more_than_their_span_or_the_area_are_refused(tmp_path):
    _, reader = _pair(tmp_path, area=1024)
    header = Message("x", K, 0, [torch.zeros(100)]).header()  # 400 bytes of values

    def frame(start: int, end: int) -> memoryview:
        body = (len(header) | PAYLOAD_FRAME).to_bytes(4, "little") + header
        return memoryview(body + start.to_bytes(8, "little") + end.to_bytes(8, "little"))

    decode = reader.medium.decode
    with pytest.raises(MalformedMessage, match="overrun its payload span of 320 bytes"):
        decode(frame(0, 320))
    with pytest.raises(MalformedMessage, match=r"span \[896, 1344\) does not fit an area of 1024 bytes"):
        decode(frame(896, 1344))
    assert torch.equal(decode(frame(0, 448)).tensors[0], torch.zeros(100))


def test_both_ends_of_a_ring_must_expect_the_same_medium(tmp_path):
    HostTensorMedium(4096).open(str(tmp_path / "r"), 4096)
    with pytest.raises(CommError, match="carries payloads in medium 1, this endpoint expects medium 0"):
        HostMedium().open(str(tmp_path / "r"), 4096)
    with pytest.raises(CommError, match="payload area needs at least 64 bytes"):
        HostTensorMedium(10)


# -- payload_device through the transports ------------------------------------------------


def test_the_transport_says_where_received_tensors_live(tmp_path):
    ns, kw = uuid.uuid4().hex[:12], {"directory": str(tmp_path), "capacity": 4096}
    plain = ShmTransport(0, [0], namespace=ns, **kw)
    a, b = (ShmTransport(i, [1, 2], namespace=ns, payload_device="cpu", payload_capacity=1 << 16, **kw) for i in (1, 2))
    try:
        assert plain.payload_device is None and a.payload_device == torch.device("cpu")
        sent = torch.arange(6.0)
        a.send(2, Message("x", K, 1, [sent, torch.ones(2, dtype=torch.bfloat16)]))
        a.send(1, Message("own", K, 1, [sent]))
        got, own = b.recv(1, "x", K, 5), a.recv(1, "own", K, 5)
        assert [t.device.type for t in got.tensors] == ["cpu", "cpu"] and torch.equal(got.tensors[0], sent)
        assert torch.equal(own.tensors[0], sent) and own.tensors[0].data_ptr() != sent.data_ptr()  # cloned
        assert a._outboxes[2].medium.inline == 0 and b._readers[0][0].medium.area.numel() == 1 << 16
    finally:
        plain.close(), a.close(), b.close()
    with pytest.raises(CommError, match="payload_device meta: use None, cpu or a CUDA device"):
        ShmTransport(3, [3], namespace=ns, payload_device="meta", **kw)


def test_the_factory_threads_payload_device_through_shared_memory_and_hybrid():
    ns, addrs = uuid.uuid4().hex[:12], dict(enumerate(free_tcp_addresses(3)))
    shm = make_transport("shm", 0, peers=[0], namespace=ns, payload_device="cpu", payload_capacity=4096)
    alone = peer_transport(1, {}, {1: "h"}, ns, payload_device="cpu", payload_capacity=4096)
    hosts = {0: "h", 1: "h", 2: ""}
    hybrid = peer_transport(0, addrs, hosts, ns + "h", payload_device="cpu", payload_capacity=4096)
    far = peer_transport(2, addrs, hosts, ns + "h", payload_device="cpu")  # no shared memory: ZeroMQ only
    try:
        assert isinstance(hybrid, HybridTransport) and isinstance(alone, ShmTransport)
        assert isinstance(far, ZmqTransport)
        assert {t.payload_device for t in (shm, alone, hybrid, far)} == {torch.device("cpu")}
        assert hybrid._shm._outboxes[1].medium.area.numel() == 4096
        assert hybrid._zmq.payload_device == torch.device("cpu")  # what it receives is moved there
        far.send(0, Message("x", K, 2, [torch.arange(3)]))  # over ZeroMQ into the hybrid
        assert torch.equal(hybrid.recv(2, "x", K, 5).tensors[0], torch.arange(3))
    finally:
        for t in (shm, alone, hybrid, far):
            t.close()
