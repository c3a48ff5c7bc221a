"""Same-host transport: endpoints on one machine exchange messages through shared memory.

    endpoint s                               /dev/shm                                endpoint d
    send(d, msg) --frame, 1 copy--> ring afd-<ns>-<s>to<d> --1 copy--> tensors --> recv(s, ...)
                 --one byte-------> FIFO afd-<ns>-<s>to<d>.wake --wakes the thread waiting in recv

Where the tensors go (`payload_device`, ring_medium.py): by default inside the frames, through
the host (a GPU rank copies them to the host before it sends and back after it receives). With a
payload device the frames in the ring carry only headers and offsets, and the tensors go through a
payload area of each ring: in host shared memory ("cpu", the CPU twin of the device path, which
the CPU tests run), or in GPU memory shared by CUDA IPC (a CUDA device: the tensors never cross the
host; the writer waits for its copies into the area and the reader for its clones out of it, one
host wait each per message, ipc_medium.py). Headers, counters, flags and wake-ups stay in host
shared memory either way, and the rest of this module does not depend on the medium.

    payload_device=cuda:i   send: tensor --copy_ on the GPU--> payload area (GPU, CUDA IPC)
                                  header + offsets --> ring (host) --> recv: clone on the GPU

One ring per ordered pair of endpoints (shm_ring.py), each with its own wake-up FIFO (shm_wake.py). A send
copies the frame into the ring and writes a byte to the ring's FIFO; the receiver waits on the
FIFOs of all its rings at once (poll()). The thread waiting in `recv` reads the rings itself (the
pump of `Inbox.take`): woken from poll(), it moves completed messages into the inbox, its own and
other threads' (which it wakes), and hands the role to another waiting thread when it leaves.
Nothing spins (unless asked to, below), and a message costs one thread wake-up, where ZeroMQ over
TCP costs its I/O threads, our receiver thread and the waiter.

`pump_in_waiter=False` makes a receiver thread move the messages instead: two wake-ups per
message (the receiver thread, then the waiter). With a link delay (`make_inbox`) or an inbox
shared with another transport (hybrid.py), the receiver thread is used whatever
`pump_in_waiter` says. In `bench_latency.py`, measured in paired rounds, reading in the waiter
made AFD 1A+1F 1.74x single mode's TPOT at concurrency 1 against 1.86x with the receiver thread,
and colocated dp2 2.01x against 2.33x.

Why a FIFO per ring and not one per receiver: with one FIFO per receiver, opened by all its
peers, a peer that finished and closed before a slow receiver had even started removed that
FIFO's name (its reader had never opened it); the receiver then made a new FIFO that its other
peers, holding the old one, never wrote to. Its waits lasted until their timeouts (three runs of
tests/comm/test_dispatch_processes.py at once on two cores stalled in 4 of 6 tries; a receiver
thread, which wakes every second anyway, only slowed down). A ring and its FIFO have exactly two
users, so either end may remove their names. Since the change: 9 of 9 such tries passed.

Spinning (`spin_s`, off by default here; deployments turn it on where each rank has cores of
its own, see EngineArgs.comm_spin_us): a thread that finds nothing to read looks at the rings again
and again for up to `spin_s` before it blocks in poll(), so a message that comes within that time
is read without a wake-up: no sleep, no scheduler latency, no cold caches, at the price of the
CPU time spent looking. `SpinPolicy` (spin.py) looks only while most recent waits were that short,
so an idle rank, or one whose peer is busy for longer, sleeps at once. A writer writes a wake-up
byte only while the reader's ring says it may be asleep (shm_ring.py), so a looking reader costs
its writers no system call either. On this project's 2-core machine, in paired bench_latency
rounds at concurrency 1, 1 ms of looking took AFD 1A+1F from 1.62-1.77x single mode's TPOT to
1.41-1.47x; 2 ms while a quarter of the recent waits were short, 1.37-1.42x (1.61-1.71x without).
With `spin_idle` (deployments' default) a thread looks at idle priority: other work of the machine
goes first, and runs on the looking rank's core rather than on a computing one's (spin.py).

Same semantics as the other transports (base.py):
  * send never blocks on the peer: what does not fit in the ring waits in this process and a
    flusher thread feeds it in as the reader makes room (so a message bigger than the ring takes
    several turns); past `max_pending_bytes` waiting for one peer, send raises CommError;
  * peers start in any order: whichever side comes first creates the ring and the FIFO, and a
    message sent before its receiver exists is read when it starts;
  * FIFO per (source, kind), key checks, recv_any, timeouts: the shared `Inbox`;
  * a message to this endpoint itself goes straight into its inbox (tensors cloned, onto the
    payload device where there is one);
  * close() fails pending receives, lingers up to `linger_s` to flush, removes the rings it reads
    and its FIFO (and the rings it wrote that no reader ever opened); messages to an endpoint that
    has closed are dropped, as a closed ZeroMQ peer's would be.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterable

import torch

from comm.messages import CommError, Message, MsgKey
from comm.transport.base import Inbox, Transport, claim, make_inbox, own_copy, payload_device_of
from comm.transport.ipc_medium import CudaIpcMedium
from comm.transport.ring_medium import DEFAULT_PAYLOAD_CAPACITY, HostMedium, HostTensorMedium
from comm.transport.shm_outbox import Outbox
from comm.transport.shm_ring import ASLEEP, ATTACHED, CLOSED, HEADER_BYTES, FrameReader, platform_supported
from comm.transport.shm_wake import Doorbells, WakeFifo, full_fence
from comm.transport.spin import SpinPolicy

SHM_DIR = "/dev/shm"
DEFAULT_CAPACITY = 4 << 20  # bytes per ring: decode messages are far smaller; prefill ones stream through


def ring_path(directory: str, namespace: str, src: int, dst: int, incarnations: dict[int, int] | None = None) -> str:
    """The ring from src to dst; where either end is a replacement process (incarnation > 0), a
    name of that pair of incarnations (both ends name it alike, and no old ring has it)."""
    inc = incarnations or {}
    pair = (inc.get(src, 0), inc.get(dst, 0))
    return f"{directory}/afd-{namespace}-{src}to{dst}" + (f"-{pair[0]}.{pair[1]}" if any(pair) else "")


def wake_path(ring: str) -> str:
    return f"{ring}.wake"


def make_medium(device: torch.device | None, capacity: int = DEFAULT_PAYLOAD_CAPACITY) -> HostMedium:
    """A new medium for one end of one ring (ring_medium.py): None -> bytes in the frames, cpu -> the
    host twin, cuda -> CUDA IPC."""
    if device is None:
        return HostMedium()
    if device.type == "cpu":
        return HostTensorMedium(capacity)
    return CudaIpcMedium(device, capacity)


class ShmTransport(Transport):
    """endpoint: this endpoint's id; peers: the endpoints on this host it talks to; namespace: a
    name shared by the endpoints of one deployment and no other (its files' prefix);
    pump_in_waiter: the waiting thread reads the rings (default), else a receiver thread does (see
    the module docstring); spin_s: before it blocks in poll(), the reading thread looks at the rings
    for up to this long, yielding the core between looks (see "Spinning" above); spin_idle: it
    looks at idle priority where the OS allows (spin.py); payload_device: where the tensors of a
    frame travel and arrive (ring_medium.py): None (default) as bytes inside the frames, "cpu" in a
    payload area of `payload_capacity` bytes per ring in host shared memory (the CPU twin of the
    device path), a CUDA device in a payload area of that size in GPU memory shared by CUDA IPC;
    with a device, every received tensor is on it (`Transport.payload_device`)."""

    def __init__(
        self,
        endpoint: int,
        peers: Iterable[int],
        *,
        namespace: str,
        directory: str = SHM_DIR,
        capacity: int = DEFAULT_CAPACITY,
        link_delay_s: float = 0.0,
        inbox: Inbox | None = None,
        max_pending_bytes: int = 1 << 30,
        linger_s: float = 1.0,
        pump_in_waiter: bool = True,
        spin_s: float = 0.0,
        spin_idle: bool = False,
        incarnations: dict[int, int] | None = None,
        payload_device: str | torch.device | None = None,
        payload_capacity: int = DEFAULT_PAYLOAD_CAPACITY,
    ) -> None:
        if not platform_supported():
            raise CommError("the shared-memory transport needs x86-64 (ordered stores); use the zmq transport")
        if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", namespace):
            raise CommError(f"shared-memory namespace {namespace!r}: use 1-64 letters, digits or _")
        if spin_s < 0:
            raise CommError(f"spin_s must be >= 0, got {spin_s}")
        self._spin = SpinPolicy(spin_s, idle=spin_idle)
        self.payload_device = payload_device_of(payload_device)
        self._payload_capacity = payload_capacity
        self._claims = self.payload_device is not None and self.payload_device.type == "cuda"
        self.endpoint, self.peers = endpoint, sorted(set(peers) - {endpoint})
        self._linger_s = linger_s
        self._inbox = inbox if inbox is not None else make_inbox(endpoint, link_delay_s)
        self._pumped = pump_in_waiter and inbox is None and link_delay_s <= 0  # else a receiver thread
        self._lock = threading.Lock()  # guards _closed
        self._pump_lock = threading.Lock()  # the reading side of the rings: one thread at a time
        self._closed = False
        self._bells = Doorbells()
        self._readers: list[tuple[FrameReader, WakeFifo]] = []
        self._reader_of: dict[int, tuple[FrameReader, WakeFifo]] = {}
        self._outboxes: dict[int, Outbox] = {}
        self._rings = (directory, namespace, capacity, max_pending_bytes)
        self.incarnations = dict(incarnations or {})
        try:  # every ring and FIFO now, so that nothing is created on the hot path
            for src in self.peers:
                self._open_reader(src)
            for dst in self.peers:
                self._open_outbox(dst)
        except BaseException:
            self._release()
            raise
        self._receiver = None
        if not self._pumped:
            self._receiver = threading.Thread(target=self._receive_loop, name=f"shm-recv-{endpoint}", daemon=True)
            self._receiver.start()

    def _open_reader(self, src: int) -> None:
        directory, namespace, capacity, _ = self._rings
        path = ring_path(directory, namespace, src, self.endpoint, self.incarnations)
        medium = make_medium(self.payload_device, self._payload_capacity)
        reader = FrameReader(medium.open(path, capacity), medium)
        wake = WakeFifo(wake_path(path))
        self._readers.append((reader, wake))
        self._reader_of[src] = (reader, wake)
        self._bells.add(wake)
        reader.ring.set_flag(ATTACHED)

    def _open_outbox(self, dst: int) -> None:
        directory, namespace, capacity, max_pending = self._rings
        path = ring_path(directory, namespace, self.endpoint, dst, self.incarnations)
        medium = make_medium(self.payload_device, self._payload_capacity)
        medium.open(path, capacity)
        self._outboxes[dst] = Outbox(medium, WakeFifo(wake_path(path)), dst, max_pending)

    def readmit(self, peer: int, address: str, host: str, incarnation: int) -> None:
        """Fresh rings to and from a replacement of `peer` (its host must be this one's). Nothing
        changes where this endpoint already knows `peer` under that incarnation: the rings it has
        are the ones the peer opens (two replacements that started together)."""
        if host != host_id(self._rings[0]):
            raise CommError(
                f"endpoint {self.endpoint} reaches its peers through shared memory only; the replacement of "
                f"endpoint {peer} offers none to it (it runs on another machine, or /dev/shm had no room for it)"
            )
        with self._pump_lock:
            if self.incarnations.get(peer, 0) == incarnation and peer in self._reader_of:
                return
            self._drop_peer(peer)
            self.incarnations[peer] = incarnation
            self.peers = sorted(set(self.peers) | {peer})
            self._open_reader(peer)
            self._open_outbox(peer)

    def _drop_peer(self, peer: int) -> None:
        """Closes the rings of `peer` (call with the pump lock held) and forgets what it sent."""
        old = self._reader_of.pop(peer, None)
        if old is not None:
            reader, wake = old
            self._readers.remove(old)
            self._bells.remove(wake)
            reader.ring.set_flag(CLOSED)  # a lost writer that comes back drops what it would send
            reader.close()
            reader.ring.unlink()
            wake.close()
            wake.unlink()
        out = self._outboxes.pop(peer, None)
        if out is not None:
            out.close(0.0)
        self.peers = [p for p in self.peers if p != peer]
        self._inbox.forget(peer)

    # -- Transport -------------------------------------------------------------------------

    def send(self, dst: int, msg: Message) -> None:
        if self._closed:
            raise CommError(f"endpoint {self.endpoint}: send to {dst} after close()")
        if dst == self.endpoint:
            own = own_copy(msg, self.payload_device)
            if self._inbox.put(own):  # the thread waiting for it pumps, maybe blocked in poll()
                self._bells.ring()
            return
        out = self._outboxes.get(dst)
        if out is None:
            raise CommError(f"endpoint {self.endpoint}: endpoint {dst} is not a shared-memory peer ({self.peers})")
        out.send(msg)

    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        return self.recv_any([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        srcs = list(srcs)
        # A thread waiting only for messages this endpoint sends itself never pumps: the put wakes it
        # directly, and the pumping is left to a thread waiting for a peer (one wake-up, not two).
        remote = self._pumped and any(src != self.endpoint for src in srcs)
        msg = self._inbox.take(srcs, kind, key, timeout, self._pump if remote else None)
        return claim(msg) if self._claims else msg

    def close(self) -> None:
        """Fails pending receives, flushes what waits to be sent (at most `linger_s`), removes this
        endpoint's files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.fail(CommError("transport closed"))
        self._bells.ring()  # a thread blocked waiting for a wake-up returns at once
        if self._receiver is not None:
            self._receiver.join()
        deadline = time.monotonic() + self._linger_s
        for out in self._outboxes.values():
            out.close(max(deadline - time.monotonic(), 0.0))
        with self._pump_lock:  # no thread reads the rings any more
            self._release()

    def _release(self) -> None:
        for reader, wake in self._readers:
            reader.ring.set_flag(CLOSED)  # senders drop what they would still send
            reader.close()
            reader.ring.unlink()
            wake.close()
            wake.unlink()
        for out in self._outboxes.values():
            out.close(0.0)
        self._bells.close()

    # -- receiving -------------------------------------------------------------------------

    def _pump(self, seconds: float) -> None:
        """Moves every message completed in the rings into the inbox, waiting up to `seconds` for a
        wake-up byte if there was none."""
        with self._pump_lock:
            if self._closed:
                return
            try:
                if self._read_rings() or seconds <= 0:
                    return
                start = time.perf_counter()
                window = self._spin.window(seconds)
                if not (window > 0 and self._look(window) and self._read_rings()):
                    self._sleep(seconds)
                self._spin.record(time.perf_counter() - start)
            except Exception as e:  # a broken frame: every waiter fails, not only this one
                self._inbox.fail(CommError(f"reading the shared-memory rings failed: {e!r}"))
                raise

    def _sleep(self, seconds: float) -> None:
        """Blocks in poll() until a wake-up byte (or `seconds`), then reads the rings. Writers write
        that byte only while the ring's asleep flag is up (shm_ring.py), so the flags go up first
        and the rings are looked at once more after a fence: what a writer published before it
        could see the flag is read here, not slept through."""
        for reader, _ in self._readers:
            reader.ring.set_flag(ASLEEP)
        full_fence()
        try:
            if not self._read_rings():
                # Bytes are cleared only after poll() returns, and the caller then looks at the
                # inbox again: a message put there (sent to itself) before its byte was cleared
                # is seen. Clearing first would lose that wake-up.
                self._bells.wait(seconds)
        finally:
            for reader, _ in self._readers:
                reader.ring.set_flag(ASLEEP, False)
        if not self._closed:
            self._read_rings()

    def _look(self, seconds: float) -> bool:
        """Whether a ring got bytes within `seconds` of looking (no wake-up byte needed)."""
        end = time.perf_counter() + seconds
        with self._spin.looking(seconds):  # at idle priority with spin_idle (spin.py)
            while time.perf_counter() < end:
                for reader, _ in self._readers:
                    if reader.ring.readable():
                        return True
                os.sched_yield()  # another runnable thread or process on this core goes first (GIL released)
        return False

    def _read_rings(self) -> int:
        count = 0
        for reader, _ in self._readers:
            for msg in reader.read():
                self._inbox.put(msg)
                count += 1
        return count

    def _receive_loop(self) -> None:
        try:
            while not self._closed:
                self._pump(1.0)
        except Exception:  # noqa: BLE001 - _pump has failed the inbox already
            pass


def host_id(directory: str = SHM_DIR) -> str:
    """Equal for two processes exactly when they can share memory under `directory`: the same
    running kernel (boot id) and the same mount there. "" where this transport cannot run."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(directory)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}" if platform_supported() else ""


def fits(num_rings: int, capacity: int = DEFAULT_CAPACITY, directory: str = SHM_DIR) -> bool:
    """Whether `directory` has room for num_rings rings, with half of it left for others (with the
    host twin's payload areas, count them in `capacity`)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return False
    return num_rings * (HEADER_BYTES + capacity) <= free // 2


def remove_namespace(namespace: str, directory: str = SHM_DIR) -> list[str]:
    """Removes what endpoints of `namespace` left in directory (after a rank was killed); returns the names."""
    prefix = f"afd-{namespace}-"
    names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    for name in names:
        _unlink(os.path.join(directory, name))
    return names


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
