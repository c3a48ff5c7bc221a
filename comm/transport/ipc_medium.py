"""A ring's payload area in memory that its creator allocates and its peer maps: CUDA IPC.

The ring logic is `PayloadMedium`'s (ring_medium.py); what this module adds is how the two ends
come to share one allocation, and the device's synchronization.

Publishing: the end that creates the ring (whichever comes first; peers start in any order)
allocates the area before the file exists, names the file (shm_ring.py), then exports the
allocation and writes the handle into the ring file's medium region (msgpack: its process id, a
token, the handle), and its length into the header slot PUBLISHED, after the bytes. The end that
opens the ring second waits for that slot (at most `MAP_WAIT_S`) and maps the handle. A writer
that finds its reader closed already maps nothing (its writes are dropped). A process cannot open
its own CUDA IPC handle: an end whose peer lives in the same process (tests; a rank talking to
itself never uses a ring) finds the allocation in `_LOCAL` by the token instead.

CUDA IPC is what torch.multiprocessing does for a CUDA tensor: the creator's
`UntypedStorage._share_cuda_()` gives the handle (device, memory handle, sizes, a reference counter
in host shared memory, an event after the allocation's last write), and the peer's
`UntypedStorage._new_shared_cuda(*handle)` maps it (its current stream waits for that event) and
counts itself in; the creator's allocation is freed once both ends have let go of it. Where the
peer never mapped it (it never started), it stays allocated until the creator exits. Two processes
on one GPU share it like this; on two GPUs of one machine the copies go peer to peer.

Streams: the writer copies on the current stream (where the tensors were computed) and waits for
an event after the copies; a message that waited for room is copied by the flusher thread after it
has waited for events recorded at send on the tensors' streams. The reader clones on a stream of
its own and waits for that; the received tensors were allocated on that stream, so the transport
marks them used on the consumer's current stream when it hands them out (`claim`, base.py).
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import msgpack
import numpy as np
import torch

from comm.messages import CommError, Message
from comm.transport.ring_medium import CUDA_IPC, PayloadMedium
from comm.transport.shm_ring import CLOSED, PUBLISHED, Ring

DESCRIPTOR_BYTES = 4096  # the medium region: room for the handle whatever the allocator puts in it
MAP_WAIT_S = 60.0  # how long an end that opens a ring second waits for its creator to publish
_LOCAL: dict[str, torch.Tensor] = {}  # token -> an area this process created (its peer may live here too)
_LOCAL_LOCK = threading.Lock()


class IpcMedium(PayloadMedium):
    """The payload area in an allocation exported by the ring's creator and imported by its peer.
    Subclasses give the three operations on the allocation (`_allocate`, `_export`, `_import`)."""

    kind = CUDA_IPC

    def __init__(self, device: torch.device, capacity: int) -> None:
        super().__init__(device, capacity)
        self._spare: torch.Tensor | None = None
        self._token: str | None = None

    def _allocate(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def _export(self, area: torch.Tensor) -> list:
        """A handle to area that `_import` in another process maps (msgpack-able)."""
        raise NotImplementedError

    def _import(self, handle: list) -> torch.Tensor:
        raise NotImplementedError

    def region_bytes(self) -> int:
        return DESCRIPTOR_BYTES

    def open(self, path: str, capacity: int) -> Ring:
        # allocated before the file exists, so that a creator publishes right after naming it (an
        # end that turns out to open the ring second lets the spare go)
        self._spare = self._allocate(self.capacity)
        try:
            return super().open(path, capacity)
        finally:
            self._spare = None

    def _map(self, ring: Ring) -> torch.Tensor | None:
        return self._publish(ring) if ring.created else self._map_published(ring)

    def _publish(self, ring: Ring) -> torch.Tensor:
        area, self._token = self._spare, secrets.token_hex(16)
        descriptor = msgpack.packb([os.getpid(), self._token, list(self._export(area))])
        if len(descriptor) > DESCRIPTOR_BYTES:
            raise CommError(f"the payload area's handle takes {len(descriptor)} bytes, more than {DESCRIPTOR_BYTES}")
        with _LOCAL_LOCK:
            _LOCAL[self._token] = area
        region = ring.region()
        region[: len(descriptor)] = np.frombuffer(descriptor, dtype=np.uint8)
        del region
        ring.store(PUBLISHED, len(descriptor))  # after the bytes: the peer never reads a partial handle
        return area

    def _map_published(self, ring: Ring) -> torch.Tensor | None:
        deadline = time.monotonic() + MAP_WAIT_S
        while not (length := ring.load(PUBLISHED)):
            if ring.flag(CLOSED):  # this end writes, and its reader has closed: nothing will be written
                return None
            if time.monotonic() > deadline:
                raise CommError(
                    f"ring {ring.path}: its creator published no payload area within {MAP_WAIT_S:g} s "
                    "(it failed or was killed while opening it)"
                )
            time.sleep(1e-3)
        if ring.flag(CLOSED):
            return None
        region = ring.region()
        pid, token, handle = msgpack.unpackb(region[:length].tobytes())
        del region
        if pid == os.getpid():
            with _LOCAL_LOCK:
                area = _LOCAL.get(token)
            if area is not None:
                return area
        try:
            return self._import(handle)
        except Exception as e:  # noqa: BLE001 - whatever the driver says, with the ring's name
            raise CommError(
                f"ring {ring.path}: cannot map the payload area of process {pid} ({e}); has it exited?"
            ) from e

    def close(self) -> None:
        if self._token is not None:
            with _LOCAL_LOCK:
                _LOCAL.pop(self._token, None)
            self._token = None
        super().close()


class CudaIpcMedium(IpcMedium):
    """The payload area in one CUDA allocation on the creator's device; tensors are received onto
    `device` (a CUDA device with its index)."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        super().__init__(device, capacity)
        torch.cuda.init()  # the CUDA context before the ring exists: a creator then publishes at once
        with torch.cuda.device(device):
            self._written = torch.cuda.Event()
            self._read = torch.cuda.Event()
            self._stream = torch.cuda.Stream(device)  # the reader's clones: not behind the reading thread's compute

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _export(self, area: torch.Tensor) -> list:
        with torch.cuda.device(area.device):
            return list(area.untyped_storage()._share_cuda_())

    def _import(self, handle: list) -> torch.Tensor:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*handle)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def _ready_events(self, msg: Message) -> list:
        events = []
        for device in {t.device for t in msg.tensors if t.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    def _copied(self) -> None:
        self._written.record(torch.cuda.current_stream(self.area.device))
        self._written.synchronize()  # the one host wait of the writer per message

    def _take(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._on_own_stream(lambda: [v.to(self.device, copy=True) for v in views])

    def _own(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._on_own_stream(lambda: [t.to(self.device) for t in tensors])

    def _on_own_stream(self, copy) -> list[torch.Tensor]:
        with torch.cuda.stream(self._stream):
            out = copy()
            self._read.record(self._stream)
        self._read.synchronize()  # the reader's host wait: the span is reused once this returns
        return out
