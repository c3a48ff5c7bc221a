"""How a deployment's ranks share this machine's cores: --pin-cores (each rank process runs on its
own share of them), the default of --comm-spin-us (spinning only where each rank has cores of
its own) and --comm-spin-priority."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from afd_engine import SamplingParams, make_engine
from afd_engine.engine_args import EngineArgs, core_shares, usable_core_ids
from afd_engine.model_config import ModelConfig
from afd_engine.processes import deployment, entrypoints
from afd_engine.processes.rendezvous import PeerTable
from afd_engine.ranks.spec import DeploymentSpec
from comm.transport.shm_transport import ShmTransport, host_id
from comm.transport.spin import idle_priority_supported


def test_core_shares_split_the_cores_evenly_in_order():
    assert core_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert core_shares([0, 1, 2], 2) == [[0], [1]]  # core 2 is left to the front end
    assert core_shares([4, 6], 1) == [[4, 6]]
    assert core_shares([0, 1], 3) is None  # more ranks than cores: not pinned
    assert core_shares([], 1) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pin", [True, False])
def test_rank_processes_run_on_their_share_of_the_cores(pin, tiny_v3):
    cores = usable_core_ids()
    shares = core_shares(cores, 2) if pin else None
    expected = [set(s) for s in shares] if shares else [set(cores)] * 2
    with make_engine(model_path=tiny_v3, mode="afd", dp_size=1, micro_batches=1, pin_cores=pin) as engine:
        procs = engine.deployment.procs  # the FFN rank, then the attention rank
        assert [os.sched_getaffinity(p.pid) for p in procs] == expected
        out = engine.generate(
            prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=3, ignore_eos=True)
        )
        assert len(out[0].token_ids) == 3


@pytest.mark.parametrize(
    "flags, cores, spin_us",
    [
        (dict(mode="afd", dp_size=1), 2, 2000),  # 2 ranks x 1 thread on 2 cores: each has its own
        (dict(mode="afd", dp_size=1), 1, 0),  # 2 ranks on 1 core
        (dict(mode="colocated", dp_size=2, num_threads=2), 2, 0),  # 2 ranks x 2 threads on 2 cores
        (dict(mode="colocated", dp_size=2, comm_spin_us=50), 1, 50),  # asked for: as asked
        (dict(mode="afd", dp_size=1, comm_spin_us=0), 2, 0),
    ],
)
def test_ranks_spin_by_default_only_where_each_has_cores_of_its_own(flags, cores, spin_us, tiny_v3, monkeypatch):
    monkeypatch.setattr(deployment, "usable_cpus", lambda: cores)
    started = deployment.Deployment(EngineArgs(model_path=tiny_v3, **flags))
    try:
        assert started.args.comm_spin_us == spin_us
    finally:
        started.stop()


@pytest.mark.parametrize("priority, idle", [(None, True), ("idle", True), ("normal", False)])
def test_a_rank_looks_for_its_messages_at_the_priority_asked_for(priority, idle, tiny_v3):
    """--comm-spin-priority (default idle) reaches a rank's shared-memory transport, beside
    --comm-spin-us; the OS may refuse idle priority (comm/transport/spin.py), and then it is normal."""
    flags = {} if priority is None else {"comm_spin_priority": priority}
    args = EngineArgs(model_path=tiny_v3, mode="afd", dp_size=1, comm_spin_us=1500, **flags)
    spec = DeploymentSpec.of(args, ModelConfig.from_pretrained(tiny_v3))
    table = PeerTable(hosts={0: host_id(), 1: host_id()}, namespace=uuid.uuid4().hex[:12])
    transport = entrypoints._transport(0, table, spec, torch.device("cpu"))
    try:
        assert isinstance(transport, ShmTransport)
        assert transport._spin.max_s == 0.0015
        assert transport._spin.idle == (idle and idle_priority_supported())
    finally:
        transport.close()
