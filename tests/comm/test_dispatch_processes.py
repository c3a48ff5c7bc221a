"""Dispatch/combine between real OS processes over the ZeroMQ transport (TCP on loopback) and the
shared-memory transport, with the tensors in the frames or in the host twin's payload areas
("shm-twin", ring_medium.py)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import uuid

import pytest
import torch

from comm.endpoint import CommConfig
from comm.messages import MsgKey
from comm.reference import reference_combine
from comm.topology import Topology
from comm.transport.shm_transport import remove_namespace
from comm.transport.zmq_transport import free_tcp_addresses
from comm.wire import WireFormat
from tests.comm.dispatch_worker import run_endpoint
from tests.comm.harness import exact_expert, routing

_SPAWN = mp.get_context("spawn")
KEYS = [MsgKey(0, layer, mb) for layer in range(2) for mb in range(2)]
# A receive's timeout also covers a peer that is still starting: seven processes importing torch on
# a loaded 2-core machine have been seen to start more than 30 s apart.
COMM_TIMEOUT_S = 90


def run_processes(topo: Topology, config: CommConfig, inputs, kind: str = "zmq", keys=KEYS) -> dict:
    if kind == "zmq":
        transport = (kind, {"addresses": dict(enumerate(free_tcp_addresses(topo.num_endpoints)))})
    else:
        transport = ("shm", {"peers": range(topo.num_endpoints), "namespace": uuid.uuid4().hex[:12]})
        if kind == "shm-twin":
            transport[1].update(payload_device="cpu", payload_capacity=1 << 20)
    results = _SPAWN.Queue()
    procs = [
        _SPAWN.Process(target=run_endpoint, args=(topo, config, ep, transport, inputs, keys, results))
        for ep in range(topo.num_endpoints)
    ]
    # start order must not matter: FFN ranks first here, senders last
    for p in reversed(procs):
        p.start()
    reports, failures = {}, []
    try:
        while len(reports) + len(failures) < len(procs):
            status, ep, payload, stats = results.get(timeout=2 * COMM_TIMEOUT_S)
            if status == "ok":
                reports[ep] = (payload, stats)
            else:  # the others' reports too: which endpoint stopped first is in there
                failures.append(f"endpoint {ep} failed:\n{payload}")
    except queue.Empty:
        failures.append(f"no report from endpoints {sorted(set(range(len(procs))) - set(reports))}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        left = remove_namespace(transport[1]["namespace"]) if kind != "zmq" else []
    assert not failures, "\n".join(failures)
    assert left == [], f"files left behind: {left}"
    return reports


@pytest.mark.timeout(4 * COMM_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["zmq", "shm", "shm-twin"])
@pytest.mark.parametrize(
    "mode, topo",
    [
        ("two-stage", Topology(3, 2, 2, 8)),
        ("direct", Topology(4, 2, 2, 8, colocated=True)),
    ],
)
def test_processes_match_reference_exactly(mode, topo, kind):
    tokens = [5, 0, 7, 3][: topo.num_senders]
    xs, ids, ws = routing(topo, tokens, 3, seed=2)
    config = CommConfig(mode, WireFormat("fp32", "fp32"), timeout=COMM_TIMEOUT_S)
    reports = run_processes(topo, config, list(zip(xs, ids, ws)), kind)
    assert_exact(reports, reference_combine(xs, ids, ws, exact_expert), len(KEYS))


@pytest.mark.timeout(4 * COMM_TIMEOUT_S)
def test_many_keys_in_flight_through_relays_over_shared_memory():
    """Every sender dispatches 48 keys before combining any: relays, their threads and the threads
    waiting in recv (which read the rings themselves) pass many messages at once; a lost wake-up
    would hold a receive until its timeout."""
    topo = Topology(3, 2, 2, 8)
    keys = [MsgKey(step, layer, mb) for step in range(6) for layer in range(2) for mb in range(4)]
    xs, ids, ws = routing(topo, [5, 0, 7], 3, seed=4)
    config = CommConfig("two-stage", WireFormat("fp32", "fp32"), timeout=COMM_TIMEOUT_S)
    reports = run_processes(topo, config, list(zip(xs, ids, ws)), "shm", keys)
    assert_exact(reports, reference_combine(xs, ids, ws, exact_expert), len(keys))


def assert_exact(reports: dict, ref: list[torch.Tensor], num_keys: int) -> None:
    """Every sender got the reference combine, bit for bit, for each of its keys."""
    for sender, expected in enumerate(ref):
        outs, _ = reports[sender]
        assert len(outs) == num_keys
        assert all(torch.equal(torch.tensor(o, dtype=torch.float32).view(expected.shape), expected) for o in outs), (
            f"sender {sender}"
        )
