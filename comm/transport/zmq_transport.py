"""Cross-process transport over ZeroMQ (TCP between machines, or any ZMQ address).

Every endpoint binds one PULL socket on its own address; a background thread reads
multipart messages (the frames of `Message.encode()`), decodes them and files them into an
`Inbox`. Sending goes through one PUSH socket per peer, connected lazily on first use and
guarded by a lock (ZMQ sockets are not thread-safe). A send only hands the frames to ZMQ's
I/O thread, so it never waits for the peer.

Why ZeroMQ rather than torch.distributed + gloo for the CPU cross-process path:
  * there is no global process group: nobody has to agree on a world size or a rendezvous up
    front, endpoints are just addresses, and a process can join, leave or restart;
  * peers may start in any order: a PUSH socket queues messages for a peer that is not up yet
    and ZMQ reconnects (and re-delivers the queue) as soon as the peer binds;
  * framing and timeouts are ours: a receive waits on our Inbox with a per-call timeout and
    a clear error, where a gloo receive can only be given a timeout by tearing the pair down;
  * it works between machines over plain TCP with no extra setup;
  * ZMQ's background I/O threads make sends and receives asynchronous for free.
torch.distributed (see torch_dist.py) is the path for GPUs, where NCCL brings RDMA/NVLink.

Socket options, and why:
  * SNDHWM/RCVHWM = `hwm` (default 100 000 messages): far above the number of messages the
    engine ever has in flight, so the limit is never hit in normal operation. PUSH sockets never
    drop at the HWM; we send with NOBLOCK so that reaching it raises CommError instead of
    blocking the caller: the failure is loud, never a silent drop nor a hang.
  * LINGER = `linger_ms` (default 1000): close() flushes what is still queued for at most 1 s,
    then gives up, so closing can never hang on a dead peer.
  * RECONNECT_IVL 50 ms (backing off to 500 ms): a peer that starts late is reached quickly.
  * MAXMSGSIZE = `max_frame_bytes` (default 1 GiB) on the receiving socket: a peer that sends a
    larger frame is disconnected by ZeroMQ before the frame is held in memory (a DeepSeek-V3
    dispatch of 4,096 tokens is 59 MB in bf16).

Device tensors: `send` copies them to the host (frames are host bytes). With `payload_device`, the
receiver thread moves every received tensor there, on a CUDA stream of its own, before filing it.

Bytes that are not a message (a stray or hostile connection, a truncated frame: `MalformedMessage`)
are dropped and logged, and the receiver goes on; only its own failure wakes the waiters with an
error. With `keys` (the deployment's cluster secret, comm/auth.py) every socket speaks CURVE: a peer
without the secret never completes the handshake, is counted in `refused` and logged, and none of
its bytes reach the receive loop. Without keys a well-formed message from a peer that is not one
of the deployment's is not told apart: the ports must then be on a private network.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
from collections.abc import Iterable

import torch
import zmq

from comm.auth import ClusterKeys, secure_socket, start_authenticator
from comm.messages import CommError, MalformedMessage, Message, MsgKey
from comm.transport.base import Inbox, Transport, claim, make_inbox, payload_device_of, to_payload_device

_POLL_MS = 50  # how often the receiver thread checks whether it should stop
# what the PULL socket's monitor reports: a peer that failed the CURVE handshake
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENT_NAMES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not speaking CURVE, or a wrong key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied: not the deployment's key",
}
MAX_FRAME_BYTES = 1 << 30
log = logging.getLogger("comm.zmq")


class ZmqTransport(Transport):
    """endpoint: this endpoint's id. addresses: endpoint id -> ZMQ address ("tcp://host:port");
    this endpoint binds `bind_address` (default: its own entry) and connects to peers lazily.
    `inbox`: where received messages go, when shared with another transport (hybrid.py)."""

    def __init__(
        self,
        endpoint: int,
        addresses: dict[int, str],
        *,
        bind_address: str | None = None,
        hwm: int = 100_000,
        linger_ms: int = 1000,
        link_delay_s: float = 0.0,
        inbox: Inbox | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        keys: ClusterKeys | None = None,
        payload_device: str | torch.device | None = None,
    ) -> None:
        if endpoint not in addresses and bind_address is None:
            raise CommError(f"endpoint {endpoint} has no address in {addresses}")
        self.endpoint, self.addresses = endpoint, dict(addresses)
        self._hwm, self._linger_ms, self._max_frame = hwm, linger_ms, max_frame_bytes
        self.dropped = 0  # messages dropped as malformed
        self.refused = 0  # connections refused at the CURVE handshake (with keys)
        self._keys = keys
        self.payload_device = payload_device_of(payload_device)
        self._claims = self.payload_device is not None and self.payload_device.type == "cuda"
        self._stream = torch.cuda.Stream(self.payload_device) if self._claims else None  # the receiver's copies
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys) if keys is not None else None
        self._inbox = inbox if inbox is not None else make_inbox(endpoint, link_delay_s)  # delay: experiments
        self._senders: dict[int, zmq.Socket] = {}
        self.incarnations: dict[int, int] = {}  # peers replaced so far (readmit)
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._pull = self._bind(bind_address or addresses[endpoint])
        self._monitor = self._pull.get_monitor_socket(_REFUSALS) if keys is not None else None
        self._receiver = threading.Thread(target=self._receive_loop, name=f"zmq-recv-{endpoint}", daemon=True)
        self._receiver.start()

    # -- sockets ---------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        return sock

    def _bind(self, address: str) -> zmq.Socket:
        sock = self._socket(zmq.PULL)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        secure_socket(sock, self._keys, server=True)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(0)
            self._ctx.term()
            raise CommError(f"endpoint {self.endpoint} cannot bind {address}: {e}") from e
        return sock

    def _sender(self, dst: int) -> zmq.Socket:
        """The PUSH socket to dst, connected on first use (call with the send lock held)."""
        sock = self._senders.get(dst)
        if sock is None:
            if dst not in self.addresses:
                raise CommError(f"endpoint {self.endpoint}: no address for endpoint {dst}")
            sock = self._socket(zmq.PUSH)
            secure_socket(sock, self._keys, server=False)
            sock.connect(self.addresses[dst])
            self._senders[dst] = sock
        return sock

    # -- Transport -------------------------------------------------------------------------

    def send(self, dst: int, msg: Message) -> None:
        # copy=False: ZMQ keeps a reference to each frame's buffer (a view that holds the tensor)
        # until its I/O thread has sent it; pyzmq still copies frames under 64 KiB, where that is
        # cheaper than the bookkeeping.
        frames = msg.encode()
        with self._send_lock:
            if self._closed:
                raise CommError(f"endpoint {self.endpoint}: send to {dst} after close()")
            try:
                self._sender(dst).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again as e:
                raise CommError(
                    f"endpoint {self.endpoint}: {self._hwm} messages already queued for endpoint {dst} "
                    f"({self.addresses[dst]}): the peer is down or not keeping up"
                ) from e

    def readmit(self, peer: int, address: str, host: str = "", incarnation: int = 0) -> None:
        """Sends to a replacement of `peer` at its own address; what was queued for the lost one
        is dropped, and what it sent and nobody took."""
        with self._send_lock:
            if self.incarnations.get(peer, 0) == incarnation and self.addresses.get(peer) == address:
                return  # already there (two replacements that started together)
            old = self._senders.pop(peer, None)
            if old is not None:
                old.close(linger=0)
            self.addresses[peer] = address
            self.incarnations[peer] = incarnation
        self._inbox.forget(peer)

    def recv(self, src: int, kind: str, key: MsgKey, timeout: float) -> Message:
        return self.recv_any([src], kind, key, timeout)

    def recv_any(self, srcs: Iterable[int], kind: str, key: MsgKey, timeout: float) -> Message:
        msg = self._inbox.take(srcs, kind, key, timeout)
        return claim(msg) if self._claims else msg

    def close(self) -> None:
        """Fails pending receives, stops the receiver, closes the sockets (each lingers at most
        `linger_ms` to flush queued sends). Idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.fail(CommError("transport closed"))
            self._stop.set()
            self._receiver.join()
            if self._monitor is not None:
                self._pull.disable_monitor()
                self._monitor.close(0)
            for sock in [*self._senders.values(), self._pull]:
                sock.close()
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()

    # -- receiver thread -------------------------------------------------------------------

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is self._pull:
                        self._receive_one()
                    else:
                        self._refusal()
        except Exception as e:  # noqa: BLE001 - a bad message or a broken socket: wake every waiter
            self._inbox.fail(CommError(f"receiver thread died: {e!r}"))

    def _receive_one(self) -> None:
        frames = self._pull.recv_multipart(copy=False)
        try:
            msg = Message.decode([frame.buffer for frame in frames])
        except MalformedMessage as exc:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:  # a flood must not flood the log too
                log.warning("endpoint %d dropped %d malformed message(s); last: %s", self.endpoint, self.dropped, exc)
            return
        self._inbox.put(to_payload_device(msg, self.payload_device, self._stream))

    def _refusal(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._monitor)
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning(
                "endpoint %d refused a connection without the cluster secret (%s, %s; %d so far)",
                self.endpoint,
                _EVENT_NAMES.get(event["event"], event["event"]),
                event.get("endpoint", b"").decode(errors="replace"),
                self.refused,
            )


def free_tcp_addresses(n: int, host: str = "127.0.0.1") -> list[str]:
    """n distinct "tcp://host:port" addresses whose ports were free a moment ago (`free_ports`)."""
    return [f"tcp://{host}:{port}" for port in free_ports(n, host)]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct TCP ports free on `host` a moment ago, for servers to bind soon after.

    Drawn at random below the kernel's ephemeral range where that leaves room: every outgoing
    connection of the machine takes its local port from that range, and could take a port picked
    from it before its server binds it (a busy machine running many deployments hit this:
    "address already in use"). All n sockets stay open until every port is picked, so the ports
    are distinct; another process could still take one before it is bound again."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(100 * n):
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((host, rng.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1000 else 0))
            except OSError:  # taken: draw again
                continue
            ports.append(s.getsockname()[1])
        while len(ports) < n:  # no luck below the range: the kernel's choice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


_LOWEST_PORT = 10000  # below: well-known and registered services are more common


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
