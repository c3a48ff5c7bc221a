"""Transport over torch.distributed point-to-point: NCCL on GPUs (RDMA between machines, NVLink
inside one), gloo on CPUs (tests, CPU-only deployments).

Endpoint id = global rank. The caller initialises the default process group (see
`init_torch_dist`); constructing a TorchDistTransport is then a collective: every rank of the
default group must construct one, with the same device type, because it creates subgroups.

Wire protocol, per message: a fixed-size int64 header tensor (HEADER_BYTES: word 0 is the
length of the msgpack `Message.header()`, the following words carry its bytes), then each non-empty
payload tensor as raw bytes (a flat uint8 view, so every dtype travels, float8 included, even
where the backend knows nothing of the dtype). Empty tensors are not sent at all: the header
already says their dtype and shape.

Receiving without any-source: NCCL cannot receive from "any source", and gloo can but gives a
receive neither a timeout that leaves the connection usable nor a completion query that works
(both tried with torch 2.13). So each peer gets its own receiver thread doing blocking receives
from that peer only (a header, then the payload it announces), and its own sender thread fed
by a queue, so that `send` never blocks and one slow peer never holds up the others. This works
the same on both backends.

Headers always travel over gloo (CPU), payloads over the default backend on `device`:
  * a header receive is posted at all times; on the CPU it costs a sleeping thread, whereas a
    posted NCCL receive is a GPU kernel spinning on SMs, and the header must reach the CPU
    anyway to be decoded;
  * NCCL receives are then posted only for payloads that are on their way.
On CPUs the header and payload subgroups are the same.

One subgroup per ordered pair (a -> b), for headers and for payloads: NCCL runs all operations
between two ranks of one communicator on one stream, in order, so a receive from a peer posted
just before a send to it waits for the peer's send, which may sit behind the peer's own receive:
deadlock. A communicator that carries only one direction never queues a send behind a receive.
It costs n*(n-1) subgroups per kind (NCCL creates each communicator lazily on first use). On
GPUs every thread uses its own CUDA stream, so a transfer never stalls the compute stream.

The subgroups get `backend_timeout_s` (default: a year) instead of the default group's timeout:
gloo and NCCL tear a connection down when a receive waits longer than that, and the header
receive waits through every idle period. Our own waits are bounded by the receive timeouts.

Shutdown: close() sends a control message to every peer, so that the peer's receiver thread for
us returns; our receiver threads return when the peers close in turn (close() waits for them
at most `close_timeout_s`). Call close() on every rank before `dist.destroy_process_group()`.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from comm.messages import CommError, Message, MsgKey
from comm.transport.base import Inbox, Transport, payload_device_of

HEADER_BYTES = 4096
_CLOSE = "__close__"  # control message kind: the sender is closing, stop receiving from it


def init_torch_dist(
    backend: str, rank: int, world_size: int, init_method: str, timeout_s: float = 60.0, device_id: str | None = None
) -> None:
    """Initialises the default process group (e.g. "gloo", "tcp://127.0.0.1:29500")."""
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": torch.device(device_id)} if device_id else {}),
    )


def pack_header(msg: Message) -> torch.Tensor:
    """msg's header as an int64 CPU tensor of HEADER_BYTES: [length, bytes...]."""
    raw = msg.header()
    if len(raw) > HEADER_BYTES - 8:
        raise CommError(
            f"{msg.kind} {msg.key}: header of {len(raw)} bytes exceeds {HEADER_BYTES - 8}; "
            "keep meta small and send large data as tensors"
        )
    head = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
    head[0] = len(raw)
    head[1:].view(torch.uint8)[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return head


def unpack_header(head: torch.Tensor) -> tuple[Message, list[tuple[torch.dtype, list[int]]]]:
    """The message (without its tensors) and its tensors' (dtype, shape)."""
    head = head.cpu()
    return Message.parse_header(head[1:].view(torch.uint8)[: int(head[0])].numpy().tobytes())


def _wire_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t's raw bytes as a flat uint8 tensor on device (flattened first: 0-dim tensors too)."""
    return t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


class TorchDistTransport(Transport):
    """device: where payloads travel and arrive ("cpu" for gloo, "cuda:N" for NCCL).
    peers: the ranks this endpoint exchanges messages with (default: every other rank).

    On GPUs, received tensors are complete when delivered, but were allocated on the receiver
    thread's stream: a consumer that frees one while its own stream may still read it must call
    `tensor.record_stream(its_stream)` first, as with any tensor crossing streams."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        peers: Iterable[int] | None = None,
        close_timeout_s: float = 2.0,
        backend_timeout_s: float = 365 * 24 * 3600.0,
    ) -> None:
        if not dist.is_initialized():
            raise CommError("TorchDistTransport needs dist.init_process_group (see init_torch_dist) first")
        self.endpoint, self.device = dist.get_rank(), torch.device(device)
        if self.device.type in ("cpu", "cuda"):  # payloads arrive there, messages to itself too
            self.payload_device = payload_device_of(self.device)
        world = dist.get_world_size()
        self.peers = sorted(set(range(world) if peers is None else peers) - {self.endpoint})
        self._close_timeout_s = close_timeout_s
        timeout = datetime.timedelta(seconds=backend_timeout_s)
        self._head_groups = _ordered_pair_groups(world, "gloo", timeout)
        self._data_groups = (
            self._head_groups if self.device.type == "cpu" else _ordered_pair_groups(world, None, timeout)
        )
        self._inbox = Inbox(self.endpoint)
        self._queues: dict[int, queue.Queue] = {}
        self._senders: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()  # guards _queues/_senders creation and _closed
        self._closed = False
        self._error: CommError | None = None
        self._closed_peers: set[int] = set()  # peers whose close message arrived: nobody receives for us there
        self._close_head = pack_header(Message(_CLOSE, MsgKey(0, 0, 0), self.endpoint))
        self._receivers = [self._thread(self._receive_loop, peer, "recv") for peer in self.peers]

    # -- Transport -------------------------------------------------------------------------

    def send(self, dst: int, msg: Message) -> None:
        if self._error is not None:
            raise CommError(f"endpoint {self.endpoint}: {self._error}")
        if dst == self.endpoint:  # no self-send in torch.distributed: deliver directly
            self._inbox.put(
                Message(msg.kind, msg.key, msg.src, [t.to(self.device, copy=True) for t in msg.tensors], dict(msg.meta))
            )
            return
        if dst in self._closed_peers:
            raise CommError(f"endpoint {self.endpoint}: endpoint {dst} has closed its transport")
        head = pack_header(msg)  # raises here, in the caller, if the header is too big
        payload = [_wire_bytes(t, self.device) for t in msg.tensors if t.numel()]
        self._queue(dst).put((head, payload, self._ready_event()))

    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        return self._inbox.take([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        return self._inbox.take(srcs, kind, key, timeout)

    def close(self) -> None:
        """Fails pending receives, tells every peer we are closing, and waits (bounded) for the
        sender threads to flush and for the peers' close messages. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._inbox.fail(CommError("transport closed"))
            for peer in self.peers:
                self._queue_locked(peer).put((self._close_head, [], None))
            self._closed = True
        deadline = time.monotonic() + self._close_timeout_s
        for thread in [*self._senders.values(), *self._receivers]:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- sending ---------------------------------------------------------------------------

    def _queue(self, dst: int) -> queue.Queue:
        with self._lock:
            if self._closed:
                raise CommError(f"endpoint {self.endpoint}: send to {dst} after close()")
            return self._queue_locked(dst)

    def _queue_locked(self, dst: int) -> queue.Queue:
        """dst's send queue; its sender thread starts on first use."""
        if dst not in self._queues:
            if dst not in self.peers:
                raise CommError(f"endpoint {self.endpoint}: {dst} is not a peer (peers: {self.peers})")
            self._queues[dst] = queue.Queue()
            self._senders[dst] = self._thread(self._send_loop, dst, "send")
        return self._queues[dst]

    def _ready_event(self):
        """On GPUs, an event marking when the caller's stream has produced the payload."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _send_loop(self, dst: int) -> None:
        head_group, data_group = self._head_groups[(self.endpoint, dst)], self._data_groups[(self.endpoint, dst)]
        q = self._queues[dst]
        with _thread_stream(self.device):
            while True:
                head, payload, ready = q.get()
                dist.send(head, dst, group=head_group)
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                for tensor in payload:
                    dist.send(tensor, dst, group=data_group)
                _synchronize(self.device)  # the buffers may be freed once the sends are done
                if head is self._close_head:
                    return

    # -- receiving -------------------------------------------------------------------------

    def _receive_loop(self, src: int) -> None:
        head_group, data_group = self._head_groups[(src, self.endpoint)], self._data_groups[(src, self.endpoint)]
        with _thread_stream(self.device):
            while True:
                head = torch.empty(HEADER_BYTES // 8, dtype=torch.int64)
                dist.recv(head, src, group=head_group)
                msg, specs = unpack_header(head)
                if msg.kind == _CLOSE:
                    self._closed_peers.add(src)
                    return
                self._inbox.put(self._receive_message(msg, specs, src, data_group))

    def _receive_message(self, msg: Message, specs: list, src: int, group) -> Message:
        msg.tensors = [self._receive_tensor(dtype, shape, src, group) for dtype, shape in specs]
        _synchronize(self.device)  # the consumer may run on another stream
        return msg

    def _receive_tensor(self, dtype: torch.dtype, shape: list[int], src: int, group) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        if numel == 0:  # empty tensors are not sent
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src, group=group)
        return buf.view(dtype).view(shape)

    # -- threads ---------------------------------------------------------------------------

    def _thread(self, loop, peer: int, role: str) -> threading.Thread:
        thread = threading.Thread(
            target=self._guard, args=(loop, peer, role), daemon=True, name=f"torch-dist-{role}-{self.endpoint}-{peer}"
        )
        thread.start()
        return thread

    def _guard(self, loop, peer: int, role: str) -> None:
        """Runs a sender/receiver loop; a failure (a crashed peer, a backend error) fails every
        pending and later receive, and every later send, instead of being lost in a thread."""
        try:
            loop(peer)
        except Exception as e:  # noqa: BLE001 - the thread's end: the error goes to the inbox
            if not self._closed:
                self._error = CommError(f"{role} with endpoint {peer} failed: {e}")
                self._inbox.fail(self._error)


def _ordered_pair_groups(world: int, backend: str | None, timeout: datetime.timedelta) -> dict[tuple[int, int], object]:
    """(a, b) -> a 2-rank subgroup that carries a -> b traffic only. A collective: every rank
    creates every group, in the same order (a rank outside a group gets a placeholder)."""
    groups = {}
    for a in range(world):
        for b in range(a + 1, world):
            for pair in ((a, b), (b, a)):
                groups[pair] = dist.new_group([a, b], backend=backend, timeout=timeout)
    return groups


def _thread_stream(device: torch.device):
    """On GPUs: this thread's own device and stream, so that a blocked transfer never stalls
    the compute stream. On CPUs: nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
    return stack


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
