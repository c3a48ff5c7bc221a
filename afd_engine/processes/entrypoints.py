"""Process entry points of the ranks of a deployment (module level, so that "spawn" can pickle them)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os

import torch

from afd_engine.control.loop import ControlAddrs, run_engine_process
from afd_engine.engine import Engine, RankContext
from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.stager import load_shard
from afd_engine.model_config import ModelConfig
from afd_engine.processes.rendezvous import DeploymentStore, PeerTable, RendezvousSpec, register, shm_host
from afd_engine.ranks.attention_runner import PipelineRunner
from afd_engine.ranks.fault_tolerance import DescriptorMismatchError, PeerLostError, RecoveryFailed
from afd_engine.ranks.ffn_worker import FfnWorker
from afd_engine.ranks.spec import DeploymentSpec
from afd_engine.runtime.host_memory import retain_freed_memory
from comm.transport.base import Transport


def _transport(
    endpoint: int, comm: PeerTable | RendezvousSpec, spec: DeploymentSpec, device, incarnation: int = 0
) -> Transport:
    """The data-plane transport: peers given (every rank on this machine) or found at the
    rendezvous; shared memory to the ranks on this host, ZeroMQ/TCP to the others. A rank offers
    shared memory only where /dev/shm has room for its rings (one each way per possible peer).
    With --transport torch: torch.distributed between every pair, payloads on `device`. On a GPU the
    shared-memory transport keeps payloads in GPU memory (CUDA IPC) unless --host-payloads.
    `incarnation` > 0: this process replaces a lost one (its rings get names of their own)."""
    args = spec.args
    if isinstance(comm, RendezvousSpec):
        n = spec.topology.num_endpoints
        comm = register(comm, endpoint, n, shm_host(args.transport, 2 * n), torch_group=args.transport == "torch")
    if incarnation:
        comm = dataclasses.replace(comm, incarnations={**comm.incarnations, endpoint: incarnation})
    on_device = torch.device(device).type == "cuda" and not args.host_payloads
    return comm.transport(
        endpoint,
        device,
        args.inject_link_delay_ms / 1000,
        args.comm_spin_us / 1e6,
        args.comm_spin_priority == "idle",
        payload_device=device if on_device else None,
    )


def _attention_engine(args: EngineArgs, rank: int, comm_addresses, incarnation: int = 0) -> Engine:
    spec = DeploymentSpec.of(args, ModelConfig.from_pretrained(args.model_path))
    topo = spec.topology
    transport = _transport(topo.sender_endpoint(rank), comm_addresses, spec, args.device_for(rank), incarnation)
    experts = spec.expert_slots(rank) if topo.colocated else {}  # AFD: no routed experts here
    store = _store(args, comm_addresses)

    def runner(model, pool):
        return PipelineRunner(model, pool, spec, rank, transport, store, incarnation)

    return Engine(args, rank=RankContext(rank, runner, experts, args.device_for(rank)))


def run_attention_worker(
    args: EngineArgs, addrs: ControlAddrs, ready, rank: int, comm_addresses, incarnation: int = 0
) -> None:
    """An attention rank (in colocated mode also an FFN rank): scheduler, KV pool, model.
    `incarnation` > 0: it replaces a lost one (fault tolerance), and is admitted by the others."""
    build = functools.partial(_attention_engine, args, rank, comm_addresses, incarnation)
    run_engine_process(args, addrs, ready, rank, build)


def _store(args: EngineArgs, comm) -> DeploymentStore | None:
    """Where a fault-tolerant deployment of roles keeps its lost ranks and replacements."""
    ok = args.enable_ffn_fault_tolerance and isinstance(comm, RendezvousSpec)
    return DeploymentStore(comm) if ok else None


def run_ffn_worker(args: EngineArgs, ready, rank: int, comm_addresses, local_index: int, rejoin: bool = False) -> None:
    """An FFN rank of an AFD deployment: loads only its experts, serves every attention rank.
    `local_index` is its place among this machine's ranks (which GPU it takes). `rejoin`: it
    replaces a lost rank of a running deployment (fault tolerance), which admits it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.proctitle import ffn_title, set_title

    set_title(ffn_title(rank, args.ffn_ranks_per_node))
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    try:
        cfg = ModelConfig.from_pretrained(args.model_path)
        spec = DeploymentSpec.of(args, cfg)
        device = args.device_for(local_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # a replacement gets its experts when admitted: from live peers of its node where they hold them
        shard = load_shard(args, cfg, device, spec.expert_slots(rank), read=not rejoin)
        store = _store(args, comm_addresses)
        endpoint = spec.topology.ffn_endpoint(rank)
        incarnation = store.incarnation(endpoint) + 1 if rejoin else 0
        transport = _transport(endpoint, comm_addresses, spec, device, incarnation)
        if rejoin:
            store.admit(endpoint, incarnation)
    except Exception as exc:  # reported to the launcher, which stops the deployment
        ready.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    ready.send({"ok": True})
    logging.getLogger("afd.ffn").info("FFN rank %d ready", rank)
    gc.freeze()  # what loading made lives as long as the process: later collections skip it
    try:
        load = functools.partial(load_shard, args, cfg, device)
        FfnWorker(shard, spec, rank, transport, device, load, store, incarnation).run()
    except (PeerLostError, DescriptorMismatchError, RecoveryFailed) as exc:  # expected ends: one line, status 1
        logging.getLogger("afd.ffn").error("%s", exc)
        _exit_now(transport)
    except BaseException:  # anything else: the traceback, then out at once (see _exit_now)
        logging.getLogger("afd.ffn").exception("FFN rank %d failed", rank)
        _exit_now(transport)
    transport.close()


def _exit_now(transport) -> None:
    """Exit status 1 without waiting for relay threads blocked on peers (up to --comm-timeout)."""
    transport.close()
    logging.shutdown()
    os._exit(1)
