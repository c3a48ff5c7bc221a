"""An FFN rank's part in fault tolerance: its heartbeats, its admission where it replaces a lost
rank, and its part in every recovery (the protocol: fault_tolerance_recovery.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.stager import ExpertStager
from afd_engine.ranks.fault_tolerance import (
    JOIN,
    RECOVER,
    RECOVERED,
    START,
    RecoveryFailed,
    StepAborted,
    agreed,
    ffn_rank,
    from_live_senders,
    join_key,
    join_wait,
    readmit,
    recover_key,
    recover_wait,
    start_key,
)
from afd_engine.ranks.fault_tolerance_liveness import HeartbeatSender
from afd_engine.ranks.spec import DeploymentSpec
from comm.messages import Message
from comm.protocol import STEP_KINDS
from comm.transport.base import Transport

log = logging.getLogger("afd.ffn")


class RecoveryMember:
    """An FFN rank's side: its heartbeats, its admission where it replaces a lost rank, and its
    part in every recovery."""

    def __init__(
        self,
        spec: DeploymentSpec,
        rank: int,
        transport: Transport,
        store,
        incarnation: int,
        use_topology: Callable[..., None],
        cap: int | None = None,
    ) -> None:
        """`store` (rendezvous.DeploymentStore): where a deployment of roles tells where
        replacement ranks are; `incarnation` > 0: this rank replaces a lost one and joins a running
        deployment. `use_topology(expert_map, abandon)`: the owner's endpoint made again for that
        placement's dead ranks and slots (with `abandon`, the old one's waits given up). `cap`: the
        most expert slots it may hold (ranks/expert_capacity.py), sent with its heartbeats."""
        topo = spec.topology
        self.spec, self.rank, self.transport, self.store = spec, rank, transport, store
        self.incarnation, self.enabled = incarnation, spec.args.enable_ffn_fault_tolerance
        self.endpoint = topo.ffn_endpoint(rank)
        self.senders = [topo.sender_endpoint(i) for i in range(topo.num_senders)]
        self.recoveries = 0
        self.readmitted: list[int] = []  # attention endpoints the last recovery brought back
        self.heartbeats = HeartbeatSender(transport, self.endpoint, self.senders, incarnation, rank, cap)
        self._use_topology = use_topology
        if self.enabled and not incarnation:  # a replacement starts once admitted (join)
            self.heartbeats.start()

    def drop_senders(self, dead: list[int]) -> None:
        """Attention endpoints the attention ranks agreed are lost: nothing is awaited from them,
        and nothing sent to them, from now on."""
        self.senders = [ep for ep in self.senders if ep not in dead]
        self.heartbeats.senders = list(self.senders)

    def _lost_named(self, meta: dict) -> list[int]:
        """The attention ranks a plan names lost are dropped; the live ones are left."""
        self.drop_senders(meta.get("dead_senders", []))
        return self.senders

    def check(self, step_id: int) -> None:
        """StepAborted once an attention rank has called a recovery (step_id: the step under way)."""
        if any(self.transport.pending(ep, RECOVER) for ep in self.senders):
            raise StepAborted(f"FFN rank {self.rank}: the attention ranks called a recovery during step {step_id}")

    def link(self, joiners: dict) -> None:
        """Links to the replacements of lost ranks of this node (the others never talk to it)."""
        topo = self.spec.topology
        for ep, incarnation in joiners.items():
            ep = int(ep)
            if topo.node_of_rank(ffn_rank(topo, ep)) == topo.node_of_rank(self.rank):
                readmit(self.transport, self.store, ep, incarnation)

    def join(self, stager: ExpertStager, ready: Callable[[int], None]) -> tuple[ExpertMap, int, dict[int, int]]:
        """A replacement's way in: every attention rank admits it with the placement that uses it
        (it stages its slots and says `eplb_ready` through `ready` like any rank in a rebalance),
        then names the step it first serves, whose descriptor switches every rank to that
        placement. Returns the placement, that step, and the next keepalive id of each attention
        endpoint."""
        wait = join_wait(self.spec.args)
        plans = from_live_senders(
            self.transport, self.senders, JOIN, join_key(self.incarnation), wait, self._lost_named
        )
        plan = agreed(plans, f"FFN rank {self.rank}: the attention ranks disagree on its placement")
        placement = ExpertMap.from_description(self.spec.layout, plan["plan"])
        stager.current = ExpertMap.from_description(self.spec.layout, plan["serving"])  # who holds what now
        self.recoveries = plan["recoveries"]  # the next recovery's key follows theirs
        self.link({ep: n for ep, n in plan["joiners"].items() if int(ep) != self.endpoint})  # this node's, together
        self.heartbeats.start()
        stager.stage(placement, ready)
        starts = {ep: self.transport.recv(ep, START, start_key(self.incarnation), wait).meta for ep in self.senders}
        void = next((m["void"] for m in starts.values() if "void" in m), None)
        if void is not None:
            raise RecoveryFailed(f"FFN rank {self.rank}: the deployment gave up admitting this replacement: {void}")
        step = starts[self.senders[0]]["step"]
        # what was sent to the lost process and reached this one (a reused address): never its
        self.transport.drop_stale(dict.fromkeys(STEP_KINDS, step))
        return placement, step, {ep: m["keepalive"] for ep, m in starts.items()}

    def recover(self, stager: ExpertStager) -> tuple[int, bool]:
        """Takes its part in a recovery: the new placement from every attention rank (they must
        agree), the experts it now holds loaded (copied here or from a live peer of its node, or
        read from the checkpoint), a fresh endpoint over the live ranks, then "recovered" to every
        attention rank. Returns the id of the step that runs next, and whether its expert weights
        moved (its storage grew or shrank)."""
        args, start = self.spec.args, time.monotonic()
        self.recoveries += 1
        key = recover_key(self.recoveries)
        plans = from_live_senders(self.transport, self.senders, RECOVER, key, recover_wait(args), self._lost_named)
        plan = agreed(plans, f"recovery {self.recoveries}: the attention ranks disagree on the placement")
        self.readmitted = [int(ep) for ep in plan.get("readmit_senders", {})]
        for ep, info in plan.get("readmit_senders", {}).items():  # a lost attention rank's replacement
            self.transport.readmit(int(ep), info["address"], info["host"], info["incarnation"])
            self.senders = sorted({*self.senders, int(ep)})
            self.heartbeats.senders = list(self.senders)
        new_map = ExpertMap.from_description(self.spec.layout, plan["placement"])
        self._use_topology(new_map, abandon=True)
        self.transport.drop_stale(dict.fromkeys(STEP_KINDS, plan["next_step"]))
        error, loaded, moved = None, {"peer": 0, "checkpoint": 0}, False
        try:
            stager.cancel()  # a rebalance under way is void: its placement had the lost rank in it
            stager.current = ExpertMap.from_description(self.spec.layout, plan["serving"])
            stager.stage(new_map)
            moved = stager.switch(new_map.version, args.ffn_recovery_timeout)
            loaded = stager.loaded
        except Exception as exc:  # noqa: BLE001 - reported to the attention ranks, which fail fast with it
            error = f"FFN rank {self.rank} could not load its experts of placement {new_map.version}: {exc}"
        answer = {"read": loaded["checkpoint"], "peer": loaded["peer"], "error": error}
        for ep in plans:  # (a replacement admitted by this recovery sent no plan: it expects no answer)
            self.transport.send(ep, Message(RECOVERED, key, self.endpoint, meta=answer))
        if error is not None:
            raise RecoveryFailed(error)
        log.info(
            "FFN rank %d: recovery %d without FFN ranks %s and attention endpoints %s done in %.2f s (%d slots per "
            "layer; %d experts copied from peers, %d read from the checkpoint)",
            self.rank,
            self.recoveries,
            sorted(new_map.dead),
            plan.get("dead_senders", []),
            time.monotonic() - start,
            new_map.sizes[self.rank],
            loaded["peer"],
            loaded["checkpoint"],
        )
        return plan["next_step"], moved

    def stop(self) -> None:
        self.heartbeats.stop()
