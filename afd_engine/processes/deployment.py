"""Starts every rank of a deployment on this machine and watches them.

    front end (binds control sockets) <-ZMQ-> attention ranks 0..D-1 <-comm-> FFN ranks

The data plane (comm) between ranks on this machine is shared memory (comm/transport/shm_transport.py),
or ZeroMQ over TCP loopback where /dev/shm is missing or too small; between machines ZeroMQ/TCP.

Every rank is its own OS process. The launcher waits until all report ready (or one reports an
error, which stops the rest); afterwards `alive()` is false as soon as any rank has died. By
default a deployment does not recover from a lost rank: the server reports unhealthy, fails the
requests in flight and exits with a non-zero status (a supervisor restarts it). With
--enable-fault-tolerance the attention ranks recover from the loss of FFN ranks and of each other
(ranks/attention_runner.py), and the deployment is down only once no attention rank is left.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import tempfile

from afd_engine.control.loop import ControlAddrs, run_engine_process
from afd_engine.default_model import resolve_model_path
from afd_engine.engine_args import AUTO_SPIN_US, EngineArgs, core_shares, usable_core_ids, usable_cpus
from afd_engine.errors import ConfigError
from afd_engine.models.checkpoint import inspect_checkpoint
from afd_engine.processes import rank_process
from afd_engine.processes.rendezvous import (
    PeerTable,
    RendezvousSpec,
    TorchGroup,
    host_local_store,
    host_rendezvous,
    new_namespace,
    shm_host,
)
from afd_engine.ranks.spec import DeploymentSpec

log = logging.getLogger("afd.launcher")

READY_TIMEOUT_S = 900
MAX_REPLACEMENTS = 3  # per attention rank: a replacement that keeps dying is not started again


class Deployment:
    """role "all": every rank on this machine. "attention": the attention ranks (and the front
    end, which hosts the rendezvous); "ffn": the FFN ranks of FFN node `node_rank`. Roles on
    different machines find each other through `rendezvous`."""

    def __init__(
        self, args: EngineArgs, role: str = "all", node_rank: int = 0, rendezvous: RendezvousSpec | None = None
    ) -> None:
        args.validate()
        if role != "all" and (args.mode != "afd" or rendezvous is None):
            raise ConfigError("launching by role needs --mode afd and --dist-init-addr")
        self.role, self.node_rank, self.rendezvous = role, node_rank, rendezvous
        path = resolve_model_path(args.model_path)
        # a broken checkpoint (or one without the MTP module speculation needs) stops here, before any
        # process starts
        cfg = inspect_checkpoint(path, mtp=args.spec_steps > 0).with_index_cache(
            args.index_cache_dtype, args.torch_dtype.itemsize
        )
        ranks, cores = self._local_processes(args), usable_cpus()
        _check_nccl_placement(args, ranks)
        threads = args.num_threads or max(1, cores // ranks)
        spin = args.comm_spin_us
        if spin is None:  # spinning takes a core: only where no other rank of this machine needs it
            spin = AUTO_SPIN_US if ranks * threads <= cores else 0
        self.args = args.replace(model_path=str(path), num_threads=threads, comm_spin_us=spin)
        self.spec = DeploymentSpec.of(self.args, cfg) if args.mode != "single" else None
        self.workdir = tempfile.mkdtemp(prefix="afd-")
        self.addrs = ControlAddrs(*(f"ipc://{self.workdir}/{n}" for n in ("requests", "broadcast", "outputs")))
        self.procs: list[mp.Process] = []
        self._num_ffn = 0  # the first procs are FFN ranks
        self._store = None  # the rendezvous, when this role hosts it
        self._namespace: str | None = None  # of the shared-memory files, when this launcher chose them
        self.info: dict = {}
        self._comm = None  # where the ranks find each other (PeerTable or RendezvousSpec)
        self._ctx = None
        self._replacements: dict[int, int] = {}  # attention rank -> replacements started

    def _local_processes(self, args: EngineArgs) -> int:
        """Rank processes this role starts on this machine (they share its cores)."""
        if args.mode == "single":
            return args.dp_size
        ffn = args.ffn_nodes * args.ffn_ranks_per_node if args.mode == "afd" else 0
        return {"attention": args.dp_size, "ffn": args.ffn_ranks_per_node}.get(self.role, args.dp_size + ffn)

    def wait(self) -> int:
        """Blocks until the local ranks exit: 0 when all ended cleanly, 1 otherwise."""
        for p in self.procs:
            p.join()
        return 0 if all(p.exitcode == 0 for p in self.procs) else 1

    @property
    def num_attention_ranks(self) -> int:
        return self.args.dp_size

    def start(self) -> dict:
        """Starts all ranks; returns rank 0's info (model path, context length). The control
        sockets must already be bound (the front end binds them)."""
        ctx = self._ctx = rank_process.context()
        if self.role == "attention":  # the rendezvous lives with the front end, as long as it does
            self._store = host_rendezvous(self.rendezvous)
        ranks = self._ranks()
        self._num_ffn = sum(1 for target, _ in ranks if target.__name__ == "run_ffn_worker")
        shares = (core_shares(usable_core_ids(), len(ranks)) if self.args.pin_cores else None) or [None] * len(ranks)
        if self.args.pin_cores and shares[0] is None:
            log.warning("--pin-cores: %d rank processes for fewer cores; not pinned", len(ranks))
        pipes = [self._spawn(ctx, target, kwargs, cores) for (target, kwargs), cores in zip(ranks, shares)]
        try:
            infos = [_wait_ready(conn, proc) for conn, proc in zip(pipes, self.procs)]
        except BaseException:
            self.stop()
            raise
        failed = [i["error"] for i in infos if not i["ok"]]
        if failed:
            self.stop()
            raise ConfigError(f"the deployment failed to start: {failed[0]}")
        self.info = dict(next((i for i in infos if "model_path" in i), {"model_path": self.args.model_path}))
        # a prefill instance's bootstrap server lists its attention ranks' KV addresses, in rank order
        self.info["disagg_ranks"] = [i["disagg_address"] for i in infos if i.get("disagg_address")]
        return self.info

    def _ranks(self):
        """(process entry point, its keyword arguments but `ready`) per rank; FFN ranks first."""
        if self.args.mode == "single":  # replicas of the whole model: nothing passes between them
            return [
                (run_engine_process, {"args": self.args, "addrs": self.addrs, "rank": i})
                for i in range(self.args.dp_size)
            ]
        from afd_engine.processes.entrypoints import run_attention_worker, run_ffn_worker

        topo = self.spec.topology
        comm = self._comm = self.rendezvous or self._local_peers(topo.num_endpoints)
        ffn_ranks = (
            []
            if topo.colocated or self.role == "attention"
            else (topo.node_ranks(self.node_rank) if self.role == "ffn" else range(topo.num_ffn_ranks))
        )
        attn = [] if self.role == "ffn" else range(topo.num_senders)
        replaced = self._ranks_to_replace() if self.role == "ffn" else None
        rejoin = replaced is not None
        if rejoin:
            ffn_ranks = replaced
        # device index on this machine (GPU base + index): attention ranks first, then FFN ranks;
        # a replacement takes the GPU of the rank it replaces (its place in the node)
        ffn = [
            (
                run_ffn_worker,
                {
                    "args": self.args,
                    "rank": r,
                    "comm_addresses": comm,
                    "local_index": r % topo.ranks_per_node if rejoin else len(attn) + k,
                    **({"rejoin": True} if rejoin else {}),
                },
            )
            for k, r in enumerate(ffn_ranks)
        ]
        return ffn + [
            (run_attention_worker, {"args": self.args, "addrs": self.addrs, "rank": i, "comm_addresses": comm})
            for i in attn
        ]

    def _ranks_to_replace(self) -> list[int] | None:
        """An FFN role started while its fault-tolerant deployment serves replaces the lost ranks
        of its node (None: the deployment is starting, every rank of the node starts)."""
        if not self.args.enable_ffn_fault_tolerance:
            return None
        from afd_engine.processes.rendezvous import DeploymentStore

        store = DeploymentStore(self.rendezvous)
        if not store.serving():
            return None
        node = self.spec.topology.node_ranks(self.node_rank)
        lost = [r for r in store.lost() if r in node]
        if not lost:
            raise ConfigError(
                f"the deployment at {self.rendezvous.address} serves and has recorded no lost rank of FFN node "
                f"{self.node_rank}: nothing to replace (a loss is recorded once noticed, within --comm-timeout)"
            )
        log.info("FFN node %d: replacing lost FFN rank(s) %s of a serving deployment", self.node_rank, lost)
        return lost

    def _local_peers(self, n: int) -> PeerTable:
        """Every endpoint on this machine: shared memory unless --transport says otherwise."""
        from comm.transport.zmq_transport import free_tcp_addresses

        if self.args.transport == "torch":
            self._store = host_local_store()
            return PeerTable(torch=TorchGroup(n, f"127.0.0.1:{self._store.port}", f"afd/torch/{new_namespace()}/"))
        host = shm_host(self.args.transport, n * (n - 1))
        if host:
            self._namespace = new_namespace()
            return PeerTable(hosts=dict.fromkeys(range(n), host), namespace=self._namespace)
        return PeerTable(addresses=dict(enumerate(free_tcp_addresses(n))))

    def _spawn(self, ctx, target, kwargs: dict, cores: list[int] | None = None):
        parent, child = ctx.Pipe(duplex=False)
        name = f"afd-{target.__name__.removeprefix('run_')}-{len(self.procs)}"
        self.procs.append(rank_process.start(ctx, name, target, kwargs, child, cores))
        return parent

    def alive(self) -> bool:
        """Whether every rank whose loss the deployment cannot survive is running: with fault
        tolerance (AFD), any attention rank."""
        if self.fault_tolerant:
            return any(p.is_alive() for p in self.procs[self._num_ffn :])
        return all(p.is_alive() for p in self.procs)

    @property
    def fault_tolerant(self) -> bool:
        return self.args.enable_ffn_fault_tolerance and self.args.mode in ("afd", "colocated")

    @property
    def replaces_attention_ranks(self) -> bool:
        """Whether a lost attention rank gets a replacement that rejoins (AFD with fault tolerance,
        over shared memory or ZeroMQ)."""
        return self.fault_tolerant and self.args.mode == "afd" and self.args.transport != "torch"

    def replace_attention_rank(self, rank: int) -> dict:
        """Starts a replacement of lost attention rank `rank` and waits until it is ready; returns
        its process as the others link to it (incarnation, address, host). ConfigError when it
        cannot start, or when MAX_REPLACEMENTS of it were started already."""
        from afd_engine.processes.entrypoints import run_attention_worker
        from afd_engine.processes.rendezvous import DeploymentStore

        incarnation = self._replacements.get(rank, 0) + 1
        if incarnation > MAX_REPLACEMENTS:
            raise ConfigError(f"attention rank {rank} was replaced {MAX_REPLACEMENTS} times already")
        self._replacements[rank] = incarnation
        index = self._num_ffn + rank
        kwargs = {"args": self.args, "addrs": self.addrs, "rank": rank, "comm_addresses": self._comm}
        parent, child = self._ctx.Pipe(duplex=False)
        name = f"afd-attention_worker-{index}-{incarnation}"
        run = rank_process.start(
            self._ctx, name, run_attention_worker, {**kwargs, "incarnation": incarnation}, child, None
        )
        self.procs[index] = run
        info = _wait_ready(parent, run)
        if not info["ok"]:
            raise ConfigError(f"the replacement of attention rank {rank} failed to start: {info['error']}")
        endpoint = self.spec.topology.sender_endpoint(rank)
        if self.rendezvous is not None:
            address, host = DeploymentStore(self.rendezvous).peer(endpoint)
        else:
            address, host = self._comm.addresses.get(endpoint, ""), self._comm.hosts.get(endpoint, "")
        return {"incarnation": incarnation, "address": address, "host": host}

    def lost_attention_ranks(self) -> set[int]:
        """The attention ranks (of this role) whose process has exited."""
        return {i for i, p in enumerate(self.procs[self._num_ffn :]) if not p.is_alive()}

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            p.join(timeout=timeout / max(len(self.procs), 1))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)  # stop() may run twice (failed start, then exit)
        if self._namespace is not None:  # what ranks that were killed could not remove
            from comm.transport.shm_transport import remove_namespace

            remove_namespace(self._namespace)


def _check_nccl_placement(args: EngineArgs, local_ranks: int) -> None:
    """NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", at the
    first message): --transport torch on GPUs needs a GPU per rank of this machine."""
    if args.transport != "torch" or args.mode == "single" or local_ranks < 2 or args.gpu_id_step:
        return
    if args.device_for(0).type == "cuda":
        raise ConfigError(
            f"--transport torch with --gpu-id-step=0 puts {local_ranks} ranks on one GPU, which NCCL refuses; "
            "give each rank its own GPU (--gpu-id-step 1) or use --transport auto"
        )


def _wait_ready(conn, proc) -> dict:
    if not conn.poll(READY_TIMEOUT_S):
        raise ConfigError(f"{proc.name} did not come up within {READY_TIMEOUT_S} s")
    try:
        return conn.recv()
    except EOFError:
        return {"ok": False, "error": f"{proc.name} exited with code {proc.exitcode} before it was ready"}
