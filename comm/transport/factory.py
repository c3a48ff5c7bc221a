"""Builds a transport by name, so configuration can pick the backend.

Each backend is imported only when asked for: the in-process backend must not pay for (or
need) pyzmq, and nothing here may import GPU-only code.

    make_transport("inproc", 0, fabric=fabric)
    make_transport("zmq", 0, addresses={0: "tcp://10.0.0.1:5555", 1: "tcp://10.0.0.2:5555"})
    make_transport("torch_dist", dist.get_rank(), device="cuda:0")
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


def _torch_dist(endpoint: int, **kwargs) -> Transport:
    import torch.distributed as dist

    from comm.transport.torch_dist import TorchDistTransport

    # The endpoint is the global rank; a mismatch is a configuration error worth catching early.
    if dist.is_initialized() and dist.get_rank() != endpoint:
        raise CommError(f"torch_dist endpoint {endpoint} must be this process's rank {dist.get_rank()}")
    return TorchDistTransport(**kwargs)


TRANSPORTS = {"inproc": _inproc, "zmq": _zmq, "torch_dist": _torch_dist}


def make_transport(kind: str, endpoint: int, **kwargs) -> Transport:
    """A `kind` transport for `endpoint`; kwargs go to the backend's constructor."""
    if kind not in TRANSPORTS:
        raise CommError(f"unknown transport {kind!r}; known: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[kind](endpoint, **kwargs)
