"""The shared-memory transport with its payloads on the GPU (ipc_medium.py): two real processes on one
GPU exchange tensors through CUDA IPC payload areas, exactly, in several dtypes, over many more
messages than an area holds at once (its room is reused), with a frame larger than the area (it
goes as bytes), whichever peer starts first (that one creates both rings and allocates both
areas; the other maps them). Two ends in one process share the allocation itself.

On the CPU (AFD_GPU_TESTS_ON_CPU=1) the same medium code runs with the allocation shared through
torch's CPU shared memory (`_share_filename_cpu_`, `CpuIpcMedium`) in place of CUDA IPC: all but
the three operations on the allocation and the device's waits, which only a GPU runs.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from comm.messages import CommError, Message, MsgKey
from comm.transport import ipc_medium, shm_transport
from comm.transport.ipc_medium import CudaIpcMedium, IpcMedium
from comm.transport.ring_medium import HostMedium
from comm.transport.shm_ring import Ring
from comm.transport.shm_transport import ShmTransport, remove_namespace
from tests.comm import transport_worker as w
from tests.comm.test_transports import _SPAWN, _collect, _reap, _start, _wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]
AREA = 64 << 10  # bytes of payload area per ring: a message takes ~6 KB, so ~10 fit at once
ROUNDS = 120


class CpuIpcMedium(IpcMedium):
    """IpcMedium over torch's CPU shared memory in place of CUDA IPC (runs without a GPU)."""

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _export(self, area: torch.Tensor) -> list:
        return list(area.untyped_storage()._share_filename_cpu_())

    def _import(self, handle: list) -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*handle)
        return torch.empty(0, dtype=torch.uint8).set_(storage)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _use_cpu_ipc_where_no_gpu(device: torch.device) -> None:
    """Without a GPU, the transport's cpu payload device gets CpuIpcMedium instead of the host twin."""
    if device.type == "cpu":
        shm_transport.make_medium = lambda dev, capacity: CpuIpcMedium(dev, capacity) if dev else HostMedium()


def samples(i: int, device: torch.device) -> list[torch.Tensor]:
    """Message i's tensors on device: every dtype the data plane carries, an empty, a 0-dim and a
    strided one; ~6 KB."""
    g = torch.Generator().manual_seed(i)
    cpu = [
        torch.randn(33, 7, generator=g),
        torch.randn(5, 130, generator=g).bfloat16(),
        torch.randn(17, generator=g).half(),
        torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        torch.randint(-(2**40), 2**40, (6,), generator=g),
        torch.randint(-(2**20), 2**20, (2, 3), generator=g, dtype=torch.int32),
        torch.rand(9, generator=g) > 0.5,
        torch.randint(0, 256, (11,), generator=g, dtype=torch.uint8),
        torch.empty(0, 3),
        torch.tensor(float(i)),
        torch.randn(8, 12, generator=g).t(),
    ]
    return [t.to(device) for t in cpu]


def big(device: torch.device) -> torch.Tensor:
    """Larger than the payload area: goes as bytes through the host ring."""
    return torch.randn(AREA // 4 + 1000, generator=torch.Generator().manual_seed(7)).to(device)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if (got.dtype, got.shape, got.device) != (want.dtype, want.shape, want.device):
        return False
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
    return torch.equal(*flat)


def peer(endpoint: int, device_name: str, namespace: str, started) -> dict:
    """Endpoint 0 sends ROUNDS messages and a big one and checks each echo; endpoint 1 checks each
    message against what it must be and echoes it. Reports what each found wrong."""
    device = torch.device(device_name)
    _use_cpu_ipc_where_no_gpu(device)
    t = ShmTransport(
        endpoint, [0, 1], namespace=namespace, capacity=64 << 10, payload_device=device, payload_capacity=AREA
    )
    started.set()
    wrong = []
    try:
        other = 1 - endpoint
        for i in range(ROUNDS + 1):
            key = MsgKey(i, 0, 0)
            want = samples(i, device) if i < ROUNDS else [big(device)]
            if endpoint == 0:
                t.send(other, Message("ping", key, 0, want))
                got = t.recv(other, "pong", key, w.WAIT).tensors
            else:
                got = t.recv(other, "ping", key, w.WAIT).tensors
                t.send(other, Message("pong", key, 1, got))
            if len(got) != len(want) or not all(_same(a, b) for a, b in zip(got, want)):
                wrong.append(i)
        media = [r.medium for r, _ in t._readers] + [o.medium for o in t._outboxes.values()]
        return {
            "wrong": wrong,
            "created": [m.ring.created for m in media],
            "media": sorted({type(m).__name__ for m in media}),
            "area_devices": sorted({m.area.device.type for m in media}),
            "inline": sum(o.medium.inline for o in t._outboxes.values()),
        }
    finally:
        t.close()


@pytest.mark.parametrize("first", [0, 1], ids=["sender-first", "echo-first"])
def test_two_processes_exchange_tensors_exactly_through_device_payload_areas(first):
    device, ns = _device(), uuid.uuid4().hex[:12]
    results, started = _SPAWN.Queue(), [_SPAWN.Event() for _ in range(2)]
    procs = [_start(f"ep{first}", peer, results, first, str(device), ns, started[first])]
    try:
        _wait_for(started[first], results, procs)  # its rings (and their areas) exist before the other starts
        procs.append(_start(f"ep{1 - first}", peer, results, 1 - first, str(device), ns, started[1 - first]))
        out = _collect(results, procs, timeout=150.0)
    finally:
        _reap(procs)
        remove_namespace(ns)
    medium = "CudaIpcMedium" if device.type == "cuda" else "CpuIpcMedium"
    for ep in (0, 1):
        report = out[f"ep{ep}"]
        assert report["wrong"] == [], f"endpoint {ep}: messages {report['wrong']} differ"
        assert report["created"] == [ep == first] * 2  # the first peer made both rings, the other mapped them
        assert report["media"] == [medium] and report["area_devices"] == [device.type]
        assert report["inline"] == 1  # the big one only: every other message went through the area


def test_two_ends_in_one_process_share_the_allocation(tmp_path, monkeypatch):
    device, ns = _device(), uuid.uuid4().hex[:12]
    if device.type == "cpu":
        monkeypatch.setattr(shm_transport, "make_medium", lambda dev, capacity: CpuIpcMedium(dev, capacity))
    kw = {"namespace": ns, "directory": str(tmp_path), "payload_device": device, "payload_capacity": AREA}
    a, b = ShmTransport(0, [0, 1], **kw), ShmTransport(1, [0, 1], **kw)
    try:
        writer, reader = a._outboxes[1].medium, b._readers[0][0].medium
        assert writer.area.data_ptr() == reader.area.data_ptr()  # one allocation, not opened twice
        for i in range(3 * ROUNDS // 4):  # several turns of the area
            a.send(1, Message("x", MsgKey(i, 0, 0), 0, samples(i, device)))
            got = b.recv(0, "x", MsgKey(i, 0, 0), w.WAIT).tensors
            assert all(_same(x, y) for x, y in zip(got, samples(i, device))), f"message {i}"
        a.send(0, Message("own", MsgKey(0, 0, 0), 0, samples(0, device)))
        assert all(_same(x, y) for x, y in zip(a.recv(0, "own", MsgKey(0, 0, 0), 5).tensors, samples(0, device)))
    finally:
        a.close(), b.close()


def test_the_end_that_opens_a_ring_second_waits_for_its_creator_to_publish(tmp_path, monkeypatch):
    """The creator names the ring file before it publishes the area's handle: the other end waits
    for the handle (here 0.3 s), and gives up with a clear error where none ever comes."""
    device, path = _device(), str(tmp_path / "r")
    medium = CudaIpcMedium if device.type == "cuda" else CpuIpcMedium

    class SlowToPublish(medium):
        def _export(self, area: torch.Tensor) -> list:
            time.sleep(0.3)
            return super()._export(area)

    creator = SlowToPublish(device, AREA)
    maker = threading.Thread(target=creator.open, args=(path, 4096))
    maker.start()
    while not os.path.exists(path):
        time.sleep(1e-3)
    start = time.monotonic()
    second = medium(device, AREA)
    second.open(path, 0)
    maker.join()
    try:
        assert time.monotonic() - start >= 0.2 and second.area.data_ptr() == creator.area.data_ptr()
    finally:
        second.close(), creator.close()
    monkeypatch.setattr(ipc_medium, "MAP_WAIT_S", 0.2)
    Ring(str(tmp_path / "never"), 4096, medium.kind, ipc_medium.DESCRIPTOR_BYTES)  # named, never published
    with pytest.raises(CommError, match="its creator published no payload area within 0.2 s"):
        medium(device, AREA).open(str(tmp_path / "never"), 0)
