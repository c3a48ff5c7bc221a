"""Moving KV pages from a prefill rank's pool into a decode rank's pool.

Both pools are [layers, pages x page_size, row] tensors; one page of one layer is a contiguous
block of page_size x row values, so a request's pages are (layers x pages) blocks.

- builtin: the prefill rank gathers the blocks into one buffer and sends it as a ZeroMQ frame
  (over TCP, or IPC on one machine), on the same ordered socket as the request's DONE message;
  the decode rank scatters it into its pool.
- mooncake: the Mooncake Transfer Engine writes the blocks straight from the prefill pool into
  the decode pool, which the decode rank registered once; one batched call per send. Over TCP
  without an RDMA device, over RDMA with --disaggregation-ib-device.
"""

from __future__ import annotations

import logging

import torch

from afd_engine.errors import AFDError, ConfigError

log = logging.getLogger("afd.disagg")


class TransferFailed(AFDError):
    """Pages could not reach the peer (it died, or refused the write)."""


def token_index(pages: list[int], page_size: int) -> torch.Tensor:
    """The pool rows (tokens) of `pages`, in order."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).flatten()


def read_pages(cache: torch.Tensor, pages: list[int], page_size: int) -> torch.Tensor:
    """A copy of the pages' contents: [layers, len(pages) x page_size, row], on the host."""
    return cache.index_select(1, token_index(pages, page_size).to(cache.device)).cpu()


def write_pages(cache: torch.Tensor, pages: list[int], page_size: int, data: torch.Tensor) -> None:
    cache.index_copy_(1, token_index(pages, page_size).to(cache.device), data.to(cache.device))


class Builtin:
    name = "builtin"

    def __init__(self, cache: torch.Tensor, page_size: int) -> None:
        self.cache, self.page_size = cache, page_size

    def describe(self) -> dict:
        return {}

    def send(self, sock, room: int, dest: dict, src: list[int], dst: list[int]) -> int:
        data = read_pages(self.cache, src, self.page_size).contiguous()
        header = {"kind": "pages", "room": room, "pages": dst}
        from afd_engine.disagg import wire

        send_frames(sock, [wire.pack(header), memoryview(data.view(torch.uint8).numpy())])
        return data.numel() * data.element_size()

    def receive(self, header: dict, payload) -> None:
        shape = (self.cache.shape[0], len(header["pages"]) * self.page_size, self.cache.shape[2])
        want = shape[0] * shape[1] * shape[2] * self.cache.element_size()
        if len(payload) != want:
            raise TransferFailed(f"{len(payload)} bytes of pages where {want} were due")
        data = torch.frombuffer(bytearray(payload), dtype=self.cache.dtype).view(shape)
        write_pages(self.cache, header["pages"], self.page_size, data)

    def close(self) -> None:
        """Nothing to release: the builtin backend holds no resource of its own."""


class Mooncake:
    name = "mooncake"

    def __init__(self, cache: torch.Tensor, page_size: int, host: str, ib_device: str | None) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(
                "--disaggregation-transfer-backend mooncake needs the Mooncake Transfer Engine: pip install "
                "mooncake-transfer-engine (mooncake-transfer-engine-non-cuda without CUDA; it needs the "
                f"libibverbs1 system package to import): {exc}"
            ) from exc
        if cache.device.type != "cpu" and not _mooncake_has_cuda():
            raise ConfigError("this Mooncake build cannot reach GPU memory; install mooncake-transfer-engine (CUDA)")
        self.cache, self.page_size = cache, page_size
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "") != 0:
            raise ConfigError(f"the Mooncake Transfer Engine did not start on {host} over {protocol}")
        self.base = cache.data_ptr()
        self.nbytes = cache.numel() * cache.element_size()
        if self.engine.register_memory(self.base, self.nbytes) != 0:
            raise ConfigError("the Mooncake Transfer Engine could not register the KV pool")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.block = page_size * cache.shape[2] * cache.element_size()  # one page of one layer
        self.layer_stride = cache.shape[1] * cache.shape[2] * cache.element_size()

    def describe(self) -> dict:
        return {"session": self.session, "base": self.base, "layer_stride": self.layer_stride, "block": self.block}

    def send(self, sock, room: int, dest: dict, src: list[int], dst: list[int]) -> int:
        peer = dest["backend"]
        if peer.get("block") != self.block:
            raise TransferFailed("the decode pool's page layout differs from this one")
        layers = self.cache.shape[0]
        srcs = [self.base + layer * self.layer_stride + p * self.block for layer in range(layers) for p in src]
        dsts = [peer["base"] + layer * peer["layer_stride"] + p * self.block for layer in range(layers) for p in dst]
        rc = self.engine.batch_transfer_sync_write(peer["session"], srcs, dsts, [self.block] * len(srcs))
        if rc != 0:
            raise TransferFailed(f"Mooncake could not write to the decode rank at {peer['session']} (status {rc})")
        return self.block * len(srcs)

    def receive(self, header: dict, payload) -> None:
        raise TransferFailed("a Mooncake decode rank takes no page messages")

    def close(self) -> None:
        try:
            self.engine.unregister_memory(self.base)
        except Exception:  # closing: nothing to do about it
            log.debug("Mooncake unregister failed", exc_info=True)


def _mooncake_has_cuda() -> bool:
    from mooncake import engine

    return bool(getattr(engine, "SUPPORT_CUDA", False))


def mooncake_available() -> str | None:
    """None when the Mooncake Transfer Engine imports here, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def make_backend(name: str, cache: torch.Tensor, page_size: int, host: str, ib_device: str | None):
    if name == "mooncake":
        return Mooncake(cache, page_size, host, ib_device)
    return Builtin(cache, page_size)


def send_frames(sock, frames: list) -> None:
    """Queues a message without ever blocking: a peer that is gone or far behind is a failure."""
    import zmq

    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        raise TransferFailed("the peer is not taking messages (gone, or too far behind)") from None
