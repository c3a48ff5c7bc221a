"""Recoveries from lost FFN ranks and admissions of their replacements (fault tolerance): the
protocol, and an attention rank's side of it (an FFN rank's: fault_tolerance_member.py).

A recovery: an attention rank that finds an FFN rank lost (fault_tolerance_liveness.py) says so
in the next agreement round, or fails its step and starts a round of its own; from the same round
every attention rank computes the same placement without the lost ranks (no leader), sends it to
the survivors, which load the experts they now hold and answer, and the interrupted step runs
again under a new step id (RecoveryCoordinator.recover, RecoveryMember.recover). Where spare
copies cannot hold every expert, survivors get more slots than they had, each within the cap its
heartbeats announce (eplb/elastic.py, ranks/expert_capacity.py): the rounds that report a loss
carry the caps each attention rank has heard, so that all plan with the same ones.

An admission: a replacement registers at the rendezvous with the next incarnation of the lost
rank's endpoint; once every attention rank has seen it, they link to it and send it a placement
that uses it, which every FFN rank stages as for an EPLB rebalance, and the step that switches to
that placement is the first it serves (RecoveryCoordinator.admit, RecoveryMember.join).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.placement import Placement, RecoveryImpossible
from afd_engine.eplb.rebalancer import Rebalancer
from afd_engine.ranks.fault_tolerance import (
    JOIN,
    READMIT,
    RECOVER,
    RECOVERED,
    START,
    FfnRankLost,
    RecoveryFailed,
    ffn_rank,
    join_key,
    live_ffn_endpoints,
    readmit,
    recover_key,
    recovery_deadline,
    start_key,
)
from afd_engine.ranks.fault_tolerance_liveness import FfnLiveness, PeerProcesses
from afd_engine.ranks.spec import DeploymentSpec
from comm.endpoint import INTERRUPT_CHECK_S
from comm.messages import CommError, CommTimeout, Message
from comm.protocol import STEP_KINDS
from comm.transport.base import Transport

log = logging.getLogger("afd.recovery")


class RecoveryCoordinator:
    """An attention rank's side: the FFN endpoints in use (`ffn`), the recoveries from lost FFN
    ranks, and the admission of replacements. Every attention rank takes the same decisions from
    the same agreement rounds. Without fault tolerance (`enabled` False) `ffn` never changes."""

    def __init__(
        self,
        spec: DeploymentSpec,
        rank: int,
        transport: Transport,
        rebalancer: Rebalancer,
        ffn: list[int],
        store,
        use_topology: Callable[[ExpertMap], None],
        load_own: Callable[[ExpertMap], tuple[int, int]] | None = None,
        own_cap: int | None = None,
    ) -> None:
        """`store` (rendezvous.DeploymentStore, in a deployment of roles): where lost ranks are
        recorded and replacements announce themselves. `use_topology(expert_map)`: the owner's
        sender endpoint, made again whenever the FFN ranks in use or their slots change.
        Colocated (every rank is also an expert rank): `load_own(expert_map)` loads and serves this
        rank's slots of a recovery's placement, returning the experts (copied, read), and
        `own_cap` is the most slots per MoE layer this rank may hold."""
        topo = spec.topology
        self.spec, self.rank, self.transport, self.rebalancer, self.store = spec, rank, transport, rebalancer, store
        self.enabled = spec.args.enable_ffn_fault_tolerance
        self.colocated, self._load_own, self._own_cap = topo.colocated, load_own, own_cap
        self.endpoint = topo.sender_endpoint(rank)
        self.ffn = ffn  # the FFN endpoints serving, in rank order
        self.recoveries = 0
        self.experts_read = 0  # by the survivors of every recovery, from the checkpoint
        self.experts_copied = 0  # by the survivors of every recovery, from a live peer
        self._caps: dict[int, int] = {}  # FFN rank -> the most expert slots it may hold, as agreed in recoveries
        self.last_recovery: dict | None = None
        self.liveness = FfnLiveness(transport, topo, spec.args.comm_timeout, ffn)
        self._use_topology = use_topology
        self._why: dict[int, str] = {}  # FFN rank -> why _lost counted it lost
        self._seen: dict[int, int] = {}  # replacements announced at the rendezvous, not admitted yet
        self._looked = 0.0  # when the rendezvous was last looked at
        self._joiners: dict[int, int] = {}  # replacements admitted, staging; they serve from the switch
        self._admitted = 0.0  # when the replacements in _joiners were admitted
        self._readmit_next: dict[str, int] = {}  # what the next descriptor tells the FFN ranks to readmit
        # attention peers (sender endpoints): their processes, those lost and agreed on (the FFN
        # ranks expect nothing from them), and those seen lost but not agreed on yet
        self.processes = PeerProcesses()
        self.peers = [topo.sender_endpoint(i) for i in range(topo.num_senders) if i != rank]
        self.dead_senders: set[int] = set()
        self.senders_lost: set[int] = set()
        self.rejoining: dict[int, dict] = {}  # lost peers' replacements, up: endpoint -> their process
        if store is not None and rank == 0:
            store.set_lost([])  # the deployment serves: an FFN role started from now on replaces

    # -- agreement rounds ---------------------------------------------------------------------

    def round_meta(self, step_id: int) -> dict:
        """This rank's part of an agreement round: the FFN ranks it finds lost (looked for at most
        every INTERRUPT_CHECK_S) and the replacements it has seen announced."""
        if not self.enabled:
            return {}
        lost = self._lost() if time.monotonic() - self.liveness.checked >= INTERRUPT_CHECK_S else []
        self.senders_lost.update(self.processes.exited(self.live_peers))
        meta = {
            "lost": lost,
            "lost_attention": sorted(self.senders_lost),
            "failed": False,
            "step_id": step_id,
            "joining": self._joining(),
            "rejoin": self._rejoining(),
            **self.processes.me,
        }
        return {**meta, "caps": self._heard_caps()} if lost or self.senders_lost else meta

    def _rejoining(self) -> dict[str, int]:
        """Replacements of lost attention peers this rank was told of, while no rebalance or
        admission is under way (AFD: a colocated one would need experts placed back on it)."""
        if self.colocated or not self.rebalancer.idle or self._joiners:
            return {}
        return {str(ep): info["incarnation"] for ep, info in sorted(self.rejoining.items())}

    def agreed_rejoin(self, metas: list[dict]) -> dict[int, dict]:
        """The replacements every rank of the round reported, at the same incarnation."""
        views = [m.get("rejoin") or {} for m in metas]
        return {
            int(ep): self.rejoining[int(ep)]
            for ep, n in views[0].items()
            if all(v.get(ep) == n for v in views) and int(ep) in self.rejoining
        }

    @property
    def live_peers(self) -> list[int]:
        """The other attention ranks' endpoints, but those agreed lost."""
        return [ep for ep in self.peers if ep not in self.dead_senders]

    def peer_exited(self, endpoint: int, meta: dict | None) -> bool:
        """Notes a peer's process from its round meta (None: none came yet); with fault tolerance,
        whether that peer's process has exited (it is then lost, to be agreed on in a round)."""
        if not self.enabled:
            return False
        if meta is not None:
            self.processes.heard(endpoint, meta)
            return False
        if self.processes.exited([endpoint]):
            self.senders_lost.add(endpoint)
            return True
        return False

    def unagreed(self, missing: list[int], metas: list[dict]) -> bool:
        """Whether a round that lacks the messages of lost peers `missing` must be voided: no
        rank's meta names them lost, so ranks that did get their messages run the step, and this
        one takes the loss to the next round (where their step, waiting on the lost rank, fails)."""
        named = {ep for m in metas for ep in m.get("lost_attention", ())}
        return bool(set(missing) - named)

    def failure_meta(self, lost: list[int], step_id: int) -> dict:
        """The round of a rank whose step failed on lost FFN ranks: its peers recover with it, and
        run their own step again."""
        self.senders_lost.update(self.processes.exited(self.live_peers))
        meta = {
            "tokens": 0,
            "stop": False,
            "lost": lost,
            "lost_attention": sorted(self.senders_lost),
            "failed": True,
            "step_id": step_id,
            **self.processes.me,
        }
        return {**meta, "caps": self._heard_caps()}

    def _heard_caps(self) -> dict[str, int]:
        """The expert slot caps this rank has heard from the FFN ranks' heartbeats (JSON keys);
        colocated, its own."""
        if self.colocated:
            return {str(self.rank): self._own_cap} if self._own_cap is not None else {}
        return {str(rank): cap for rank, cap in sorted(self.liveness.caps.items())}

    def anyone_lost(self, metas: list[dict]) -> bool:
        """Whether the round calls a recovery: a rank lost, or a lost attention rank's replacement
        to admit."""
        if not self.enabled:
            return False
        return any(m["lost"] or m.get("lost_attention") for m in metas) or bool(self.agreed_rejoin(metas))

    def check(self) -> None:
        """The interrupt of the owner's waits for results: FfnRankLost once an FFN rank it uses is
        lost (a replacement not serving yet counts in the next agreement round, not here)."""
        serving = {ffn_rank(self.spec.topology, ep) for ep in self.ffn}
        lost = [r for r in self._lost() if r in serving]
        if lost:
            why = "; ".join(f"FFN rank {r}: {self._why[r]}" for r in lost)
            raise FfnRankLost(lost, f"lost {why} (--comm-timeout {self.spec.args.comm_timeout:g} s)")
        exited = self.processes.exited(self.live_peers)
        if exited:
            self.senders_lost.update(exited)
            raise FfnRankLost([], f"lost attention rank(s) {exited}: the process exited", attention=exited)

    def _lost(self) -> list[int]:
        """The FFN ranks in use or being admitted that are lost, and replacements not staged within
        --ffn-recovery-timeout + --comm-timeout."""
        lost = self.liveness.lost(self.ffn + sorted(self._joiners))
        if self.liveness.checked - self._admitted > recovery_deadline(self.spec.args):
            for ep in self._joiners:
                why = "a replacement that did not stage its experts within --ffn-recovery-timeout"
                lost.setdefault(ffn_rank(self.spec.topology, ep), why)
        self._why = lost
        return sorted(lost)

    # -- recovery -----------------------------------------------------------------------------

    def recover(self, metas: list[dict], since: float, sync_id: int = 0) -> int:
        """Every attention rank runs this after the same round, from the same metas: the lost
        ranks masked, their experts given slots on the survivors, which load them and answer.
        `since`: when the step (or round) that saw the loss began, for the log's pause. A
        recovery also admits the replacements of lost attention ranks the round agreed on: they
        learn the deployment's state (`sync_id`: the next round's id) and join its next round.
        Returns the id of the step that runs next."""
        topo, start = self.spec.topology, time.monotonic()
        lost = sorted({r for m in metas for r in m["lost"]})
        senders = sorted({ep for m in metas for ep in m.get("lost_attention", ())} - self.dead_senders)
        if self.colocated:  # a lost rank was an expert rank too (sender i is expert rank i)
            lost = sorted(set(lost) | set(senders))
        self.dead_senders.update(senders)
        self.senders_lost -= self.dead_senders
        rejoin = self.agreed_rejoin(metas) if not senders else {}
        for ep, info in rejoin.items():  # its process's links, from now on
            self.transport.readmit(ep, info["address"], info["host"], info["incarnation"])
            self.dead_senders.discard(ep)
            self.processes.pids.pop(ep, None)
            del self.rejoining[ep]
        old = self.rebalancer.map
        for m in metas:  # every rank's caps, the same from every rank that heard them: merged alike
            for rank, cap in m.get("caps", {}).items():
                self._caps[int(rank)] = min(cap, self._caps.get(int(rank), cap))
        try:
            new = old.without_ranks(set(lost), self.rebalancer.next_version, self._caps)
        except RecoveryImpossible as exc:
            raise RecoveryFailed(
                f"cannot serve without FFN rank(s) {lost}: {exc}; start with a larger --ffn-expert-memory-mb, "
                "more --ep-num-redundant-experts or more FFN ranks"
            ) from None
        self.recoveries += 1
        key = recover_key(self.recoveries)
        next_step = max(m["step_id"] for m in metas) + 1
        plan = {
            "placement": new.describe(),
            "serving": old.describe(),
            "next_step": next_step,
            "dead_senders": sorted(self.dead_senders),
            "readmit_senders": {str(ep): info for ep, info in rejoin.items()},
        }
        if self.colocated:
            live, (copied, read) = [], self._load_own(new)
        else:
            live = live_ffn_endpoints(topo, new.dead)
            read, copied = self._remote_recovery(live, plan, key, lost, start)
        self.experts_read += read
        self.experts_copied += copied
        self._void_admission(f"FFN rank(s) {lost}, attention rank(s) {senders} were lost while it staged")
        self.rebalancer.recovered(new, live)
        if self.store is not None and self.rank == 0:
            self.store.set_lost(new.dead)
        self.ffn = live
        self.liveness.keep_only(live)
        self._use_topology(new)
        self.transport.drop_stale({**dict.fromkeys(STEP_KINDS, next_step), "eplb_ready": new.version})
        self._logged(old, new, lost, senders, (start, since), (read, copied), live)
        state = {
            "sync_id": sync_id,
            "step_id": next_step,
            "map": new.describe(),
            "dead_senders": sorted(self.dead_senders),
            "recoveries": self.recoveries,
            "caps": {str(r): c for r, c in sorted(self._caps.items())},
        }
        for ep, info in rejoin.items():
            self.transport.send(ep, Message(JOIN, join_key(info["incarnation"]), self.endpoint, meta=state))
            log.warning(
                "attention rank %d: attention rank %d (replacement %d) rejoins from step %d",
                self.rank,
                ep,
                info["incarnation"],
                next_step,
            )
        return next_step

    def joined(self, state: dict) -> None:
        """A replacement attention rank's view from its admission (`recover`'s state): who is lost,
        the recovery count, the caps, and the FFN ranks in use (watched from now on)."""
        self.dead_senders = set(state["dead_senders"])
        self.recoveries = state["recoveries"]
        self._caps = {int(r): c for r, c in state["caps"].items()}
        new = ExpertMap.from_description(self.spec.layout, state["map"])
        self.ffn = [] if self.colocated else live_ffn_endpoints(self.spec.topology, new.dead)
        self.rebalancer.recovered(new, self.ffn)
        self.liveness = FfnLiveness(self.transport, self.spec.topology, self.spec.args.comm_timeout, self.ffn)
        self._use_topology(new)

    def _remote_recovery(self, live: list[int], plan: dict, key, lost: list[int], start: float) -> tuple[int, int]:
        """Sends the plan to the live FFN ranks and waits for each one's answer: (experts read from
        the checkpoint, copied from a peer)."""
        args, topo = self.spec.args, self.spec.topology
        for ep in live:
            self.transport.send(ep, Message(RECOVER, key, self.endpoint, meta=plan))
        read, copied, deadline = 0, 0, start + recovery_deadline(args)
        for ep in live:
            try:
                answer = self.transport.recv(ep, RECOVERED, key, max(deadline - time.monotonic(), 0.0)).meta
            except CommTimeout:
                rank = ffn_rank(topo, ep)
                why = self._why.get(rank, "it did not answer") if rank in self._lost() else "it did not answer"
                raise RecoveryFailed(
                    f"FFN rank {rank} did not take part in the recovery from the loss of FFN rank(s) {lost} within "
                    f"{recovery_deadline(args):g} s (--ffn-recovery-timeout + --comm-timeout): {why}"
                ) from None
            if answer["error"] is not None:
                raise RecoveryFailed(answer["error"])
            read += answer["read"]
            copied += answer.get("peer", 0)
        return read, copied

    def _logged(self, old, new, lost, senders, times, loaded, live) -> None:
        """Logs a recovery (and keeps what /expert_load reports of it). `times`: when it started
        and when the step that saw the loss began; `loaded`: experts (read, copied)."""
        (start, since), (read, copied) = times, loaded
        moved = {layer: _moved(old.placements[layer], p) for layer, p in new.placements.items()}
        if senders:
            log.warning(
                "attention rank %d: serving without attention rank(s) %s after %.2f s of recovery (serving paused "
                "%.2f s): %d attention ranks left; their requests resume on the others",
                self.rank,
                senders,
                time.monotonic() - start,
                time.monotonic() - since,
                len(self.live_peers) + 1,
            )
        if not lost or (self.colocated and lost == senders):
            return
        log.warning(
            "attention rank %d: serving without FFN rank(s) %s after %.2f s of recovery (serving paused %.2f s): "
            "%d FFN ranks left%s; experts given new slots: %s; %d copied from a live peer, %d read from the checkpoint",
            self.rank,
            sorted(new.dead),
            time.monotonic() - start,
            time.monotonic() - since,
            len(live),
            f", their slots grown to {_grown(old, new)}" if new.sizes != old.sizes else "",
            "; ".join(f"layer {layer}: {m}" for layer, m in moved.items() if m) or "none (copies took over)",
            copied,
            read,
        )
        self.last_recovery = {
            "lost": lost,
            "dead": sorted(new.dead),
            "experts_read": read,
            "experts_copied": copied,
            "slots": list(new.sizes),
            "moved": moved,
        }

    # -- admission of replacements --------------------------------------------------------------

    def _joining(self) -> dict[str, int]:
        """Replacements of lost ranks announced at the rendezvous (looked at once a second, and
        reported every round from then on, so that the ranks agree in one round)."""
        dead = self.rebalancer.map.dead
        if self.store is None or not dead or self._joiners or not self.rebalancer.idle:
            return {}
        if time.monotonic() - self._looked >= 1.0:
            self._looked = time.monotonic()
            for rank in dead:
                ep = self.spec.topology.ffn_endpoint(rank)
                incarnation = self.store.incarnation(ep)
                if incarnation > self.liveness.incarnations.get(ep, 0):
                    self._seen[ep] = incarnation
        return {str(ep): n for ep, n in self._seen.items()}

    def admit(self, metas: list[dict]) -> None:
        """Replacements every attention rank has seen (the same incarnation) are admitted: links
        to them, and a placement that uses them (the first one's, without the ranks still lost),
        staged by every FFN rank as for a rebalance. `metas`: the round's, this rank's first."""
        if not self.enabled:
            return
        views = [m.get("joining") or {} for m in metas]
        agreed_on = {int(ep): n for ep, n in views[0].items() if all(v.get(ep) == n for v in views)}
        if not agreed_on:
            return
        topo, now = self.spec.topology, time.monotonic()
        for ep, incarnation in list(agreed_on.items()):
            self.liveness.incarnations[ep] = incarnation  # seen: not reported again, whatever comes of it
            try:
                readmit(self.transport, self.store, ep, incarnation)
            except CommError as exc:  # every attention rank fails alike: all leave it out
                log.warning(
                    "attention rank %d: cannot admit the replacement of FFN rank %d: %s",
                    self.rank,
                    ffn_rank(topo, ep),
                    exc,
                )
                del agreed_on[ep]
                continue
            self.liveness.restart(ep, now)
        if not agreed_on:
            return
        version = self.rebalancer.next_version
        still = self.rebalancer.map.dead - {ffn_rank(topo, ep) for ep in agreed_on}
        full = ExpertMap(self.spec.layout, self.spec.initial_map().placements, version)
        new = full.without_ranks(still, version, self._caps) if still else full
        self.rebalancer.admit(new, self.ffn + sorted(agreed_on))
        for ep, incarnation in agreed_on.items():
            meta = {
                "plan": new.describe(),
                "serving": self.rebalancer.map.describe(),  # who holds what: its experts may come from them
                "recoveries": self.recoveries,  # the recovery count keys its messages
                "joiners": {str(e): n for e, n in agreed_on.items()},  # replacements of its node link to each other
                "dead_senders": sorted(self.dead_senders),  # attention ranks lost: nothing comes from them
            }
            self.transport.send(ep, Message(JOIN, join_key(incarnation), self.endpoint, meta=meta))
        self._joiners, self._seen, self._admitted = agreed_on, {}, now
        self._readmit_next = {str(ep): n for ep, n in agreed_on.items()}
        log.warning(
            "attention rank %d: admitted replacement FFN rank(s) %s; they serve once placement %d is staged",
            self.rank,
            sorted(ffn_rank(topo, ep) for ep in agreed_on),
            version,
        )

    def on_step(self, descriptor: dict, step_id: int, keepalive_id: int) -> None:
        """Adds to a step's descriptor (its rebalance parts given) what admissions need: once, the
        replacements the FFN ranks of their node link to; and where the step switches to the
        placement using the replacements, they learn its id, and from it on get descriptors."""
        if self._readmit_next:
            descriptor[READMIT], self._readmit_next = self._readmit_next, {}
        if self._joiners and "eplb_switch" in descriptor:
            self._serve_joiners(step_id, keepalive_id)

    def _serve_joiners(self, step_id: int, keepalive_id: int) -> None:
        topo, new = self.spec.topology, self.rebalancer.map
        for ep, incarnation in self._joiners.items():
            meta = {"step": step_id, "keepalive": keepalive_id}
            self.transport.send(ep, Message(START, start_key(incarnation), self.endpoint, meta=meta))
        live = live_ffn_endpoints(topo, new.dead)
        self.ffn = self.rebalancer.ffn = live
        self._use_topology(new)
        log.warning(
            "attention rank %d: FFN rank(s) %s serve again from step %d (placement %d, %d FFN ranks)",
            self.rank,
            sorted(ffn_rank(topo, ep) for ep in self._joiners),
            step_id,
            new.version,
            len(live),
        )
        self._joiners = {}
        if self.store is not None and self.rank == 0:
            self.store.set_lost(new.dead)

    def _void_admission(self, why: str) -> None:
        """An admission under way is given up (its placement is void): the replacements are told,
        and exit; they may be started again."""
        for ep, incarnation in self._joiners.items():
            self.transport.send(ep, Message(START, start_key(incarnation), self.endpoint, meta={"void": why}))
        self._joiners, self._seen = {}, {}

    def close(self) -> None:
        self._void_admission("the deployment shut down")


def _moved(before: Placement, after: Placement) -> str:
    """The slots a recovery gave another expert: "expert 4 -> slot 7, ..." (slots of `after`; a
    rank's slots added by the recovery count, and a grown rank shifts the later ranks' slots)."""
    out = []
    for rank in range(len(after.rank_sizes)):
        was = [before.slot_expert[s] for s in before.rank_range(rank)]
        for i, slot in enumerate(after.rank_range(rank)):
            if i >= len(was) or was[i] != after.slot_expert[slot]:
                out.append(f"expert {after.slot_expert[slot]} -> slot {slot}")
    return ", ".join(out)


def _grown(old: ExpertMap, new: ExpertMap) -> str:
    """The slots per layer of the FFN ranks a recovery grew: "rank 0: 8 -> 16, ..."."""
    return ", ".join(f"rank {r}: {a} -> {b}" for r, (a, b) in enumerate(zip(old.sizes, new.sizes)) if a != b)
