"""What the shared-memory transport is made of: a ring (a byte stream in a file under /dev/shm) and the
framing of a `Message` as bytes in it (the FIFO that wakes its reader: shm_wake.py).

One ring carries one direction between two endpoints: one writer process, one reader process.
Each ring has its own wake-up FIFO (its path plus ".wake"), shared by the same two processes and
no other, so that the files of a pair can be removed by either of its ends without touching what
other endpoints use.

    file:  [ header: 256 B ][ medium region ][ data: capacity bytes, used cyclically ]
    header (uint64 slots):
            slot 0 head    bytes ever written (writer)      slot 1 payload head (writer)
            slot 8 tail    bytes ever read (reader)         slot 9 payload tail (reader)
                           (own 64-byte line: no false sharing)
            slot 16 attached   the reader has opened the ring
            slot 17 closed     the reader has closed: writes are dropped
            slot 18 medium     where the payloads live (ring_medium.py; 0: in the frames)
            slot 19 region     bytes of the medium region (0 without a medium)
            slot 20 published  bytes of the medium's descriptor in its region, once published
            slot 24 asleep     the reader may be blocked in poll(): a write must wake it

The header and the host ring are the same whatever the medium; the medium (ring_medium.py)
decides where a frame's tensors go: inside the frame (the default: the bytes this module frames),
or in a payload area of its own (host shared memory in the medium region, or device memory), the
frame then saying where. The medium and region slots are written before the file gets its name,
and an end that opens the ring checks that it expects the same medium.

head and tail only grow (uint64), so `head - tail` is what is waiting and `capacity - that` is free.
The writer copies bytes in and then publishes head; the reader copies bytes out and then publishes
tail. Each slot is one aligned 8-byte store, and x86-64 keeps stores in order and loads in order
(TSO), so a reader that sees a head also sees the bytes before it, and a writer that sees a tail
never overwrites bytes still being read; `platform_supported` says where that holds.

The wake-up FIFO and its protocol are in shm_wake.py.

A frame is u64 body length, then the body: u32 header length, the msgpack header of
`Message.header()`, and each tensor's raw bytes, each starting 64-byte aligned within the body
(the body is received into one buffer, whose slices become the tensors: no copy after the one
out of the ring). A frame that fits in the ring's free space is written straight from the
tensors' memory (`Ring.write_frame`: one copy per tensor, no padding written); one that does not
goes as parts (`encode_frame`) and takes several turns if it is longer than the ring.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from comm.messages import CommError, Message

HEADER_BYTES = 256
HEAD, TAIL, ATTACHED, CLOSED, ASLEEP = 0, 8, 16, 17, 24  # uint64 slots of the header
PHEAD, PTAIL, MEDIUM, REGION, PUBLISHED = 1, 9, 18, 19, 20  # the medium's slots (ring_medium.py)
ALIGN = 64
_PREFIX = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_ZEROS = memoryview(bytes(ALIGN))
_JOIN_BYTES = 64 << 10  # frames up to this size are joined into one part before the ring
_NUMPY_OF = {  # torch dtype -> numpy dtype, where numpy has it (bf16 and fp8 go as bytes)
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def platform_supported() -> bool:
    """Whether plain stores are seen in program order by other cores (the ring's assumption)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Ring:
    """A ring file, opened by whichever of its writer and reader comes first and created then.

    Creation is atomic: the file is sized under a temporary name and then hard-linked into place,
    so the other side never sees a half-made ring. The size comes from the file, so both sides
    agree on it even if only one was given `capacity` (the medium region's size too: the header
    says it). The side that opens the ring second removes its name at once: both have it mapped,
    and a process killed later leaves nothing behind. `medium`: the code of the payload medium
    (ring_medium.py) both ends must agree on; `region_bytes`: the bytes it needs after the header
    (taken from the file by the second end)."""

    def __init__(self, path: str, capacity: int, medium: int = 0, region_bytes: int = 0) -> None:
        self.path = path
        init = _medium_init(medium, region_bytes) if medium else None
        fd, self.created = _open_or_create(path, HEADER_BYTES + region_bytes + capacity, init)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._ctrl = memoryview(self._mm)[:HEADER_BYTES].cast("Q")
        if self._ctrl[MEDIUM] != medium:  # the name stays: the peer that made the ring is not at fault
            found = self._ctrl[MEDIUM]
            self._ctrl.release()
            self._mm.close()
            raise CommError(
                f"ring {path} carries payloads in medium {found}, this endpoint expects medium {medium}: "
                "give every endpoint of a host the same payload_device kind (None, cpu or cuda)"
            )
        if not self.created:
            _unlink(path)
        self.region_bytes = self._ctrl[REGION]
        start = HEADER_BYTES + self.region_bytes
        self.capacity = size - start
        self._data = memoryview(self._mm)[start:]
        self._whole = np.frombuffer(self._mm, dtype=np.uint8)  # for the data's address (write_frame)
        self._data_addr = self._whole.ctypes.data + start
        self._head = self._ctrl[HEAD]  # the writer's own copy: it alone moves head
        self._tail = self._ctrl[TAIL]  # the reader's own copy

    # -- header slots and the medium region ------------------------------------------------

    def load(self, slot: int) -> int:
        return self._ctrl[slot]

    def store(self, slot: int, value: int) -> None:
        self._ctrl[slot] = value

    def region(self) -> np.ndarray:
        """The medium region, as a uint8 array over the mapping (release it before `close`)."""
        return self._whole[HEADER_BYTES : HEADER_BYTES + self.region_bytes]

    # -- flags -----------------------------------------------------------------------------

    def flag(self, slot: int) -> bool:
        return bool(self._ctrl[slot])

    def set_flag(self, slot: int, value: bool = True) -> None:
        self._ctrl[slot] = int(value)

    # -- writer ----------------------------------------------------------------------------

    def write(self, parts: deque[memoryview]) -> int:
        """Copies as much of parts (in order) as fits and publishes it; what was written is
        removed from parts (a part written in part is replaced by its rest). Returns the bytes."""
        free = self.capacity - (self._head - self._ctrl[TAIL])
        written = 0
        while parts and free > 0:
            part = parts[0]
            n = min(free, len(part))
            self._copy_in(part[:n])
            written, free = written + n, free - n
            if n == len(part):
                parts.popleft()
            else:
                parts[0] = part[n:]
        if written:
            self._ctrl[HEAD] = self._head  # after the bytes: the reader never sees a head ahead of them
        return written

    def write_frame(self, msg: Message) -> bool:
        """Writes msg's whole frame and publishes it, copying each tensor once, straight from its
        own memory into the ring, if the frame fits in the free space now; else writes nothing and
        returns False (then `encode_frame` and `write` take it in turns). The same bytes as
        encode_frame's but for the alignment padding, which the reader skips unread."""
        header = msg.header()
        offset = 4 + len(header)
        copies = []  # (offset in the body, source address, bytes, the tensor kept alive)
        for t in msg.tensors:
            if t.numel():
                if not (t.is_cpu and t.is_contiguous()):
                    t = t.contiguous().cpu()
                offset += -offset % ALIGN
                copies.append((offset, t.data_ptr(), t.nbytes, t))
                offset += t.nbytes
        if _PREFIX.size + offset > self.capacity - (self._head - self._ctrl[TAIL]):
            return False
        start = self._head + _PREFIX.size
        self._copy_in(memoryview(_PREFIX.pack(offset) + _U32.pack(len(header)) + header))
        for at, addr, size, _ in copies:
            self._copy_from(start + at, addr, size)
        self._head = start + offset
        self._ctrl[HEAD] = self._head  # after the bytes: the reader never sees a head ahead of them
        return True

    def free(self) -> int:
        """Bytes the writer may write now."""
        return self.capacity - (self._head - self._ctrl[TAIL])

    def write_whole(self, data: bytes) -> bool:
        """Writes and publishes data if all of it fits now; else writes nothing and returns False."""
        if len(data) > self.free():
            return False
        self._copy_in(memoryview(data))
        self._ctrl[HEAD] = self._head  # after the bytes: the reader never sees a head ahead of them
        return True

    def _copy_from(self, at: int, addr: int, size: int) -> None:
        """Copies size bytes at address addr to stream position at (not yet published)."""
        pos = at % self.capacity
        first = min(size, self.capacity - pos)
        ctypes.memmove(self._data_addr + pos, addr, first)
        if first < size:
            ctypes.memmove(self._data_addr, addr + first, size - first)

    def _copy_in(self, src: memoryview) -> None:
        pos = self._head % self.capacity
        first = min(len(src), self.capacity - pos)
        self._data[pos : pos + first] = src[:first]
        if first < len(src):
            self._data[: len(src) - first] = src[first:]
        self._head += len(src)

    # -- reader ----------------------------------------------------------------------------

    def readable(self) -> int:
        return self._ctrl[HEAD] - self._tail

    def read_into(self, dst: memoryview) -> None:
        """Fills dst (at most `readable()` bytes) from the ring and frees that space."""
        pos, n = self._tail % self.capacity, len(dst)
        first = min(n, self.capacity - pos)
        dst[:first] = self._data[pos : pos + first]
        if first < n:
            dst[first:] = self._data[: n - first]
        self._tail += n
        self._ctrl[TAIL] = self._tail  # after the copy: the writer may now overwrite those bytes

    def close(self) -> None:
        """Unmaps the ring (the file stays; see `unlink`)."""
        self._ctrl.release()
        self._data.release()
        del self._whole  # its export of the mapping, before the mapping closes
        try:
            self._mm.close()
        except BufferError:  # a view of the medium region still lives: unmapped when it goes
            pass

    def unlink(self) -> None:
        _unlink(self.path)


class FrameReader:
    """Reassembles the frames of one ring into messages, across as many reads as they take."""

    def __init__(self, ring: Ring, medium=None) -> None:
        self.ring = ring
        self.medium = medium  # ring_medium.py's, which opened the ring; None: the frames hold the bytes
        self._decode = decode_body if medium is None else medium.decode
        self._prefix = bytearray(_PREFIX.size)
        self._view: memoryview | None = None  # the body of the frame being read
        self._filled = 0

    def read(self) -> list[Message]:
        """Every message completed by what the ring holds now."""
        done = []
        while True:
            avail = self.ring.readable()
            if self._view is None:
                if avail < _PREFIX.size:  # a length prefix is taken whole
                    return done
                self.ring.read_into(memoryview(self._prefix))
                self._start(_PREFIX.unpack(self._prefix)[0])
                avail -= _PREFIX.size
            n = min(avail, len(self._view) - self._filled)
            if n:
                self.ring.read_into(self._view[self._filled : self._filled + n])
                self._filled += n
            if self._filled < len(self._view):
                return done
            done.append(self._decode(self._view))
            self._view = None

    def close(self) -> None:
        """Unmaps the ring (through its medium, which lets go of its payload area first)."""
        (self.ring if self.medium is None else self.medium).close()

    def _start(self, length: int) -> None:
        self._view = memoryview(np.empty(length, dtype=np.uint8))  # 16-byte aligned: enough for any dtype
        self._filled = 0


def encode_frame(msg: Message) -> deque[memoryview]:
    """The frame of msg as parts to copy (the tensors' own memory: nothing is copied yet)."""
    header = msg.header()
    parts = deque([memoryview(struct.pack("<I", len(header))), memoryview(header)])
    offset = 4 + len(header)
    for t in msg.tensors:
        if t.numel():
            raw = _raw(t)
            pad = -offset % ALIGN
            parts.extend((_ZEROS[:pad], raw))
            offset += pad + len(raw)
    parts.appendleft(memoryview(_PREFIX.pack(offset)))
    if offset <= _JOIN_BYTES:  # one copy into a bytes object beats a copy into the ring per part
        return deque([memoryview(b"".join(parts))])
    return parts


def _raw(t: torch.Tensor) -> memoryview:
    """A non-empty tensor's bytes, without a copy where it is a contiguous CPU tensor (the common
    case; this is ~3x cheaper than Message.encode's general path, which matters per message)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    if t.requires_grad:
        t = t.detach()
    if t.dtype not in _NUMPY_OF:  # bf16, fp8: numpy has no such type, so as bytes
        t = t.reshape(-1).view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def decode_body(body: memoryview) -> Message:
    """A frame's body -> its message; the tensors share body's memory."""
    length = int.from_bytes(body[:4], "little")
    msg, specs = Message.parse_header(body[4 : 4 + length])
    offset = 4 + length
    for dt, shape in specs:
        n = _numel(shape)
        if n == 0:  # empty tensors take no bytes (and no padding)
            msg.tensors.append(torch.empty(shape, dtype=dt))
            continue
        offset += -offset % ALIGN
        np_dt = _NUMPY_OF.get(dt)
        if np_dt is not None:  # through numpy: about half torch.frombuffer's cost
            values = np.frombuffer(body, dtype=np_dt, count=n, offset=offset)
            msg.tensors.append(torch.from_numpy(values.reshape(shape)))
        else:
            msg.tensors.append(torch.frombuffer(body, dtype=dt, count=n, offset=offset).view(shape))
        offset += n * dt.itemsize
    return msg


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _medium_init(medium: int, region_bytes: int) -> Callable[[int], None]:
    """Writes a new ring's medium slots (before the file gets its name)."""

    def init(fd: int) -> None:
        os.pwrite(fd, struct.pack("<QQ", medium, region_bytes), 8 * MEDIUM)

    return init


def _open_or_create(path: str, size: int, init: Callable[[int], None] | None = None) -> tuple[int, bool]:
    """A read-write descriptor of the ring file at path, made with `size` bytes if missing (and
    `init(fd)` run on it before it is named); and whether this call made it."""
    try:
        return os.open(path, os.O_RDWR), False
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # reserves the memory now: a full /dev/shm fails here, not as SIGBUS later
        if init is not None:
            init(fd)
        os.link(tmp, path)
    except FileExistsError:  # the peer made it first: use theirs
        os.close(fd)
        return os.open(path, os.O_RDWR), False
    except OSError as e:
        os.close(fd)
        raise CommError(f"cannot create a {size}-byte ring at {path}: {e} (is /dev/shm large enough?)") from e
    finally:
        _unlink(tmp)
    return fd, True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
