"""Rank discovery across machines: every rank publishes its data-plane address (and which host it is
on) at `--dist-init-addr` and reads every other rank's, using torch.distributed's TCPStore. Ranks
that turn out to share a host talk through shared memory, the others over ZeroMQ/TCP
(`comm.transport.factory.peer_transport`); with --transport torch every rank joins one
torch.distributed group through the same store instead (`TorchGroup`).

The attention role's launcher hosts the store (the master) for the deployment's lifetime. Ranks
may start in any order, before or after it: a TCPStore client keeps retrying the connection until
its timeout. Both the connection and the wait for the other ranks are bounded by
`--rendezvous-timeout`, and a failure says what is missing. The same store can later give NCCL
its process group. What stays ours: the key layout and the error messages.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from afd_engine.errors import ConfigError
from comm.auth import ClusterKeys

log = logging.getLogger("afd.rendezvous")

_KEY = "afd/endpoint/{}"
_HOST_KEY = "afd/host/{}"
_RUN_KEY = "afd/run"  # one id per hosted rendezvous: names this deployment's shared-memory files
_INCARNATION_KEY = "afd/incarnation/{}"  # how many times the endpoint's process was replaced
_LOST_KEY = "afd/lost"  # JSON list of the FFN ranks the deployment serves without (set once serving)


@dataclass(frozen=True)
class RendezvousSpec:
    """What a rank needs to find its peers (picklable, passed to rank processes)."""

    address: str  # "host:port" of the rendezvous
    host_ip: str  # the address peers reach this machine at
    timeout: float = 300.0
    keys: ClusterKeys | None = None  # --cluster-secret: entries signed, data plane over CURVE


@dataclass(frozen=True)
class TorchGroup:
    """How the ranks of a `--transport torch` deployment form one torch.distributed process group
    (picklable): every endpoint joins as its own rank through the TCPStore at `store_address`
    (the rendezvous, or on one machine a store its launcher hosts), under `prefix`.

    Backend: gloo between CPU ranks; "cpu:gloo,cuda:nccl" where the rank is on a GPU, so that the
    transport's headers travel over gloo and its payloads over NCCL, device to device."""

    world_size: int
    store_address: str
    prefix: str
    timeout: float = 300.0

    def transport(self, endpoint: int, device):
        import torch.distributed as dist

        from comm.transport.factory import make_transport

        host, port = self.store_address.rsplit(":", 1)
        timeout = timedelta(seconds=self.timeout)
        store = dist.PrefixStore(self.prefix, dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, store=store, rank=endpoint, world_size=self.world_size, timeout=timeout)
        except (RuntimeError, OSError, ValueError) as exc:
            raise ConfigError(
                f"rank (endpoint {endpoint}) could not form the torch.distributed group of {self.world_size} ranks "
                f"at {self.store_address} within {self.timeout:.0f} s: {exc}"
            ) from None
        return make_transport("torch_dist", endpoint, device=device)


@dataclass(frozen=True)
class PeerTable:
    """Where every endpoint of a deployment is (picklable, passed to rank processes).

    addresses: endpoint -> ZeroMQ address (needed for endpoints on other hosts only); hosts:
    endpoint -> host id (`shm_transport.host_id()`, "" where shared memory is not offered);
    namespace: the prefix of this deployment's shared-memory files; torch: with --transport
    torch, the process group every endpoint joins instead."""

    addresses: dict[int, str] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    namespace: str = ""
    torch: TorchGroup | None = None
    keys: ClusterKeys | None = None  # the ZeroMQ links between machines speak CURVE with these
    incarnations: dict[int, int] = field(default_factory=dict)  # endpoint -> replacements so far (0: none)

    def transport(
        self,
        endpoint: int,
        device,
        link_delay_s: float = 0.0,
        spin_s: float = 0.0,
        spin_idle: bool = False,
        payload_device=None,
    ):
        """`payload_device`: where tensors cross between the ranks of this host (the shared-memory
        transport's medium: a GPU's memory, shared by CUDA IPC); None: host memory."""
        if self.torch is not None:
            return self.torch.transport(endpoint, device)
        from comm.transport.factory import peer_transport

        return peer_transport(
            endpoint,
            self.addresses,
            self.hosts,
            self.namespace,
            link_delay_s,
            spin_s,
            spin_idle,
            self.keys,
            self.incarnations,
            payload_device=payload_device,
        )


def new_namespace() -> str:
    return uuid.uuid4().hex[:16]


def shm_host(transport: str, num_rings: int) -> str:
    """The host id this rank offers for shared memory under `--transport` ("" for none): with
    auto, only where /dev/shm has room for `num_rings` rings; with shm, that or a ConfigError."""
    from comm.transport.shm_transport import SHM_DIR, fits, host_id

    if transport in ("zmq", "torch"):
        return ""
    host = host_id()
    if host and fits(num_rings):
        return host
    if transport == "shm":
        why = "it needs x86-64 and " if not host else ""
        raise ConfigError(
            f"--transport shm: shared memory is not available here ({why}{SHM_DIR} needs room for "
            f"{num_rings} rings); use --transport auto or zmq"
        )
    return ""


def local_ip_towards(address: str) -> str:
    """This machine's address on the route to `address` (no packet is sent)."""
    host, port = address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def free_port(host: str) -> int:
    """A TCP port free on `host` a moment ago, outside the ephemeral range where it can be
    (comm.transport.zmq_transport.free_ports)."""
    from comm.transport.zmq_transport import free_ports

    return free_ports(1, host)[0]


def host_rendezvous(spec: RendezvousSpec):
    """Starts the store at `spec.address` in this process; keep the returned object alive."""
    from torch.distributed import TCPStore

    host, port = spec.address.rsplit(":", 1)
    try:
        store = TCPStore(
            host, int(port), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout)
        )
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"cannot host the rendezvous at {spec.address}: {exc}") from None
    store.set(_RUN_KEY, _sign(spec.keys, new_namespace()))
    return store


def _sign(keys: ClusterKeys | None, value: str) -> str:
    return value if keys is None else keys.sign(value)


def _read(store, key: str, keys: ClusterKeys | None) -> str:
    """A rendezvous entry; with keys, only one signed with the deployment's secret (else ConfigError)."""
    raw = store.get(key).decode()
    if keys is None:
        return raw
    value = keys.verify(raw)
    if value is None:
        log.warning("refused the rendezvous entry %s: not signed with this deployment's cluster secret", key)
        raise ConfigError(
            f"the rendezvous entry {key} is not signed with this deployment's cluster secret: a peer "
            "without the secret wrote it, or the roles were started with different secrets "
            "(--cluster-secret / AFD_CLUSTER_SECRET)"
        )
    return value


def host_local_store():
    """A TCPStore on a free port of this machine, for the ranks of a one-machine deployment over
    --transport torch; keep the returned object alive as long as they run."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _client(spec: RendezvousSpec, who: str):
    from torch.distributed import TCPStore

    host, port = spec.address.rsplit(":", 1)
    try:
        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=spec.timeout))
    except (RuntimeError, OSError):
        raise ConfigError(
            f"{who} got no answer from the rendezvous at {spec.address} "
            f"within {spec.timeout:.0f} s: start every role with the same --dist-init-addr, and the "
            "attention role (which hosts it) on that address"
        ) from None


def register(
    spec: RendezvousSpec, endpoint: int, num_endpoints: int, host_id: str = "", torch_group: bool = False
) -> PeerTable:
    """Announces `endpoint` at a fresh port of this machine and on `host_id` (its host for shared
    memory, see `shm_host`; "" for none); returns where all `num_endpoints` endpoints are. With
    `torch_group`, the table says how to form the deployment's torch.distributed group instead.
    A replacement process announces itself the same way (its address replaces the lost one's);
    DeploymentStore.admit then tells the others it is there."""
    timeout = timedelta(seconds=spec.timeout)
    store = _client(spec, f"rank (endpoint {endpoint})")
    store.set(_HOST_KEY.format(endpoint), _sign(spec.keys, host_id))
    address = f"tcp://{spec.host_ip}:{free_port(spec.host_ip)}"
    store.set(_KEY.format(endpoint), _sign(spec.keys, address))  # last: see _peers
    keys = [_KEY.format(i) for i in range(num_endpoints)]
    try:
        store.wait(keys, timeout)
    except (RuntimeError, OSError):
        missing = [i for i, k in enumerate(keys) if not store.check([k])]
        raise ConfigError(
            f"rank (endpoint {endpoint}): only {num_endpoints - len(missing)} of {num_endpoints} ranks "
            f"registered at {spec.address} within {spec.timeout:.0f} s (missing endpoints: "
            f"{missing}); start every role with the same topology flags"
        ) from None
    table = _peers(store, num_endpoints, spec.keys)
    if torch_group:
        return PeerTable(torch=TorchGroup(num_endpoints, spec.address, f"afd/torch/{table.namespace}/", spec.timeout))
    return table


def _peers(store, num_endpoints: int, keys: ClusterKeys | None = None) -> PeerTable:
    """The table once every endpoint's address is in (each rank sets its host id before it)."""
    ids = range(num_endpoints)
    incarnations = {
        i: int(_read(store, _INCARNATION_KEY.format(i), keys)) for i in ids if _has(store, _INCARNATION_KEY.format(i))
    }
    return PeerTable(
        {i: _read(store, _KEY.format(i), keys) for i in ids},
        {i: _read(store, _HOST_KEY.format(i), keys) for i in ids},
        _read(store, _RUN_KEY, keys),
        keys=keys,
        incarnations=incarnations,
    )


def _has(store, key: str) -> bool:
    return store.check([key])


class DeploymentStore:
    """What a running fault-tolerant deployment keeps at its rendezvous: the FFN ranks it serves
    without, and the replacement processes that announced themselves (their incarnation, address
    and host). Attention rank 0 writes the lost ranks; a replacement reads them (which ranks to
    start) and announces itself; every rank reads where a replacement is."""

    def __init__(self, spec: RendezvousSpec) -> None:
        self.spec, self.keys = spec, spec.keys
        self._store = _client(spec, "a rank")

    def serving(self) -> bool:
        """Whether the deployment runs already (a role started now replaces lost ranks)."""
        return _has(self._store, _LOST_KEY)

    def lost(self) -> list[int]:
        return json.loads(_read(self._store, _LOST_KEY, self.keys)) if self.serving() else []

    def set_lost(self, ranks) -> None:
        self._store.set(_LOST_KEY, _sign(self.keys, json.dumps(sorted(ranks))))

    def incarnation(self, endpoint: int) -> int:
        key = _INCARNATION_KEY.format(endpoint)
        return int(_read(self._store, key, self.keys)) if _has(self._store, key) else 0

    def admit(self, endpoint: int, incarnation: int) -> None:
        """A replacement says it is ready to be talked to (after it registered and opened its links)."""
        self._store.set(_INCARNATION_KEY.format(endpoint), _sign(self.keys, str(incarnation)))

    def peer(self, endpoint: int) -> tuple[str, str]:
        """(address, host id) of the endpoint's current process."""
        return _read(self._store, _KEY.format(endpoint), self.keys), _read(
            self._store, _HOST_KEY.format(endpoint), self.keys
        )
