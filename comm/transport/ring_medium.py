"""Where the tensors of a shared-memory ring's frames live: the ring's medium.

A ring (shm_ring.py) is a byte stream in host shared memory with its counters, flags and wake-up
FIFO; frames are written, read, ordered and woken for in the same way whatever the medium. The
medium, chosen when the transport is made (`ShmTransport(payload_device=...)`), decides where a
frame's tensors go:

    medium              payload_device   a frame's tensors
    HostMedium          None (default)   their bytes inside the frame, in the host ring
    HostTensorMedium    "cpu"            a payload area in host shared memory (the ring file's
                                         medium region), addressed as a CPU uint8 tensor
    CudaIpcMedium       cuda:i           a payload area in one CUDA allocation, shared by CUDA IPC

The payload media share all their logic (`PayloadMedium`): the area is a uint8 tensor used as a
ring of its own (its head and tail are slots of the host header, PHEAD and PTAIL); a frame carries
the message's header and the span [start, end) of the area its tensors fill, each at a 64-byte
aligned offset, in order, not their bytes. A span never wraps around the area's end: it starts
over at 0 and the bytes skipped count as used. The host twin exists so that the CPU tests run the
very code the CUDA medium runs; the two differ only in where the area is allocated, how the peer
maps it (ipc_medium.py) and the device synchronization.

    frame body: u32 header length | PAYLOAD_FRAME, msgpack header, u64 start, u64 end

Writer (in `send`, or in the flusher thread for a frame that waited): takes room in the area,
`copy_`s each tensor into a view of it, makes the copies visible, and only then publishes the
small frame in the host ring. In host memory the copies are plain stores, seen before the frame
as the ring's own bytes are (shm_ring.py). For CUDA, "visible" is an event recorded after the
copies on the current stream and synchronized: one host wait per message, until the tensors are
computed and copied (as `.cpu()` waited before). Reader (the thread that reads the rings): clones each tensor
out of the area onto its own device, then releases the span (PTAIL) for the writer to reuse. For
CUDA the clones run on a stream of the reader's own, so they do not queue behind the compute the
reading thread may have queued, and are synchronized before the release: a host wait on the
reader per message, as long as the clones take. Received tensors are the receiver's own; nothing
handed out keeps a reference to the area.

Interprocess events (`torch.cuda.Event(interprocess=True)`) would turn both waits into device
waits: the writer would publish an event that the reader's stream waits on, and the reader one
that the writer waits on before it reuses a span. That is the next step.

A frame larger than the whole area goes as a byte frame in the host ring (its tensors cross the
host, in turns where it is longer than the host ring), and the reader moves its tensors to its
device: it arrives whole, without the device path (`inline` counts such frames). A frame that fits
but finds the area full waits for room, as bytes wait for room in the host ring.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

import torch

from comm.messages import CommError, MalformedMessage, Message
from comm.transport.shm_ring import ALIGN, PHEAD, PTAIL, Ring, _unlink, decode_body, encode_frame

HOST_BYTES, HOST_TENSOR, CUDA_IPC = 0, 1, 2  # medium codes in the ring header (slot MEDIUM)
DEFAULT_PAYLOAD_CAPACITY = 64 << 20  # bytes of payload area per ring: a DeepSeek-V3 dispatch of 4,096 tokens fits
PAYLOAD_FRAME = 1 << 31  # set in a frame's u32 header length: its tensors are in the payload area
_PREFIX = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_SPAN = struct.Struct("<QQ")


class HostMedium:
    """Where one ring's payloads live, as one of its two ends sees it (each end has its own medium
    object). This one: the tensors' bytes inside the frames, in the host ring (shm_ring.py)."""

    kind = HOST_BYTES
    device: torch.device | None = None

    def __init__(self) -> None:
        self.ring: Ring | None = None

    def region_bytes(self) -> int:
        """Bytes of the ring file's medium region this medium needs when it creates the ring."""
        return 0

    def open(self, path: str, capacity: int) -> Ring:
        """Opens the ring at path (made if missing) and attaches this medium to it."""
        ring = Ring(path, capacity, self.kind, self.region_bytes())
        try:
            self._attach(ring)
        except BaseException:
            ring.close()
            if ring.created:  # the peer never maps a ring whose creator failed
                _unlink(path)
            raise
        self.ring = ring
        return ring

    def _attach(self, ring: Ring) -> None:
        pass

    def write_frame(self, msg: Message) -> bool:
        """Writes msg's frame and publishes it if there is room now; else writes nothing, False."""
        return self.ring.write_frame(msg)

    def waiting(self, msg: Message) -> deque[memoryview] | Waiting:
        """What waits in the outbox in msg's place: the frame's bytes as parts (written in turns),
        or the message itself (written whole once there is room)."""
        return encode_frame(msg)

    def write_waiting(self, item: Waiting) -> bool:
        raise NotImplementedError  # this medium never makes a `Waiting`

    def decode(self, body: memoryview) -> Message:
        """A frame's body (read out of the host ring) -> its message, whose tensors are the receiver's."""
        return decode_body(body)

    def close(self) -> None:
        """Lets go of the payloads and unmaps the ring (the file stays)."""
        if self.ring is not None:
            self.ring.close()


@dataclass
class Waiting:
    """A message waiting for room in the payload area; its tensors are not copied yet. `ready`:
    CUDA events recorded at send on the streams that compute its tensors (the flusher thread
    copies them, and first waits for these)."""

    msg: Message
    size: int  # bytes: its frame in the host ring and its span in the area
    ready: list = field(default_factory=list)


class PayloadMedium(HostMedium):
    """The tensors in a payload area of `capacity` bytes (the creator's figure; the other end takes
    the area's size from it), received onto `device`. Subclasses say where the area is."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        super().__init__()
        if capacity < ALIGN:
            raise CommError(f"a payload area needs at least {ALIGN} bytes, got {capacity}")
        self.device = device
        self.capacity = capacity - capacity % ALIGN
        self.area: torch.Tensor | None = None  # uint8; None where the reader had closed at attach
        self.inline = 0  # frames too large for the area, sent as bytes in the host ring
        self._phead = 0

    # -- where the area is, and the device's synchronization (subclasses) ------------------

    def _map(self, ring: Ring) -> torch.Tensor | None:
        """The payload area of ring, as a flat uint8 tensor."""
        raise NotImplementedError

    def _ready_events(self, msg: Message) -> list:
        """Events that the flusher waits for before it copies a waiting message's tensors."""
        return []

    def _copied(self) -> None:
        """After the writer's copies: returns once they are visible to the reader."""

    def _take(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The receiver's own copies of views of the area, on `device`, complete on return."""
        return [v.clone() for v in views]

    def _own(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors of a byte frame (the receiver's already) moved to `device`."""
        return tensors

    # -- the ring logic, the same for every payload medium ---------------------------------

    def _attach(self, ring: Ring) -> None:
        self.area = self._map(ring)
        self._phead = ring.load(PHEAD)

    @property
    def area_bytes(self) -> int:
        return self.area.numel() if self.area is not None else self.capacity

    def write_frame(self, msg: Message, ready: list = ()) -> bool:
        tensors = [t for t in msg.tensors if t.numel()]
        offsets, size = _place(tensors)
        if size > self.area_bytes:  # never fits: as bytes, through the host ring
            if self.ring.write_frame(msg):
                self.inline += 1
                return True
            return False
        if self.area is None:  # the reader had closed when this end opened: dropped, as writes to it are
            return True
        cap = self.area.numel()
        start = self._phead
        pos = start % cap
        if pos + size > cap:  # a span never wraps: start over at 0
            start, pos = start + cap - pos, 0
        end = start + size
        header = msg.header()
        data = _PREFIX.pack(4 + len(header) + _SPAN.size) + _U32.pack(len(header) | PAYLOAD_FRAME) + header
        if end - self.ring.load(PTAIL) > cap or len(data) + _SPAN.size > self.ring.free():
            return False
        for event in ready:
            event.synchronize()
        for t, at in zip(tensors, offsets):
            _view(self.area, pos + at, t.dtype, t.shape).copy_(t.detach())
        self._copied()
        self.ring.write_whole(data + _SPAN.pack(start, end))  # room checked above; this end alone writes
        self._phead = end
        self.ring.store(PHEAD, end)
        return True

    def waiting(self, msg: Message) -> deque[memoryview] | Waiting:
        tensors = [t for t in msg.tensors if t.numel()]
        _, size = _place(tensors)
        if size > self.area_bytes:
            self.inline += 1
            return encode_frame(msg)
        frame = _PREFIX.size + _U32.size + len(msg.header()) + _SPAN.size
        return Waiting(msg, frame + size, self._ready_events(msg))

    def write_waiting(self, item: Waiting) -> bool:
        return self.write_frame(item.msg, item.ready)

    def decode(self, body: memoryview) -> Message:
        (length,) = _U32.unpack_from(body)
        if not length & PAYLOAD_FRAME:  # a frame too large for the area, as bytes
            msg = decode_body(body)
            msg.tensors = self._own(msg.tensors)
            return msg
        length ^= PAYLOAD_FRAME
        msg, specs = Message.parse_header(body[4 : 4 + length])
        start, end = _SPAN.unpack_from(body, 4 + length)
        if self.area is None:
            raise CommError(f"ring {self.ring.path}: a frame points into a payload area this end never mapped")
        cap = self.area.numel()
        pos, size = start % cap, end - start
        if not 0 <= size <= cap - pos:
            raise MalformedMessage(f"payload span [{start}, {end}) does not fit an area of {cap} bytes")
        views, at = [], 0
        for dtype, shape in specs:
            n = _numel(shape) * dtype.itemsize
            if n:
                at += -at % ALIGN
                if at + n > size:
                    raise MalformedMessage(f"the tensors of a frame overrun its payload span of {size} bytes")
                views.append(_view(self.area, pos + at, dtype, shape))
                at += n
        taken = iter(self._take(views))
        msg.tensors = [
            next(taken) if _numel(shape) else torch.empty(shape, dtype=dtype, device=self.device)
            for dtype, shape in specs
        ]
        self.ring.store(PTAIL, end)  # after the copies are complete: the writer may reuse the span
        return msg

    def close(self) -> None:
        self.area = None  # before the ring unmaps: the host twin's area is a view of its mapping
        super().close()


class HostTensorMedium(PayloadMedium):
    """The payload area in host shared memory: the ring file's medium region, as a CPU tensor (the
    CPU twin of the device medium: the same ring logic, tested without a GPU)."""

    kind = HOST_TENSOR

    def __init__(self, capacity: int = DEFAULT_PAYLOAD_CAPACITY) -> None:
        super().__init__(torch.device("cpu"), capacity)

    def region_bytes(self) -> int:
        return self.capacity

    def _map(self, ring: Ring) -> torch.Tensor:
        return torch.from_numpy(ring.region())  # the region's size comes from the file: the creator's


def _place(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each non-empty tensor's offset in a span (64-byte aligned, in order), and the span's bytes
    (a multiple of 64, so that every span starts aligned)."""
    offsets, at = [], 0
    for t in tensors:
        at += -at % ALIGN
        offsets.append(at)
        at += t.nbytes
    return offsets, at + -at % ALIGN


def _view(area: torch.Tensor, at: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The bytes of area from `at` as a contiguous tensor of dtype and shape."""
    n = _numel(shape) * dtype.itemsize
    return area[at : at + n].view(dtype).view(shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
