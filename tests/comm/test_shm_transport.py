"""The shared-memory transport: the ring and its framing, the transport's semantics in one process
and between real OS processes, the hybrid transport and the choice between them.

Every test uses its own namespace in its own directory (a pytest tmp dir, or /dev/shm for the
cross-process runs) and checks that closing leaves no file behind.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import deque

import pytest
import torch

from comm.messages import CommError, CommTimeout, KeyMismatchError, Message, MsgKey
from comm.transport.factory import make_transport, peer_transport
from comm.transport.hybrid import HybridTransport
from comm.transport.shm_ring import FrameReader, Ring, encode_frame
from comm.transport.shm_transport import SHM_DIR, ShmTransport, fits, remove_namespace
from comm.transport.zmq_transport import ZmqTransport, free_tcp_addresses
from tests.comm import transport_worker as w
from tests.comm.test_transports import (
    _assert_key_mismatch,
    _assert_race,
    _assert_same,
    _assert_timeout,
    assert_close_fails_a_blocked_recv_and_refuses_sends,
    run_scenario,
)

pytestmark = pytest.mark.timeout(60)
K = MsgKey(0, 0, 0)


def _files(directory, namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f"afd-{namespace}-"))


# the host twin of the device path (ring_medium.py): tensors in a 1 MiB payload area per ring
TWIN = {"payload_device": "cpu", "payload_capacity": 1 << 20}


@pytest.fixture(params=[(True, {}), (False, {}), (True, TWIN)], ids=["waiter-reads", "receiver-thread", "payload-twin"])
def pair(tmp_path, request):
    """Endpoints 0 and 1 (rings of 64 KiB) in this process, with the waiting thread reading the
    rings (the default) or a receiver thread, and the tensors in the frames (the default) or in the
    host twin's payload areas; fails if closing leaves files."""
    ns = uuid.uuid4().hex[:12]
    made = []
    pump, medium = request.param

    def make(endpoint: int, **kwargs) -> ShmTransport:
        kwargs = {
            "namespace": ns,
            "directory": str(tmp_path),
            "capacity": 64 << 10,
            "pump_in_waiter": pump,
            **medium,
            **kwargs,
        }
        made.append(ShmTransport(endpoint, [0, 1], **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close()
    assert _files(tmp_path, ns) == []


# -- ring and framing ----------------------------------------------------------------------


def test_frames_round_trip_exactly_through_a_small_ring_across_many_reads(tmp_path):
    ring = Ring(str(tmp_path / "r"), 1000)  # every frame wraps around, the big one takes ~400 turns
    reader = FrameReader(Ring(str(tmp_path / "r"), 0))  # the reader takes the size from the file
    ring.write(encode_frame(Message("skew", K, 0)))  # from now on, copies straddle the ring's end
    assert [m.kind for m in reader.read()] == ["skew"]
    sent = [Message("x", MsgKey(i, 1, 2), 3, w.sample_tensors(i), {"i": i}) for i in range(3)]
    received, pending = [], deque()
    for msg in sent:
        pending.extend(encode_frame(msg))
    while pending:
        assert ring.write(pending) > 0
        received += reader.read()
    assert [(m.kind, m.key, m.src, m.meta) for m in received] == [(m.kind, m.key, m.src, m.meta) for m in sent]
    for got, msg in zip(received, sent):
        _assert_same(w.wire(got.tensors), msg.tensors)
    assert ring.write(deque([memoryview(bytes(1001))])) == 1000  # full: the rest waits


def test_frames_written_straight_from_tensors_read_back_exactly_across_the_ring_end(tmp_path):
    ring = Ring(str(tmp_path / "r"), 4096)
    reader = FrameReader(Ring(str(tmp_path / "r"), 0))
    small = w.sample_tensors()[:-1]  # every dtype, empty ones included; the 80 KiB one would not fit
    odd = [torch.arange(12.0).view(3, 4).t(), torch.tensor([True, False, True])]  # strided; bool
    for i in range(40):  # about 450 bytes each: the copies straddle the ring's end again and again
        msg = Message("x", MsgKey(i, 1, 2), 3, small + odd, {"i": i})
        assert ring.write_frame(msg)
        (got,) = reader.read()
        assert (got.kind, got.key, got.src, got.meta) == ("x", MsgKey(i, 1, 2), 3, {"i": i})
        _assert_same(w.wire(got.tensors), small + odd)


def test_a_frame_that_does_not_fit_is_not_written_straight(tmp_path):
    ring = Ring(str(tmp_path / "r"), 1000)
    reader = FrameReader(Ring(str(tmp_path / "r"), 0))
    assert ring.write_frame(Message("a", K, 0, [torch.zeros(100)]))  # 400 bytes of values
    published = reader.ring.readable()
    assert not ring.write_frame(Message("b", K, 0, [torch.zeros(150)]))  # 600 more do not fit
    assert reader.ring.readable() == published  # nothing of it was published
    assert [m.kind for m in reader.read()] == ["a"]
    assert ring.write_frame(Message("b", K, 0, [torch.zeros(150)]))  # the reader made room
    assert [(m.kind, m.tensors[0].shape) for m in reader.read()] == [("b", (150,))]


# -- one process ---------------------------------------------------------------------------


def test_round_trip_every_dtype_between_endpoints_and_to_self(pair):
    a, b = pair(0), pair(1)
    a.send(1, Message("forward", MsgKey(0, 1, 0), 0, w.sample_tensors(), {"m": [1]}))
    a.send(0, Message("self", K, 0, [torch.arange(3)]))
    got = b.recv(0, "forward", MsgKey(0, 1, 0), 5)
    _assert_same(w.wire(got.tensors), w.sample_tensors())
    assert (got.src, got.meta) == (0, {"m": [1]})
    assert torch.equal(a.recv(0, "self", K, 5).tensors[0], torch.arange(3))


def test_messages_larger_than_the_ring_arrive_whole_and_in_order(pair):
    """While a large message waits for room, later ones queue behind it, even when the reader has
    just made room (a receive with a zero timeout reads what the ring holds)."""
    a, b = pair(0), pair(1)
    big = [torch.randn(100_000), torch.randn(50_000).bfloat16()]  # 500 KB through a 64 KiB ring
    for i in range(3):
        a.send(1, Message("big", MsgKey(i, 0, 0), 0, big))
        with pytest.raises(CommTimeout):
            b.recv(0, "none", K, 0.0)
        a.send(1, Message("small", MsgKey(i, 0, 0), 0, [torch.tensor([i])]))
    for i in range(3):  # recv checks the key: any reordering raises KeyMismatchError
        _assert_same(w.wire(b.recv(0, "big", MsgKey(i, 0, 0), 10).tensors), big)
        assert b.recv(0, "small", MsgKey(i, 0, 0), 10).tensors[0].item() == i


def test_concurrent_senders_keep_each_channel_in_order(pair):
    a, b = pair(0), pair(1)

    def sender(kind: str) -> None:
        for step in range(50):
            a.send(1, Message(kind, MsgKey(step, 0, 0), 0, [torch.full((100,), step)]))

    threads = [threading.Thread(target=sender, args=(f"k{i}",)) for i in range(4)]
    [t.start() for t in threads]
    try:
        for i in range(4):
            for step in range(50):
                assert torch.equal(b.recv(0, f"k{i}", MsgKey(step, 0, 0), 5).tensors[0], torch.full((100,), step))
    finally:
        [t.join() for t in threads]


def test_threads_waiting_on_one_endpoint_each_get_their_message(pair):
    """One thread reads the rings for all: the others must still be woken, also by messages an
    endpoint sends itself (a relay forwarding to its own rank)."""
    a, b = pair(0), pair(1)
    got: dict[str, int] = {}

    def wait(kind: str) -> None:
        got[kind] = int(b.recv(0 if kind != "own" else 1, kind, K, 10).tensors[0])

    threads = [threading.Thread(target=wait, args=(k,)) for k in ("x", "y", "own")]
    [t.start() for t in threads]
    time.sleep(0.2)  # all three wait, one of them in poll()
    b.send(1, Message("own", K, 1, [torch.tensor(3)]))
    a.send(1, Message("y", K, 0, [torch.tensor(2)]))
    a.send(1, Message("x", K, 0, [torch.tensor(1)]))
    [t.join(5) for t in threads]
    assert got == {"x": 1, "y": 2, "own": 3}


def test_key_mismatch_timeout_and_zero_timeout(pair):
    a, b = pair(0), pair(1)
    a.send(1, Message("check", MsgKey(0, 0, 1), 0))
    with pytest.raises(KeyMismatchError, match=str(MsgKey(0, 0, 1))):
        b.recv(0, "check", K, 5)
    start = time.monotonic()
    with pytest.raises(CommTimeout, match=r"endpoint 1 waited.*\(step 7, layer 8, micro-batch 9\)"):
        b.recv(0, "never", MsgKey(7, 8, 9), 0.5)
    assert 0.45 <= time.monotonic() - start < 1.0
    a.send(1, Message("now", K, 0))
    time.sleep(0.05)
    assert b.recv(0, "now", K, 0.0).kind == "now"  # in the ring, not yet in the inbox: still found


def test_recv_any_takes_the_first_arrival(tmp_path):
    ns, kw = uuid.uuid4().hex[:12], {"directory": str(tmp_path)}
    eps = [ShmTransport(i, range(3), namespace=ns, **kw) for i in range(3)]
    try:
        threading.Timer(0.1, eps[2].send, (0, Message("race", K, 2))).start()
        assert eps[0].recv_any([1, 2], "race", K, 5).src == 2  # without waiting for endpoint 1
        eps[1].send(0, Message("race", K, 1))
        assert eps[0].recv_any([1, 2], "race", K, 5).src == 1
    finally:
        [t.close() for t in eps]


def test_close_fails_a_blocked_recv_promptly_and_refuses_sends(pair):
    assert_close_fails_a_blocked_recv_and_refuses_sends(pair(0))


def test_a_message_sent_before_its_receiver_exists_arrives(pair):
    a = pair(0)
    a.send(1, Message("early", K, 0, [torch.ones(2)]))
    assert torch.equal(pair(1).recv(0, "early", K, 5).tensors[0], torch.ones(2))


def test_messages_to_a_closed_peer_are_dropped_without_blocking(pair):
    a, b = pair(0, max_pending_bytes=1 << 20), pair(1)
    b.close()
    for _ in range(100):  # 100 x 400 KB: far more than the ring and the 1 MiB that may wait
        a.send(1, Message("x", K, 0, [torch.zeros(100_000)]))


def test_too_much_waiting_for_a_silent_peer_raises(pair):
    a = pair(0, max_pending_bytes=1 << 20)
    with pytest.raises(CommError, match="already wait for endpoint 1"):
        for _ in range(100):
            a.send(1, Message("x", K, 0, [torch.zeros(100_000)]))


def test_link_delay_holds_every_message_back(pair):
    a, b = pair(0), pair(1, link_delay_s=0.2)
    start = time.monotonic()
    a.send(1, Message("x", K, 0))
    b.send(1, Message("own", K, 1))
    b.recv(0, "x", K, 5)
    b.recv(1, "own", K, 5)
    assert 0.19 <= time.monotonic() - start < 1.0


def _write_without_waking(sender: ShmTransport, dst: int, msg: Message) -> None:
    """Puts msg in the ring to dst but writes no wake-up byte: only a reader that looks finds it."""
    sender._outboxes[dst].ring.write(encode_frame(msg))


def test_a_spinning_reader_finds_a_message_without_being_woken(pair):
    a, b = pair(0), pair(1, spin_s=5.0)
    threading.Timer(0.1, _write_without_waking, (a, 1, Message("quiet", K, 0, [torch.ones(3)]))).start()
    start = time.monotonic()
    assert torch.equal(b.recv(0, "quiet", K, 3.0).tensors[0], torch.ones(3))
    assert time.monotonic() - start < 1.0  # not left until the poll() timeout


def test_without_spinning_a_reader_waits_for_its_wake_up(tmp_path):
    ns = uuid.uuid4().hex[:12]
    a, b = (ShmTransport(i, [0, 1], namespace=ns, directory=str(tmp_path)) for i in range(2))
    try:
        threading.Timer(0.1, _write_without_waking, (a, 1, Message("quiet", K, 0))).start()
        start = time.monotonic()
        assert b.recv(0, "quiet", K, 1.5).kind == "quiet"  # read once poll() gives up
        assert time.monotonic() - start >= 1.4
    finally:
        a.close(), b.close()
    with pytest.raises(CommError, match="spin_s must be >= 0"):
        ShmTransport(0, [1], namespace=ns, directory=str(tmp_path), spin_s=-1)


def test_rejects_unknown_peers_and_bad_namespaces(pair):
    with pytest.raises(CommError, match="endpoint 5 is not a shared-memory peer"):
        pair(0).send(5, Message("x", K, 0))
    with pytest.raises(CommError, match="namespace"):
        ShmTransport(0, [1], namespace="../etc")


@pytest.mark.parametrize("pump", [True, False], ids=["waiter-reads", "receiver-thread"])
def test_files_are_named_only_until_both_ends_have_opened_them(tmp_path, pump):
    """Once both ends run, nothing of theirs is left in the directory: a process killed from then
    on leaks nothing (the memory goes with the last mapping). The second end to open a ring or
    its FIFO removes the name."""
    ns = uuid.uuid4().hex[:12]
    a = ShmTransport(0, [1], namespace=ns, directory=str(tmp_path), pump_in_waiter=pump)
    assert _files(tmp_path, ns) == [f"afd-{ns}-{r}" for r in ("0to1", "0to1.wake", "1to0", "1to0.wake")]
    b = ShmTransport(1, [0], namespace=ns, directory=str(tmp_path), pump_in_waiter=pump)
    assert _files(tmp_path, ns) == []
    a.send(1, Message("y", K, 0, [torch.ones(2)]))
    assert torch.equal(b.recv(0, "y", K, 5).tensors[0], torch.ones(2))
    a.close(), b.close()


def test_a_peer_that_closes_before_a_late_one_starts_leaves_the_others_able_to_wake_it(tmp_path):
    """Endpoints 0 and 1 start; 1 closes without ever hearing from 2, so it removes what it made
    for 2 (a ring and its FIFO). Endpoint 2 starts only then, and must still be woken by 0's
    messages. (With one FIFO per receiver, opened by all its peers, 1 removed that FIFO's name
    while 0 held it open: 2 made a new one, and 0's wake-ups went to the old one.)"""
    ns = uuid.uuid4().hex[:12]
    kw = {"namespace": ns, "directory": str(tmp_path)}
    e0, e1 = ShmTransport(0, range(3), **kw), ShmTransport(1, range(3), **kw)
    e1.close()
    e2 = ShmTransport(2, range(3), **kw)
    try:
        threading.Timer(0.1, e0.send, (2, Message("late", K, 0, [torch.ones(2)]))).start()
        start = time.monotonic()
        assert torch.equal(e2.recv(0, "late", K, 5).tensors[0], torch.ones(2))
        assert time.monotonic() - start < 2.0  # woken by the message, not by the 5 s timeout
    finally:
        e0.close(), e2.close()
    assert _files(tmp_path, ns) == []


def test_remove_namespace_and_fits(tmp_path):
    ns = uuid.uuid4().hex[:12]
    ShmTransport(0, [1], namespace=ns, directory=str(tmp_path))  # never closed: as if killed
    assert len(_files(tmp_path, ns)) == 4  # a ring each way, each with its FIFO
    assert len(remove_namespace(ns, str(tmp_path))) == 4 and _files(tmp_path, ns) == []
    assert fits(2, 1 << 20, str(tmp_path)) and not fits(1 << 40, 1 << 20, str(tmp_path))


# -- between processes ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[{}, TWIN], ids=["frames", "payload-twin"])
def shm_run(request) -> dict:
    """transport_worker's scenario over shared memory, with 256 KiB rings (the large messages
    take several turns); the files must all be gone once every process has closed. With the host
    twin, the 80 KB tensor of the data message goes through a payload area, and the 3 MiB ones are
    larger than the area: they go as bytes, in turns."""
    ns = uuid.uuid4().hex[:12]
    try:
        out = run_scenario("shm", {"peers": range(3), "namespace": ns, "capacity": 256 << 10, **request.param})
        out["files_left"] = _files(SHM_DIR, ns)
        out["twin"] = bool(request.param)
        return out
    finally:
        remove_namespace(ns)


def test_processes_exact_round_trip_to_a_receiver_started_later(shm_run):
    _assert_same(shm_run["data"], w.sample_tensors(1))
    assert shm_run["data_src"] == 1 and shm_run["data_meta"] == {"note": "early"}


def test_processes_messages_larger_than_the_ring_both_ways(shm_run):
    assert shm_run["big"] == w.digest(w.big_tensor(1)) and shm_run["ep1"]["big_back"] == w.digest(w.big_tensor(2))
    # through the payload area but for the large one, which is larger than the area
    assert shm_run["ep1"]["inline"] == (1 if shm_run["twin"] else None)


def test_processes_key_mismatch_timeout_and_recv_any(shm_run):
    _assert_key_mismatch(shm_run["mismatch"])
    _assert_timeout(shm_run["timeout"])
    _assert_race(shm_run["race"])


def test_processes_leave_no_files(shm_run):
    assert shm_run["files_left"] == []


# -- hybrid, and the choice of transport ---------------------------------------------------


def test_hybrid_uses_shared_memory_on_the_host_and_zeromq_beyond(tmp_path):
    """Endpoints 0 and 1 share a host, 2 is elsewhere: 0 and 1 run hybrids, 2 plain ZeroMQ. Each
    hybrid is given a dead ZeroMQ address for its neighbour: what reaches it went through memory."""
    ns, addrs = uuid.uuid4().hex[:12], dict(enumerate(free_tcp_addresses(3)))
    hosts, dead = {0: "h", 1: "h", 2: "other"}, "tcp://127.0.0.1:9"
    eps = [peer_transport(i, {**addrs, 1 - i: dead}, hosts, ns) for i in range(2)]
    eps.append(ZmqTransport(2, addrs))
    try:
        assert isinstance(eps[0], HybridTransport) and eps[0].local == {0, 1}
        eps[1].send(0, Message("race", K, 1, [torch.ones(2)]))
        eps[2].send(0, Message("race", K, 2, [torch.zeros(2)]))
        eps[0].send(0, Message("own", K, 0))
        assert sorted(eps[0].recv_any([1, 2], "race", K, 5).src for _ in range(2)) == [1, 2]
        assert eps[0].recv(0, "own", K, 5).src == 0
        eps[0].send(2, Message("back", K, 0, [torch.ones(3)]))
        assert torch.equal(eps[2].recv(0, "back", K, 5).tensors[0], torch.ones(3))
    finally:
        [t.close() for t in eps]
    assert _files(SHM_DIR, ns) == []


def test_peer_transport_picks_by_host():
    ns, addrs = uuid.uuid4().hex[:12], dict(enumerate(free_tcp_addresses(2)))
    shm = peer_transport(0, {}, {0: "h", 1: "h"}, ns)
    zmq = peer_transport(0, addrs, {}, "")  # no host ids: ZeroMQ to everyone
    alone = peer_transport(1, {}, {1: "h"}, ns)  # a deployment of one endpoint
    alone.send(1, Message("own", K, 1))
    assert alone.recv(1, "own", K, 5).src == 1
    alone.close()
    try:
        assert isinstance(shm, ShmTransport) and isinstance(zmq, ZmqTransport)
    finally:
        shm.close(), zmq.close()
    t = make_transport("shm", 0, peers=[0], namespace=ns)
    t.close()


def test_a_replacement_of_a_lost_peer_gets_fresh_rings_and_none_of_the_old_traffic(pair, tmp_path):
    """A peer's process is lost (never closed: its rings stay as they were, half read); its
    replacement opens rings named for its incarnation, the survivor readmits it, and the two
    talk as before, with nothing of what went to or came from the lost one."""
    from comm.transport.shm_transport import host_id

    a, lost = pair(0), pair(1)
    a.send(1, Message("data", K, 0, [torch.arange(4)]))
    assert lost.recv(0, "data", K, 5).tensors[0].tolist() == [0, 1, 2, 3]
    lost.send(0, Message("data", MsgKey(9, 0, 0), 1))  # sent, never taken: dropped on readmission
    a.send(1, Message("data", MsgKey(7, 0, 0), 0))  # to the lost one: never reaches the replacement
    again = pair(1, incarnations={1: 1})
    a.readmit(1, "", host_id(str(tmp_path)), 1)
    a.send(1, Message("data", MsgKey(1, 0, 0), 0, [torch.ones(2)]))
    assert again.recv(0, "data", MsgKey(1, 0, 0), 5).tensors[0].tolist() == [1.0, 1.0]
    again.send(0, Message("data", MsgKey(2, 0, 0), 1))
    assert a.recv(1, "data", MsgKey(2, 0, 0), 5).src == 1
    assert a.pending(1, "data") == 0 and again.pending(0, "data") == 0
    with pytest.raises(CommError, match="the replacement of endpoint 1 offers none to it"):
        a.readmit(1, "", "another host", 2)


def test_a_zmq_peer_replaced_at_a_new_address_is_reached_there():
    addrs = dict(enumerate(free_tcp_addresses(3)))
    a, lost = ZmqTransport(0, addrs), ZmqTransport(1, addrs)
    try:
        a.send(1, Message("data", K, 0))
        assert lost.recv(0, "data", K, 5).src == 0
        lost.close()  # its machine is gone; the replacement listens elsewhere
        again = ZmqTransport(1, {0: addrs[0], 1: addrs[2]})
        a.readmit(1, addrs[2])
        a.send(1, Message("data", MsgKey(1, 0, 0), 0))
        assert again.recv(0, "data", MsgKey(1, 0, 0), 5).src == 0
        again.send(0, Message("back", K, 1))
        assert a.recv(1, "back", K, 5).src == 1
        again.close()
    finally:
        a.close()
