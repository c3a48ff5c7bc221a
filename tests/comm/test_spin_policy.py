"""SpinPolicy: a waiting thread looks before it sleeps only while its recent waits were short."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from comm.messages import Message, MsgKey
from comm.transport.shm_ring import encode_frame
from comm.transport.shm_transport import ShmTransport
from comm.transport.spin import STARVED_S, SpinPolicy, idle_priority_supported

K = MsgKey(0, 0, 0)


def test_spins_while_a_quarter_of_the_recent_waits_were_short():
    policy = SpinPolicy(0.001, history=8)
    assert policy.window(5.0) == 0.001  # starts on
    assert policy.window(0.0004) == 0.0004  # never past the caller's limit
    for _ in range(6):
        policy.record(0.01)  # six long waits of eight: still a quarter short
    assert policy.window(5.0) == 0.001
    policy.record(0.01)  # seven of eight long: off
    assert policy.window(5.0) == 0.0
    policy.record(0.0005)  # one short of eight (it pushed the last short one of the start out)
    assert policy.window(5.0) == 0.0
    policy.record(0.001)  # a wait of exactly max_s counts as short: two of eight
    assert policy.window(5.0) == 0.001
    for wait in (0.0005, 0.01) * 4:  # half short, half long, as an FFN rank's steps: stays on
        policy.record(wait)
        assert policy.window(5.0) == 0.001


def test_zero_never_spins_and_negative_is_refused():
    policy = SpinPolicy(0.0)
    policy.record(0.0)
    assert policy.window(1.0) == 0.0
    with pytest.raises(ValueError, match="max_s must be >= 0"):
        SpinPolicy(-1.0)


def test_a_reader_whose_waits_were_long_stops_looking_and_sleeps(tmp_path):
    """After a run of waits longer than its look, the reader no longer finds a message written
    without a wake-up byte before poll() gives up; the same reader did while its waits were short."""
    ns = uuid.uuid4().hex[:12]
    a = ShmTransport(0, [0, 1], namespace=ns, directory=str(tmp_path))
    b = ShmTransport(1, [0, 1], namespace=ns, directory=str(tmp_path), spin_s=0.02)

    def write_quietly():  # into the ring, without a wake-up byte: only a reader that looks finds it
        a._outboxes[1].ring.write(encode_frame(Message("quiet", K, 0)))

    try:
        threading.Timer(0.005, write_quietly).start()
        start = time.monotonic()
        b.recv(0, "quiet", K, 1.0)
        assert time.monotonic() - start < 0.5  # looked, and found it
        for _ in range(8):  # waits of 50 ms, longer than the 20 ms look
            threading.Timer(0.05, a.send, (1, Message("late", K, 0))).start()
            b.recv(0, "late", K, 5.0)
        threading.Timer(0.005, write_quietly).start()
        start = time.monotonic()
        b.recv(0, "quiet", K, 1.0)
        assert time.monotonic() - start >= 0.9  # slept: read once poll() gave up
    finally:
        a.close(), b.close()


needs_idle = pytest.mark.skipif(
    not idle_priority_supported(), reason="this OS refuses a thread SCHED_IDLE and back (Linux without CAP_SYS_NICE)"
)


@needs_idle
def test_an_idle_policy_looks_under_sched_idle_and_comes_back_even_on_error():
    policy = SpinPolicy(0.001, idle=True)
    with policy.looking(0.001):
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    with pytest.raises(RuntimeError, match="inside"), policy.looking(0.001):
        raise RuntimeError("inside")
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_normal_policy_leaves_the_thread_as_it_is():
    with SpinPolicy(0.001).looking(0.001):
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


@needs_idle
def test_a_thread_under_another_policy_keeps_it():
    def run() -> None:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        with SpinPolicy(0.001, idle=True).looking(0.001):
            seen.append(os.sched_getscheduler(0))
        seen.append(os.sched_getscheduler(0))

    seen: list[int] = []
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_BATCH, os.SCHED_BATCH]


@needs_idle
@pytest.mark.parametrize("idle", [True, False])
def test_a_transport_reader_looks_at_the_priority_asked_for_and_reads_at_normal(tmp_path, idle):
    """While its reader looks at the rings (its policy read from another thread by its thread id for
    0.2 s of a look of up to 5 s), the policy is SCHED_IDLE with spin_idle and SCHED_OTHER
    without; the receive returns under SCHED_OTHER."""
    ns = uuid.uuid4().hex[:12]
    a = ShmTransport(0, [0, 1], namespace=ns, directory=str(tmp_path))
    b = ShmTransport(1, [0, 1], namespace=ns, directory=str(tmp_path), spin_s=5.0, spin_idle=idle)
    got: list = []

    def receive() -> None:
        got.append(b.recv(0, "late", K, 10.0))
        got.append(os.sched_getscheduler(0))

    reader = threading.Thread(target=receive)
    try:
        reader.start()
        seen = set()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            seen.add(os.sched_getscheduler(reader.native_id))
            time.sleep(0.001)
        a.send(1, Message("late", K, 0))
        reader.join(10)
        assert os.SCHED_IDLE in seen if idle else seen == {os.SCHED_OTHER}
        assert got[0].kind == "late" and got[1] == os.SCHED_OTHER
    finally:
        a.close(), b.close()


@needs_idle
def test_a_look_kept_off_the_cpu_backs_off_to_normal_priority_for_longer_each_time(caplog):
    now = [0.0]
    policy = SpinPolicy(0.002, idle=True, backoff_looks=2, clock=lambda: now[0])

    def look(lasted: float = 0.0) -> str:
        with policy.looking(0.002):
            seen = os.sched_getscheduler(0)
            now[0] += lasted
        return "idle" if seen == os.SCHED_IDLE else "normal"

    assert look(0.002 + STARVED_S) == "idle"  # within its window plus STARVED_S: not kept off
    assert policy.starved == 0
    assert look(0.5) == "idle" and policy.starved == 1  # kept off: two looks at normal priority
    assert "kept off the CPU" in caplog.text
    assert [look(0.5), look(0.5), look()] == ["normal", "normal", "idle"]
    assert look(0.5) == "idle" and policy.starved == 2  # the next back-off is twice as long
    assert [look(), look(), look(), look(), look()] == ["normal"] * 4 + ["idle"]
    assert look() == "idle"  # two clean looks at idle priority: the back-off starts short again
    assert look(0.5) == "idle" and policy.starved == 3
    assert [look(), look(), look()] == ["normal", "normal", "idle"]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@needs_idle
@pytest.mark.timeout(60)
def test_a_reader_beside_a_busy_loop_on_its_core_backs_off_to_normal_priority(tmp_path):
    """A process spinning on the reader's core keeps an idle-priority reader off the CPU (its
    message is seen hundreds of ms late); after that the reader looks at normal priority and gets
    its messages within milliseconds again."""
    core = sorted(os.sched_getaffinity(0))[0]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    ns = uuid.uuid4().hex[:12]
    a = ShmTransport(0, [0, 1], namespace=ns, directory=str(tmp_path))
    b = ShmTransport(1, [0, 1], namespace=ns, directory=str(tmp_path), spin_s=0.02, spin_idle=True)
    mask = os.sched_getaffinity(0)
    try:
        time.sleep(0.2)
        os.sched_setaffinity(0, {core})  # this thread reads, on the busy loop's core
        late = []
        for i in range(40):
            if b._spin.starved:
                break
            threading.Timer(0.005, a.send, (1, Message("m", MsgKey(i, 0, 0), 0))).start()
            start = time.monotonic()
            b.recv(0, "m", MsgKey(i, 0, 0), 10.0)
            late.append(time.monotonic() - start)
        assert b._spin.starved == 1, late
        assert late[-1] > 0.02 + STARVED_S
        for i in range(100, 103):  # now at normal priority: a fair share of the core
            threading.Timer(0.005, a.send, (1, Message("m", MsgKey(i, 0, 0), 0))).start()
            start = time.monotonic()
            b.recv(0, "m", MsgKey(i, 0, 0), 10.0)
            assert time.monotonic() - start < 0.1
    finally:
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait()
        a.close(), b.close()
