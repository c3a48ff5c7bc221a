"""Transports: message framing, ZeroMQ and torch.distributed (gloo) between real OS processes,
and the factory. The shared-memory transport has its own module (test_shm_transport.py), which
reuses this module's cross-process scenario.

The cross-process scenarios run once per module (spawning processes that import torch takes
seconds) and several tests check their results; each child reports through a queue and the
parent always reaps every child, so a failure never leaves a process or a hang behind.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import pytest
import torch

from comm.messages import CommError, CommTimeout, Message, MsgKey
from comm.transport.factory import TRANSPORTS, make_transport
from comm.transport.inproc import InProcessFabric
from comm.transport.torch_dist import HEADER_BYTES, pack_header, unpack_header
from comm.transport.zmq_transport import ZmqTransport, free_tcp_addresses
from tests.comm import transport_worker as w

pytestmark = pytest.mark.timeout(60)
_SPAWN = mp.get_context("spawn")


# -- helpers -------------------------------------------------------------------------------


def _start(name: str, role, results, *args) -> mp.Process:
    proc = _SPAWN.Process(target=w.run_role, args=(role, name, results, *args), name=name, daemon=True)
    proc.start()
    return proc


def _collect(results, procs: list[mp.Process], timeout: float = 45.0) -> dict:
    """Every child's result dict by name; a child's exception fails the test with its traceback."""
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < len(procs):
        status, name, value = _next_report(results, procs, out, deadline)
        if status != "ok":
            raise AssertionError(f"child {name} failed:\n{value}")
        out[name] = value
    return out


def _next_report(results, procs: list[mp.Process], reported: dict, deadline: float) -> tuple:
    """The next child report; fails fast when a child died without one (a crash, not an error)."""
    while time.monotonic() < deadline:
        # A child that exited before this get() has flushed its report into the pipe already.
        dead = [
            f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode is not None and p.name not in reported
        ]
        try:
            return results.get(timeout=1.0 if dead else 0.2)
        except queue.Empty:
            if dead:
                raise AssertionError(f"children died without reporting: {dead}") from None
    raise AssertionError(f"children silent until the deadline; reported: {sorted(reported)}")


def _wait_for(event, results, procs: list[mp.Process], timeout: float = 45.0) -> None:
    """Waits for a child's event; a child that fails meanwhile fails the test at once."""
    deadline = time.monotonic() + timeout
    while not event.wait(0.2):
        if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
            status, name, value = _next_report(results, procs, {}, time.monotonic() + 2.0)
            raise AssertionError(f"child {name} ended before the event ({status}):\n{value}")


def _reap(procs: list[mp.Process]) -> None:
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _assert_same(received: list, sent: list[torch.Tensor]) -> None:
    assert received == w.wire(sent)


# -- framing -------------------------------------------------------------------------------


def test_message_round_trip_every_dtype():
    msg = Message("dispatch", MsgKey(1, 2, 3), 4, w.sample_tensors(), {"tokens": [1, 2], "name": "x"})
    back = Message.decode(msg.encode())
    assert (back.kind, back.key, back.src, back.meta) == ("dispatch", MsgKey(1, 2, 3), 4, msg.meta)
    _assert_same(w.wire(back.tensors), msg.tensors)


def test_a_tensor_of_a_dtype_the_wire_has_no_name_for_is_refused_at_send():
    msg = Message("combine", MsgKey(0, 0, 0), 0, [torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(CommError, match="complex64 cannot travel; use one of float64, float32"):
        msg.header()


def test_torch_dist_header_packing():
    msg = Message("combine", MsgKey(5, 6, 7), 2, w.sample_tensors(), {"a": 1})
    head = pack_header(msg)
    assert head.dtype == torch.int64 and head.numel() * 8 == HEADER_BYTES
    back, specs = unpack_header(head)
    assert (back.kind, back.key, back.src, back.meta, back.tensors) == ("combine", MsgKey(5, 6, 7), 2, {"a": 1}, [])
    assert specs == [(t.dtype, list(t.shape)) for t in msg.tensors] and specs[2] == (torch.float8_e4m3fn, [4, 8])
    with pytest.raises(CommError, match="exceeds"):
        pack_header(Message("combine", MsgKey(0, 0, 0), 0, meta={"big": "x" * HEADER_BYTES}))


# -- ZeroMQ, in one process ----------------------------------------------------------------


def test_zmq_round_trip_between_threads_and_to_self():
    addrs = dict(enumerate(free_tcp_addresses(2)))
    a, b = ZmqTransport(0, addrs), ZmqTransport(1, addrs)
    try:
        a.send(1, Message("forward", MsgKey(0, 1, 0), 0, w.sample_tensors()))
        a.send(0, Message("self", MsgKey(0, 0, 0), 0, [torch.arange(3)]))
        _assert_same(w.wire(b.recv(0, "forward", MsgKey(0, 1, 0), 5).tensors), w.sample_tensors())
        assert torch.equal(a.recv(0, "self", MsgKey(0, 0, 0), 5).tensors[0], torch.arange(3))
    finally:
        a.close(), b.close()


def test_zmq_concurrent_senders_keep_each_channel_in_order():
    addrs = dict(enumerate(free_tcp_addresses(2)))
    a, b = ZmqTransport(0, addrs), ZmqTransport(1, addrs)

    def sender(kind: str) -> None:
        for step in range(50):
            a.send(1, Message(kind, MsgKey(step, 0, 0), 0, [torch.full((100,), step)]))

    threads = [threading.Thread(target=sender, args=(f"k{i}",)) for i in range(4)]
    try:
        [t.start() for t in threads]
        for i in range(4):  # recv checks the key: any reordering raises KeyMismatchError
            for step in range(50):
                assert torch.equal(b.recv(0, f"k{i}", MsgKey(step, 0, 0), 5).tensors[0], torch.full((100,), step))
    finally:
        [t.join() for t in threads]
        a.close(), b.close()


def test_zmq_silent_peer_times_out_promptly_naming_endpoint_and_key():
    addrs = dict(enumerate(free_tcp_addresses(2)))  # nobody ever binds endpoint 1's address
    t = ZmqTransport(0, addrs, linger_ms=0)  # no point flushing to a peer that never comes
    try:
        t.send(1, Message("dispatch", MsgKey(3, 4, 5), 0))  # queued for later, never blocks
        start = time.monotonic()
        with pytest.raises(CommTimeout) as err:
            t.recv(1, "expert_out", MsgKey(3, 4, 5), 0.5)
        assert 0.45 <= time.monotonic() - start < 1.0
        assert "endpoint 0" in str(err.value) and str(MsgKey(3, 4, 5)) in str(err.value)
    finally:
        t.close()


def assert_close_fails_a_blocked_recv_and_refuses_sends(t) -> None:
    """t (endpoint 0 of a pair) closed while a thread waits for endpoint 1: the wait fails with a
    CommError within 0.5 s, later sends are refused, and a second close is harmless."""
    raised: list = []
    waiter = threading.Thread(target=w.record_failure, args=(raised, lambda: t.recv(1, "x", MsgKey(0, 0, 0), 30.0)))
    waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    t.close()
    waiter.join(5)
    assert raised and raised[0][0] == "CommError" and raised[0][1] - start < 0.5
    with pytest.raises(CommError, match="after close"):
        t.send(1, Message("x", MsgKey(0, 0, 0), 0))
    t.close()  # idempotent


def test_zmq_close_fails_a_blocked_recv_promptly():
    assert_close_fails_a_blocked_recv_and_refuses_sends(ZmqTransport(0, dict(enumerate(free_tcp_addresses(2)))))


def test_zmq_full_queue_raises_instead_of_dropping_or_blocking():
    addrs = dict(enumerate(free_tcp_addresses(2)))  # endpoint 1 never comes up
    t = ZmqTransport(0, addrs, hwm=2, linger_ms=0)
    try:
        with pytest.raises(CommError, match="queued for endpoint 1"):
            for _ in range(100):
                t.send(1, Message("x", MsgKey(0, 0, 0), 0, [torch.zeros(4)]))
    finally:
        t.close()


def test_zmq_bind_conflict_is_a_comm_error():
    addrs = dict(enumerate(free_tcp_addresses(1)))
    t = ZmqTransport(0, addrs)
    try:
        with pytest.raises(CommError, match="cannot bind"):
            ZmqTransport(0, addrs)
    finally:
        t.close()


# -- ZeroMQ, between processes -------------------------------------------------------------


@pytest.fixture(scope="module")
def zmq_run() -> dict:
    """Endpoints 1 and 2 start first; endpoint 0 only once 1 has already sent to it."""
    return run_scenario("zmq", {"addresses": dict(enumerate(free_tcp_addresses(3)))})


def run_scenario(kind: str, kwargs: dict) -> dict:
    """The cross-process scenario of transport_worker (endpoints 1 and 2 first, 0 once 1 has
    sent); endpoint 0's results, with endpoint 1's under "ep1"."""
    results, sent = _SPAWN.Queue(), _SPAWN.Event()
    procs = [
        _start("ep1", w.early_sender, results, kind, kwargs, sent),
        _start("ep2", w.fast_racer, results, kind, kwargs),
    ]
    try:
        _wait_for(sent, results, procs)
        procs.append(_start("ep0", w.late_receiver, results, kind, kwargs))
        out = _collect(results, procs)
        return {**out["ep0"], "ep1": out["ep1"]}
    finally:
        _reap(procs)


def test_zmq_processes_exact_round_trip_to_a_receiver_started_later(zmq_run):
    _assert_same(zmq_run["data"], w.sample_tensors(1))
    assert zmq_run["data_src"] == 1 and zmq_run["data_meta"] == {"note": "early"}
    assert zmq_run["big"] == w.digest(w.big_tensor(1)) and zmq_run["ep1"]["big_back"] == w.digest(w.big_tensor(2))


def test_zmq_processes_key_mismatch(zmq_run):
    _assert_key_mismatch(zmq_run["mismatch"])


def test_zmq_processes_timeout(zmq_run):
    _assert_timeout(zmq_run["timeout"])


def test_zmq_processes_recv_any_takes_first_arrival(zmq_run):
    _assert_race(zmq_run["race"])


def _assert_key_mismatch(result) -> None:
    kind, text, seconds = result
    assert kind == "KeyMismatchError" and seconds < 1.0  # at once, not after the 5 s timeout
    assert str(MsgKey(0, 0, 0)) in text and str(MsgKey(0, 0, 1)) in text


def _assert_timeout(result) -> None:
    kind, text, seconds = result
    assert kind == "CommTimeout" and 0.45 <= seconds < 1.0
    assert "endpoint 0" in text and str(MsgKey(7, 8, 9)) in text


def _assert_race(race) -> None:
    (first, seconds), (second, _) = race
    assert (first, second) == (2, 1) and seconds < 0.9 * w.RACE_DELAY  # did not wait for the slow one


# -- torch.distributed over gloo, between processes ----------------------------------------


@pytest.fixture(scope="module")
def gloo_run() -> dict:
    init_method = free_tcp_addresses(1)[0]
    results, started = _SPAWN.Queue(), _SPAWN.Barrier(3)
    procs = [_start(f"rank{r}", w.dist_rank, results, r, init_method, started) for r in range(3)]
    try:
        return _collect(results, procs)
    finally:
        _reap(procs)


def test_gloo_exact_round_trip_both_directions_after_idling_past_the_group_timeout(gloo_run):
    _assert_same(gloo_run["rank0"]["data"], [*w.sample_tensors(1), torch.tensor(2.5)])
    assert gloo_run["rank0"]["data_meta"] == {"note": "gloo"}
    for rank in (1, 2):
        _assert_same(gloo_run[f"rank{rank}"]["back"], w.sample_tensors(10 + rank))


def test_gloo_key_mismatch(gloo_run):
    _assert_key_mismatch(gloo_run["rank0"]["mismatch"])


def test_gloo_timeout(gloo_run):
    _assert_timeout(gloo_run["rank0"]["timeout"])


def test_gloo_recv_any_takes_first_arrival(gloo_run):
    _assert_race(gloo_run["rank0"]["race"])


def test_gloo_close_fails_blocked_recv_and_stops_every_thread(gloo_run):
    for rank in range(3):
        kind, seconds = gloo_run[f"rank{rank}"]["close"]
        assert kind == "CommError" and seconds < 0.5
        assert gloo_run[f"rank{rank}"]["threads_alive"] == []


def test_gloo_send_to_a_closed_peer_is_refused(gloo_run):
    assert "endpoint 1 has closed" in gloo_run["rank2"]["send_to_closed"]


# -- factory -------------------------------------------------------------------------------


def test_factory_builds_each_kind_and_rejects_unknown():
    assert set(TRANSPORTS) == {"inproc", "zmq", "shm", "hybrid", "torch_dist"}
    fabric = InProcessFabric()
    a, b = make_transport("inproc", 0, fabric=fabric), make_transport("inproc", 1, fabric=fabric)
    a.send(1, Message("x", MsgKey(0, 0, 0), 0, [torch.ones(2)]))
    assert torch.equal(b.recv(0, "x", MsgKey(0, 0, 0), 1).tensors[0], torch.ones(2))
    z = make_transport("zmq", 0, addresses=dict(enumerate(free_tcp_addresses(1))))
    z.close()
    with pytest.raises(CommError, match="hybrid, inproc, shm, torch_dist, zmq"):
        make_transport("carrier-pigeon", 0)
    with pytest.raises(CommError, match="init_process_group"):
        make_transport("torch_dist", 0)
