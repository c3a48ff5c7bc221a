"""The rendezvous tells every rank each endpoint's address, host and the deployment's namespace."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from afd_engine.errors import ConfigError
from afd_engine.processes.rendezvous import RendezvousSpec, free_port, host_rendezvous, register, shm_host
from comm.transport.shm_transport import host_id


@pytest.mark.timeout(60)
def test_ranks_learn_every_address_and_host_and_one_namespace():
    spec = RendezvousSpec(f"127.0.0.1:{free_port('127.0.0.1')}", "127.0.0.1", timeout=20)
    store = host_rendezvous(spec)  # noqa: F841 - the store lives as long as this reference
    hosts = {0: "machine-a", 1: "machine-a", 2: ""}  # endpoint 2 offers no shared memory
    with ThreadPoolExecutor(3) as pool:
        tables = list(pool.map(lambda ep: register(spec, ep, 3, hosts[ep]), range(3)))
    assert all(t == tables[0] for t in tables)
    assert tables[0].hosts == hosts and len(tables[0].namespace) == 16
    assert sorted(tables[0].addresses) == [0, 1, 2]
    assert all(a.startswith("tcp://127.0.0.1:") for a in tables[0].addresses.values())
    assert len(set(tables[0].addresses.values())) == 3


def test_the_transport_flag_decides_what_a_rank_offers():
    assert shm_host("auto", 2) == host_id() != ""  # this machine has /dev/shm room for two rings
    assert shm_host("shm", 2) == host_id()
    assert shm_host("zmq", 2) == ""
    too_many = 1 << 40  # rings of 4 MiB: more than any /dev/shm holds
    assert shm_host("auto", too_many) == ""  # falls back to ZeroMQ
    with pytest.raises(ConfigError, match=r"--transport shm: shared memory is not available here .*use --transport"):
        shm_host("shm", too_many)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the kernel's ephemeral range: a port a
    server is about to bind is drawn below it, where no connect() can take it first."""
    import socket

    from comm.transport.zmq_transport import _ephemeral_low, free_ports

    ports = free_ports(8)
    assert len(set(ports)) == 8
    if _ephemeral_low() > 11000:
        assert all(10000 <= p < _ephemeral_low() for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
