"""An FFN rank: headless, stateless; serves its experts for every attention rank, step by step.

Between steps it waits for every attention rank's descriptor, counting the keepalives idle
attention ranks send: an attention rank heard from once and then silent for `--comm-timeout`
seconds has died without shutting down (killed, machine lost), and the FFN rank stops with
PeerLostError instead of waiting forever.

Per step it checks every attention rank's descriptor (same step id, else KeyMismatchError), then
runs, for each MoE layer and micro-batch, the expert side of the model's operations (post_dispatch,
receive, experts, send_combine) arranged by the FFN strategy (operations/strategy.py): per layer
[post_dispatch] [receive experts] [send_combine] plus N-2 empty stages, rows staggered by one, so
the receive of micro-batch m+1 is posted (relaying starts in the background) before the combine
of m, and never holds that combine back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable

import torch

from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.peer_copy import PeerCopies
from afd_engine.eplb.stager import ExpertStager
from afd_engine.operations import run_micro_batches
from afd_engine.operations.strategy import AFD_FFN
from afd_engine.ranks.expert_capacity import expert_capacity
from afd_engine.ranks.fault_tolerance import (
    READMIT,
    DescriptorMismatchError,
    PeerLostError,
    StepAborted,
    silence_limit,
)
from afd_engine.ranks.fault_tolerance_member import RecoveryMember
from afd_engine.ranks.remote_experts import CommExpertServer
from afd_engine.ranks.spec import DeploymentSpec
from afd_engine.ranks.static_decode import AddressGuard, expert_addresses, expert_graphs, static_received
from afd_engine.ranks.timeline import Timeline
from comm.endpoint import INTERRUPT_CHECK_S
from comm.ffn_side import ffn_endpoint
from comm.messages import CommTimeout, KeyMismatchError, Message, MsgKey
from comm.protocol import EPLB_LAYER, KEEPALIVE_LAYER, STEP_LAYER
from comm.transport.base import Transport

log = logging.getLogger("afd.ffn")
LIVENESS_CHECK_S = 1.0  # how often a waiting FFN rank checks that its attention ranks are alive


def _aborted() -> None:
    raise StepAborted("the step was given up for a recovery")


def check_descriptors(metas: dict[int, dict], num_micro_batches: int, step: int) -> int | None:
    """metas: attention endpoint -> its descriptor of `step`. None when the step is the shutdown,
    else the step's micro-batch count.

    Every descriptor must agree on shutdown, and each working one must give a non-negative token
    count per micro-batch, for one to `num_micro_batches` micro-batches (a lone attention rank
    runs fewer when it has fewer sequences), the same number in every descriptor: a rank started
    with more --micro-batches, or a desynchronised one, is an error here instead of a hang in the
    layers.
    """
    shutdown = {ep: bool(m.get("shutdown")) for ep, m in metas.items()}
    if len(set(shutdown.values())) > 1:
        raise DescriptorMismatchError(f"step {step}: attention endpoints disagree on shutdown: {shutdown}")
    if any(shutdown.values()):
        return None
    bad = {ep: m.get("tokens") for ep, m in metas.items() if not _valid_counts(m.get("tokens"), num_micro_batches)}
    if bad:
        raise DescriptorMismatchError(
            f"step {step}: expected 1 to {num_micro_batches} token counts (one per micro-batch) from every "
            f"attention endpoint, got {bad}: start every role with the same --micro-batches"
        )
    counts = {ep: len(m["tokens"]) for ep, m in metas.items()}
    if len(set(counts.values())) > 1:
        raise DescriptorMismatchError(f"step {step}: attention endpoints disagree on the micro-batch count: {counts}")
    for field in ("eplb_plan", "eplb_switch", READMIT):
        if len({json.dumps(m.get(field), sort_keys=True) for m in metas.values()}) > 1:
            raise DescriptorMismatchError(f"step {step}: attention endpoints disagree on {field}")
    return next(iter(counts.values()))


def _valid_counts(tokens, n: int) -> bool:
    return (
        isinstance(tokens, list)
        and 1 <= len(tokens) <= n
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
    )


class FfnWorker:
    def __init__(
        self,
        shard,
        spec: DeploymentSpec,
        rank: int,
        transport: Transport,
        device: torch.device | str = "cpu",
        load_shard: Callable[[dict[int, list[int]]], torch.nn.Module] | None = None,
        store=None,
        incarnation: int = 0,
    ) -> None:
        """`load_shard(slots)` loads the experts a rebalance moves here (see eplb/stager.py).
        `store` (rendezvous.DeploymentStore): where a deployment of roles tells where replacement
        ranks are; `incarnation` > 0: this rank replaces a lost one and joins a running deployment."""
        self.shard, self.spec, self.rank, self.transport = shard, spec, rank, transport
        self._plan: ExpertMap | None = None  # the placement staged last (its dead ranks too)
        topo = spec.topology
        self.stager = None
        if load_shard is not None:  # experts a live peer of this node holds come from it (eplb/peer_copy.py)
            wait = spec.args.ffn_recovery_timeout + spec.args.comm_timeout
            peers = PeerCopies(transport, rank, topo.ffn_endpoint, topo.ranks_per_node, wait)
            held = shard.routed_experts()
            self.stager = ExpertStager(load_shard, rank, held, spec.initial_map(), peers, empty=incarnation > 0)
        self._to_stage: ExpertMap | None = None  # a placement announced in this step's descriptor
        endpoint = ffn_endpoint(topo, rank, transport, spec.comm_config())
        static = static_received(spec.args, shard.config, torch.device(device))
        self.server = CommExpertServer(endpoint, shard.config, device, spec.args.torch_dtype, static)
        experts = shard.routed_experts()
        addresses = lambda: static.addresses() + expert_addresses(experts)  # noqa: E731
        self.guard = AddressGuard(addresses, f"FFN rank {rank}") if static is not None else None
        self.device = torch.device(device)
        self._capture_graphs()
        self.senders = [topo.sender_endpoint(i) for i in range(topo.num_senders)]
        self.n = spec.args.num_micro_batches
        self.step_id = 0
        self.heard = {ep: None for ep in self.senders}  # monotonic time of each sender's last message
        self.keepalives = {ep: 0 for ep in self.senders}  # next keepalive id expected from each sender
        self.timeline = Timeline(spec.args.record_timeline, "f", rank)
        ops = shard.operations(self.server).wrap("receive", self.timeline.timed("recv"))
        ops = ops.wrap(
            "experts",
            self.timeline.timed(
                "ffn",
                lambda st: st.get("received").hidden.shape[0],
                spec.args.inject_ffn_delay_ms,
                (lambda st: int((st.get("received").local_ids >= 0).sum()), spec.args.inject_ffn_delay_us_per_token),
            ),
        )
        # the model's layers, and apart from them the MTP draft module's (speculative decoding: its
        # passes are steps whose descriptors say "draft")
        main = tuple(la for la in ops.layers if la.layer_id < shard.config.num_layers)
        self.ops = dataclasses.replace(ops, layers=main)
        self.draft_ops = dataclasses.replace(ops, layers=tuple(la for la in ops.layers if la not in main))
        self.draft = False  # whether the step being served is a draft pass
        self._arranged: dict[tuple[int, bool], list[object]] = {}  # (micro-batches, draft) -> the operations
        # fault tolerance: heartbeats (the attention ranks tell a lost FFN rank by their absence),
        # admission as a replacement, recoveries
        ft = spec.args.enable_ffn_fault_tolerance
        cap = expert_capacity(spec.args.ffn_expert_memory_mb, experts, self.device, rank) if ft else None
        self.recovery = RecoveryMember(spec, rank, transport, store, incarnation, self._use_topology, cap)
        self.ft = self.recovery.enabled
        if self.ft:
            self.server.endpoint.interrupt = self._interrupt

    def run(self) -> None:
        if self.recovery.incarnation:
            self._join()
        try:
            while True:
                try:
                    if not self._serve_step():
                        break
                except StepAborted:
                    self._recover()
        finally:
            self.recovery.stop()
        self.server.endpoint.close()
        if self.stager is not None:
            self.stager.close()

    def _serve_step(self) -> bool:
        """Serves the next step; False on shutdown."""
        count = self._next_step()
        if count is None:
            return False
        self.server.step = self.step_id
        if self.guard is not None:  # a switch or recovery of the last step copied, not rebound
            self.guard.check()
        key = (count, self.draft)
        if key not in self._arranged:
            self._arranged[key] = AFD_FFN.arrange(self.draft_ops if self.draft else self.ops, count)
        with torch.inference_mode():
            run_micro_batches(self._arranged[key], [{} for _ in range(count)], AFD_FFN.delays(count))
        if self._to_stage is not None:
            self.stager.stage(self._to_stage, self._ready)
            self._to_stage = None
        self.timeline.end_step(self.step_id)
        self.step_id += 1
        return True

    # -- fault tolerance (the protocol: fault_tolerance_recovery.py) --------------------------

    def _capture_graphs(self) -> None:
        """The expert graphs over the weights as they are now (at start, and after they moved)."""
        experts = self.shard.routed_experts()
        static = self.server.static
        self.server.graphs = expert_graphs(self.spec.args, self.shard.config, experts, static, self.device)
        if self.server.graphs is not None and self.server.graphs.capture:
            seconds = self.server.graphs.capture_all()
            log.info(
                "FFN rank %d: captured %d expert graphs in %.1f s", self.rank, len(self.server.graphs.graphs), seconds
            )

    def _switched(self, moved: bool) -> None:
        """After a switch: where the expert weights moved (the slot count changed), the graphs are
        captured again over them and the static-decode guard watches their new addresses."""
        if not moved:
            return
        self._capture_graphs()
        if self.guard is not None:
            self.guard.expected = self.guard.addresses()
        slots = self.stager.current.sizes[self.rank]
        log.warning("FFN rank %d: holds %d expert slots per MoE layer from now on", self.rank, slots)

    def _join(self) -> None:
        """A replacement's way in (RecoveryMember.join): it serves from the step the attention
        ranks name, over the endpoint of the placement that uses it."""
        self._plan, self.step_id, self.keepalives = self.recovery.join(self.stager, self._ready)
        self.senders = list(self.recovery.senders)
        self._use_topology(self._plan)
        log.info(
            "FFN rank %d (replacement %d) joined: it serves from step %d",
            self.rank,
            self.recovery.incarnation,
            self.step_id,
        )

    def _recover(self) -> None:
        """Its part in a recovery (RecoveryMember.recover); then on from the step it names, over
        the attention ranks still in use."""
        self._to_stage = None
        self.step_id, moved = self.recovery.recover(self.stager)
        self._switched(moved)
        self.senders = list(self.recovery.senders)
        self.heard = dict.fromkeys(self.senders, time.monotonic())  # they were busy recovering, not gone
        for ep in self.recovery.readmitted:  # a replacement process counts its keepalives from 0
            self.keepalives[ep] = 0

    def _interrupt(self) -> None:
        """Called while a receive waits: StepAborted once an attention rank calls a recovery."""
        self.recovery.check(self.step_id)

    def _use_topology(self, expert_map: ExpertMap, abandon: bool = False) -> None:
        """A fresh endpoint where the placement's dead ranks or slots per rank differ from the
        current endpoint's; with `abandon` (a recovery) a fresh one in any case, the old one's
        relay threads still waiting on the lost step giving up at once."""
        old = self.server.endpoint
        topo = self.spec.topology_of(expert_map)
        if old.topo == topo and not abandon:
            return
        if abandon:
            old.interrupt = _aborted
        old.close(drain=not abandon)
        self.server.endpoint = ffn_endpoint(topo, self.rank, self.transport, self.spec.comm_config())
        self.server.endpoint.interrupt = self._interrupt if self.ft else None

    def _next_step(self) -> int | None:
        """Waits for every attention rank's descriptor of the next step; its micro-batch count, or
        None on shutdown."""
        key = MsgKey(self.step_id, STEP_LAYER, 0)
        metas = {ep: self._descriptor(ep, key).meta for ep in self.senders}
        count = check_descriptors(metas, self.n, self.step_id)
        if count is not None:
            self.draft = bool(metas[self.senders[0]].get("draft"))
            self._rebalance(metas[self.senders[0]])
            # an empty micro-batch of an attention rank sends nothing (RemoteExpertExecutor.skip_empty),
            # nor does a lost one (AFD: sender i is endpoint i)
            self.server.senders = [[ep for ep in self.senders if metas[ep]["tokens"][m] > 0] for m in range(count)]
        return count

    def _rebalance(self, meta: dict) -> None:
        """A descriptor's rebalance parts: stage a new placement (answering every attention rank
        when loaded), or serve the staged one from this step on."""
        if READMIT in meta:  # the FFN ranks of the replacements' nodes link to them
            self.recovery.link(meta[READMIT])
        if "eplb_plan" not in meta and "eplb_switch" not in meta:
            return
        if self.stager is None:
            raise DescriptorMismatchError(f"step {self.step_id}: told to rebalance, but this rank cannot load experts")
        if "eplb_plan" in meta:  # staged once this step is served, not competing with it
            self._to_stage = self._plan = ExpertMap.from_description(self.spec.layout, meta["eplb_plan"])
        if "eplb_switch" in meta:
            self._switched(self.stager.switch(meta["eplb_switch"], self.spec.args.comm_timeout))
            if self._plan is not None and self._plan.version == meta["eplb_switch"]:
                self._use_topology(self._plan)  # a replacement serves from this step on

    def _ready(self, version: int) -> None:
        """Tells every attention rank that `version` is staged, and where its experts came from."""
        me, loaded = self.spec.topology.ffn_endpoint(self.rank), dict(self.stager.loaded)
        for ep in self.senders:
            self.transport.send(ep, Message("eplb_ready", MsgKey(version, EPLB_LAYER, 0), me, meta={"loaded": loaded}))

    def _descriptor(self, ep: int, key: MsgKey):
        """The step descriptor from attention endpoint ep, however long an idle deployment takes;
        PeerLostError once ep, heard from before, has been silent past the comm timeout."""
        while True:
            try:
                msg = self.transport.recv(ep, "step", key, INTERRUPT_CHECK_S if self.ft else LIVENESS_CHECK_S)
            except CommTimeout:
                if self.ft:
                    self._interrupt()
                self._take_keepalives(ep)
                silent = time.monotonic() - self.heard[ep] if self.heard[ep] is not None else 0.0
                limit = silence_limit(self.spec.args, self.ft)
                if silent > limit:
                    raise PeerLostError(
                        f"attention endpoint {ep} sent no step and no keepalive for {silent:.0f} s "
                        f"(limit {limit:g} s): it stopped without shutting down "
                        f"(killed, or its machine is gone); FFN rank {self.rank} stops"
                    ) from None
                continue
            self._take_keepalives(ep)  # the ones sent before this descriptor: none stay queued
            self.heard[ep] = time.monotonic()
            return msg

    def _take_keepalives(self, ep: int) -> None:
        while True:
            try:
                self.transport.recv(ep, "keepalive", MsgKey(self.keepalives[ep], KEEPALIVE_LAYER, 0), 0.0)
            except CommTimeout:
                return
            except KeyMismatchError:  # one meant for the process this one replaces: out of the way
                old = self.transport.inbox.pop(ep, "keepalive")
                if old is None or old.key.step < self.keepalives[ep]:
                    continue
                self.keepalives[ep] = old.key.step
            self.keepalives[ep] += 1
            self.heard[ep] = time.monotonic()
