"""Builds a transport by name, so configuration can pick the backend.

Each backend is imported only when asked for: the in-process backend must not pay for (or
need) pyzmq, and nothing here may import GPU-only code.

    make_transport("inproc", 0, fabric=fabric)
    make_transport("zmq", 0, addresses={0: "tcp://10.0.0.1:5555", 1: "tcp://10.0.0.2:5555"})
    make_transport("shm", 0, peers=[0, 1], namespace="run42")
    make_transport("shm", 0, peers=[0, 1], namespace="run42", payload_device=torch.device("cuda", 0))
    make_transport("hybrid", 0, addresses=..., local=[1], namespace="run42")
    make_transport("torch_dist", dist.get_rank(), device="cuda:0")

`peer_transport` picks among shm, zmq and hybrid from where every endpoint runs.
"""

from __future__ import annotations

from comm.messages import CommError
from comm.transport.base import Transport


def _inproc(endpoint: int, fabric=None) -> Transport:
    from comm.transport.inproc import InProcessFabric

    if not isinstance(fabric, InProcessFabric):
        raise CommError("the inproc transport needs fabric=InProcessFabric() shared by its endpoints")
    return fabric.endpoint(endpoint)


def _zmq(endpoint: int, **kwargs) -> Transport:
    from comm.transport.zmq_transport import ZmqTransport

    return ZmqTransport(endpoint, **kwargs)


def _shm(endpoint: int, **kwargs) -> Transport:
    from comm.transport.shm_transport import ShmTransport

    return ShmTransport(endpoint, **kwargs)


def _hybrid(endpoint: int, **kwargs) -> Transport:
    from comm.transport.hybrid import HybridTransport

    return HybridTransport(endpoint, **kwargs)


def _torch_dist(endpoint: int, **kwargs) -> Transport:
    import torch.distributed as dist

    from comm.transport.torch_dist import TorchDistTransport

    # The endpoint is the global rank; a mismatch is a configuration error worth catching early.
    if dist.is_initialized() and dist.get_rank() != endpoint:
        raise CommError(f"torch_dist endpoint {endpoint} must be this process's rank {dist.get_rank()}")
    return TorchDistTransport(**kwargs)


TRANSPORTS = {"inproc": _inproc, "zmq": _zmq, "shm": _shm, "hybrid": _hybrid, "torch_dist": _torch_dist}


def make_transport(kind: str, endpoint: int, **kwargs) -> Transport:
    """A `kind` transport for `endpoint`; kwargs go to the backend's constructor."""
    if kind not in TRANSPORTS:
        raise CommError(f"unknown transport {kind!r}; known: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[kind](endpoint, **kwargs)


def peer_transport(
    endpoint: int,
    addresses: dict[int, str],
    hosts: dict[int, str],
    namespace: str,
    link_delay_s: float = 0.0,
    spin_s: float = 0.0,
    spin_idle: bool = False,
    keys=None,
    incarnations: dict[int, int] | None = None,
    payload_device=None,
    payload_capacity: int | None = None,
) -> Transport:
    """The transport of `endpoint` among peers: shared memory to those with its host id
    (`shm_transport.host_id()`; "" for none), ZeroMQ at `addresses` to the others. Every endpoint
    decides from the same tables, so both ends of each pair agree on the path. `spin_s` and
    `spin_idle`: see ShmTransport (the shared-memory path only). `keys` (comm.auth.ClusterKeys):
    the ZeroMQ links speak CURVE with them. `payload_device` (None, "cpu" or a CUDA device; every
    endpoint of a host must give the same kind): received tensors are on it; the shared-memory path
    carries them there (in a payload area of `payload_capacity` bytes per ring, ShmTransport's
    default where None), the ZeroMQ path as host bytes moved there on receipt."""
    mine = hosts.get(endpoint, "")
    if not mine:
        return make_transport(
            "zmq", endpoint, addresses=addresses, link_delay_s=link_delay_s, keys=keys, payload_device=payload_device
        )
    shm = dict(
        namespace=namespace,
        link_delay_s=link_delay_s,
        spin_s=spin_s,
        spin_idle=spin_idle,
        incarnations=incarnations,
        payload_device=payload_device,
    )
    if payload_capacity is not None:
        shm["payload_capacity"] = payload_capacity
    local = {e for e, h in hosts.items() if h == mine}
    if not (set(addresses) | set(hosts)) - local:
        return make_transport("shm", endpoint, peers=local, **shm)
    return make_transport("hybrid", endpoint, addresses=addresses, local=local, keys=keys, host=mine, **shm)
