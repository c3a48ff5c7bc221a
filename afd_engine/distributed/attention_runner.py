"""An attention rank's step: N micro-batches through the model's operations, MoE layers through
dispatch/combine.

The model hands out its forward as operations; the mode's strategy (operations/strategy.py) puts a
`YieldOperation` between a MoE layer's dispatch and its combine, so the stage that starts with
combine(l) runs on through the attention of layer l+1 to its dispatch (a cross-layer stage):

    [embed, dense layers, attention(l) gate dispatch shared_expert] | [combine(l) join attention(l+1) ...] | ...

The executor runs the stages column by column over the micro-batches, so while micro-batch m's
tokens are at the experts, the others compute attention. In colocated mode the strategy also puts
this rank's expert-serving operations (receive, experts, send_combine) before each combine.

Lockstep: before each step the attention ranks exchange their token counts, and a rank with no
work still steps (with empty micro-batches) while any rank has work, so every rank and FFN rank
runs the same layers and micro-batches. An empty micro-batch computes nothing (layers, embedding, logits), and
sends nothing where its receivers know it is empty: in AFD mode each step descriptor gives the FFN
ranks every micro-batch's token count, so an empty micro-batch sends no dispatch messages (and one
that no attention rank fills is served without any); in colocated mode the agreement round gives
every rank the others' token counts, so a rank without tokens sends none, its peers wait for none
from it and send it no results (at concurrency 1 the idle rank only serves its experts, and the busy
one computes its own experts' share in place, without messages to itself: remote_experts.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import nullcontext

import torch

from afd_engine.distributed.ffn_worker import process_exited, process_space
from afd_engine.distributed.remote_experts import CommExpertServer, RemoteExpertExecutor
from afd_engine.distributed.spec import DeploymentSpec
from afd_engine.distributed.timeline import Timeline
from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.placement import RecoveryImpossible
from afd_engine.eplb.rebalancer import Rebalancer
from afd_engine.eplb.stager import ExpertStager, load_shard
from afd_engine.operations import run_micro_batches, split_micro_batches
from afd_engine.operations.strategy import AFD_ATTENTION, COLOCATED
from afd_engine.runtime.forward_batch import ForwardBatch
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.model_runner import PreparedStep, StepInputs, StepRunner, logit_rows
from afd_engine.runtime.scheduler import StepPlan
from comm.attention_side import attention_endpoint
from comm.endpoint import INTERRUPT_CHECK_S
from comm.ffn_side import ffn_endpoint
from comm.messages import CommError, CommTimeout, KeyMismatchError, Message, MsgKey
from comm.protocol import (
    HEARTBEAT_LAYER,
    JOIN_LAYER,
    KEEPALIVE_LAYER,
    RECOVER_LAYER,
    STEP_KINDS,
    STEP_LAYER,
    SYNC_LAYER,
)
from comm.transport.base import Transport

KEEPALIVE_S = 1.0  # an attention rank that has sent its FFN ranks nothing for this long sends a keepalive
log = logging.getLogger("afd.recovery")


class FfnRankLost(CommError):
    """FFN ranks sent no heartbeat for --comm-timeout (fault tolerance: a recovery follows)."""

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks


class RecoveryFailed(CommError):
    """The deployment cannot go on without its lost FFN ranks; the message says why."""


class PipelineRunner(StepRunner):
    lockstep = True

    def __init__(self, model, pool: KVPool, spec: DeploymentSpec, rank: int, transport: Transport, store=None) -> None:
        """`store` (rendezvous.DeploymentStore, fault tolerance in a deployment of roles): where
        lost ranks are recorded and replacements announce themselves."""
        super().__init__()
        self.model, self.pool = model, pool
        self.spec, self.rank, self.transport = spec, rank, transport
        topo, config = spec.topology, spec.comm_config()
        self.sender = attention_endpoint(topo, rank, transport, config)
        self.server = (
            CommExpertServer(
                ffn_endpoint(topo, rank, transport, config), model.config, pool.device, spec.args.torch_dtype
            )
            if topo.colocated
            else None
        )
        self.peers = [topo.sender_endpoint(i) for i in range(topo.num_senders) if i != rank]
        self.ffn = [] if topo.colocated else [topo.ffn_endpoint(r) for r in range(topo.num_ffn_ranks)]
        stager = None
        if topo.colocated and spec.args.enable_eplb:
            load = functools.partial(load_shard, spec.args, model.config, pool.device)
            stager = ExpertStager(load, rank, model.routed_experts())
        every = spec.args.eplb_rebalance_num_iterations if spec.args.enable_eplb else None
        self.rebalancer = Rebalancer(spec.initial_map(), model.load_recorder, every, transport, self.ffn, stager)
        own = (model.routed_experts(), self.server.endpoint.to_local) if self.server is not None else (None, None)
        self.executor = RemoteExpertExecutor(self.sender, self.rebalancer.map, pool.device, model.load_recorder, *own)
        self.executor.skip_empty = not topo.colocated  # AFD: the FFN ranks know each micro-batch's count
        self.n = spec.args.num_micro_batches
        self.step_id = self.sync_id = self.keepalive_id = 0
        self.last_ffn_send = float("-inf")  # monotonic time of the last message to the FFN ranks
        self.want_stop = False  # shutdown is agreed in a lockstep round, like a step
        self.timeline = Timeline(spec.args.record_timeline, "a", rank)
        strategy = COLOCATED if topo.colocated else AFD_ATTENTION
        ops = model.operations(self.executor, self.server)
        ops = ops.wrap(
            "attention",
            self.timeline.timed("attention", lambda st: st.get("x").shape[0], spec.args.inject_attention_delay_ms),
        )
        self.ops = strategy.arrange(ops.wrap("combine", self.timeline.timed("wait")))
        self.strategy = strategy
        self.ft = spec.args.enable_ffn_fault_tolerance and not topo.colocated
        self.recoveries = 0
        self.experts_read = 0  # by the survivors of every recovery, from the checkpoint
        self.ffn_alive = len(self.ffn)
        self._last: list[dict] | None = None  # the last step's micro-batches, as they were before it ran
        self._heartbeats = {ep: 0 for ep in self.ffn}  # next heartbeat id expected from each FFN rank
        self._heard = dict.fromkeys(self.ffn, time.monotonic())  # when each last sent one
        self._checked = 0.0  # when begin_step last looked at the heartbeats
        self._space = process_space()
        self._pids: dict[int, int] = {}  # FFN endpoint -> its pid, where this rank can look it up
        self._why: dict[int, str] = {}  # FFN rank -> why _lost_ffn counted it lost
        self._beating: set[int] = set()  # FFN endpoints whose current process has sent a heartbeat
        self._admitted = 0.0  # when the replacements in _joiners were admitted
        self.last_recovery: dict | None = None
        self.store = store
        self.incarnations = dict.fromkeys(self.ffn, 0)  # FFN endpoint -> its process's incarnation
        self._seen: dict[int, int] = {}  # replacements announced at the rendezvous, not admitted yet
        self._looked = 0.0  # when the rendezvous was last looked at
        self._joiners: dict[int, int] = {}  # replacements admitted, staging; they serve from the switch
        self._readmit_next: dict[str, int] = {}  # what the next descriptor tells the FFN ranks to readmit
        if store is not None and rank == 0:
            store.set_lost([])  # the deployment serves: an FFN role started from now on replaces
        if self.ft:
            self.sender.interrupt = self._check_ffn

    # -- lockstep --------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.want_stop = True

    def begin_step(self, plan: StepPlan) -> bool:
        """True when any attention rank has work this step (every rank calls this every round)."""
        self._keepalive()
        mine = sum(n for _, n in plan.extend) + len(plan.decode)
        while True:
            round_start = time.monotonic()
            eplb_meta, loads = self.rebalancer.sync_out(self.step_id)
            meta = {"tokens": mine, "stop": self.want_stop, **eplb_meta}
            if self.ft:
                lost = self._lost_ffn() if time.monotonic() - self._checked >= INTERRUPT_CHECK_S else []
                meta.update(lost=lost, failed=False, step_id=self.step_id, joining=self._joining())
            msgs = self._exchange(meta, loads)
            metas = [m.meta for m in msgs]
            if not (self.ft and any(m["lost"] for m in [meta, *metas])):
                if self.ft:
                    self._admit(meta, metas)
                break
            self._recover([meta, *metas], since=round_start)
            if any(m["failed"] for m in metas):  # a peer's step failed: it runs again, this rank's too
                if self._last is None:
                    raise RecoveryFailed(f"attention rank {self.rank} has no step to run again")
                self._run_resilient(self._last)
        with self.timeline.span("eplb_plan", 0, -1) if eplb_meta["eplb_plan"] else nullcontext():
            self.rebalancer.sync_in(self.step_id, [meta, *metas], loads + [t for m in msgs for t in m.tensors])
        self.stopped = self.want_stop or any(m["stop"] for m in metas)
        self.ran = not self.stopped and mine + sum(m["tokens"] for m in metas) > 0
        if self.server is not None:  # colocated: a rank without tokens sends nothing, and nobody waits for it
            tokens = {self.rank: mine, **{ep: m["tokens"] for ep, m in zip(self.peers, metas)}}
            self.executor.expected = mine > 0
            # the only rank with tokens computes its own share in place (remote_experts.py)
            alone = mine > 0 and not any(m["tokens"] for m in metas)
            self.executor.keep_own = alone
            senders = [i for i, n in sorted(tokens.items()) if n > 0 and not (alone and i == self.rank)]
            self.server.senders = [senders] * self.n
        return self.ran

    @property
    def expert_map(self):
        return self.rebalancer.map

    # -- one step --------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> PreparedStep:
        inputs = StepInputs.of(plan)
        seqs = inputs.extend + inputs.decode
        groups = split_micro_batches([len(c.tokens) for c in seqs], self._micro_batches(len(seqs)))
        return PreparedStep(plan, inputs, [self._micro_batch(inputs, g) for g in groups])

    def _exchange(self, meta: dict, tensors: list[torch.Tensor]) -> list[Message]:
        """One agreement round: this rank's meta (and tensors) to every peer, theirs back."""
        key = MsgKey(self.sync_id, SYNC_LAYER, 0)
        for peer in self.peers:
            self.transport.send(peer, Message("sync", key, self.sender.endpoint, tensors, meta))
        # with fault tolerance a peer may first sit out a lost rank's timeout and a recovery
        args = self.spec.args
        wait = args.comm_timeout * 2 + args.ffn_recovery_timeout if self.ft else args.comm_timeout
        msgs = [self.transport.recv(p, "sync", key, wait) for p in self.peers]
        self.sync_id += 1
        return msgs

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor:
        with self.timeline.span("step", 0, -1, step.num_tokens):
            return self._run_resilient(step.batches)

    @torch.inference_mode()
    def _run_resilient(self, batches: list[dict]) -> torch.Tensor:
        """Runs a step; with fault tolerance, once an FFN rank is lost, the recovery, and the step
        again from the same inputs (its KV writes write the same values again)."""
        if not self.ft:
            return self._run(batches)
        before = [dict(m) for m in batches]
        while True:
            attempt = time.monotonic()
            try:
                out = self._run(batches)
                self._last = before
                return out
            except FfnRankLost as exc:
                log.warning("attention rank %d: step %d failed: %s", self.rank, self.step_id, exc)
                meta = {"tokens": 0, "stop": False, "lost": exc.ranks, "failed": True, "step_id": self.step_id}
                self._recover([meta, *(m.meta for m in self._exchange(meta, []))], since=attempt)
                batches = [dict(m) for m in before]

    # -- fault tolerance: replacements --------------------------------------------------------

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
                if incarnation > self.incarnations.get(ep, 0):
                    self._seen[ep] = incarnation
        return {str(ep): n for ep, n in self._seen.items()}

    def _admit(self, meta: dict, metas: list[dict]) -> None:
        """Replacements every attention rank has seen (the same incarnation) are admitted: links
        to them, and a placement that uses them (the first one's, without the ranks still lost),
        staged by every FFN rank as for a rebalance."""
        views = [m.get("joining") or {} for m in [meta, *metas]]
        agreed = {int(ep): n for ep, n in views[0].items() if all(v.get(ep) == n for v in views)}
        if not agreed:
            return
        topo, now = self.spec.topology, time.monotonic()
        for ep, incarnation in list(agreed.items()):
            self.incarnations[ep] = incarnation  # seen: not reported again, whatever comes of it
            try:
                self.transport.readmit(ep, *self.store.peer(ep), incarnation)
            except CommError as exc:  # every attention rank fails alike: all leave it out
                log.warning(
                    "attention rank %d: cannot admit the replacement of FFN rank %d: %s",
                    self.rank,
                    ep - topo.num_senders,
                    exc,
                )
                del agreed[ep]
                continue
            self._heartbeats[ep], self._heard[ep] = 0, now
            self._pids.pop(ep, None)
            self._beating.discard(ep)
        if not agreed:
            return
        version = self.rebalancer.next_version
        still = self.rebalancer.map.dead - {ep - topo.num_senders for ep in agreed}
        full = ExpertMap(self.spec.layout, self.spec.initial_map().placements, version)
        new = full.without_ranks(still, version) if still else full
        self.rebalancer.admit(new, self.ffn + sorted(agreed))
        for ep, incarnation in agreed.items():
            key = MsgKey(incarnation, JOIN_LAYER, 0)
            meta = {
                "plan": new.describe(),
                "recoveries": self.recoveries,  # the recovery count keys its messages
                "joiners": {str(e): n for e, n in agreed.items()},  # replacements of its node link to each other
            }
            self.transport.send(ep, Message("join", key, self.sender.endpoint, meta=meta))
        self._joiners, self._seen, self._admitted = agreed, {}, now
        self._readmit_next = {str(ep): n for ep, n in agreed.items()}
        log.warning(
            "attention rank %d: admitted replacement FFN rank(s) %s; they serve once placement %d is staged",
            self.rank,
            sorted(ep - topo.num_senders for ep in agreed),
            version,
        )

    def _void_admission(self, why: str) -> None:
        """An admission under way is given up (its placement is void): the replacements are told,
        and exit; they may be started again."""
        for ep, incarnation in self._joiners.items():
            key = MsgKey(incarnation, JOIN_LAYER, 1)
            self.transport.send(ep, Message("start", key, self.sender.endpoint, meta={"void": why}))
        self._joiners, self._seen = {}, {}

    def _serve_joiners(self) -> None:
        """The step that switches to the placement using the replacements: they learn its id,
        and from it on get descriptors and tokens."""
        topo, new = self.spec.topology, self.rebalancer.map
        for ep, incarnation in self._joiners.items():
            meta = {"step": self.step_id, "keepalive": self.keepalive_id}
            self.transport.send(
                ep, Message("start", MsgKey(incarnation, JOIN_LAYER, 1), self.sender.endpoint, meta=meta)
            )
        live = self._endpoints_without(new.dead)
        self.ffn, self.ffn_alive, self.rebalancer.ffn = live, len(live), live
        self._use_topology(new.dead)
        log.warning(
            "attention rank %d: FFN rank(s) %s serve again from step %d (placement %d, %d FFN ranks)",
            self.rank,
            sorted(ep - topo.num_senders for ep in self._joiners),
            self.step_id,
            new.version,
            len(live),
        )
        self._joiners = {}
        if self.store is not None and self.rank == 0:
            self.store.set_lost(new.dead)

    def _endpoints_without(self, dead: frozenset[int]) -> list[int]:
        """The endpoints of the FFN ranks not in `dead`, in rank order."""
        topo = self.spec.topology
        return [topo.ffn_endpoint(r) for r in range(topo.num_ffn_ranks) if r not in dead]

    def _use_topology(self, dead: frozenset[int]) -> None:
        """A fresh sender endpoint for these dead ranks (relays move with them)."""
        topo = dataclasses.replace(self.spec.topology, dead=dead)
        sender = attention_endpoint(topo, self.rank, self.transport, self.spec.comm_config())
        sender.stats, sender.interrupt = self.sender.stats, self._check_ffn
        self.sender = self.executor.endpoint = sender

    # -- fault tolerance: losses --------------------------------------------------------------

    def _lost_ffn(self) -> list[int]:
        """The FFN ranks (not endpoints) that have sent no heartbeat for --comm-timeout, or whose
        process (on this machine) has exited; and replacements being admitted that are lost, or
        not staged within --ffn-recovery-timeout + --comm-timeout."""
        now = self._checked = time.monotonic()
        watched = self.ffn + sorted(self._joiners)
        for ep in watched:
            self._take_heartbeats(ep, now)
        args, lost = self.spec.args, {}
        for ep in watched:
            rank = ep - self.spec.topology.num_senders
            if ep in self._pids and process_exited(self._pids[ep]):
                lost[rank] = "its process exited"
            elif now - self._heard[ep] > args.comm_timeout:
                lost[rank] = f"no heartbeat for {now - self._heard[ep]:.1f} s" + (
                    "" if ep in self._beating else " (none ever: was it started without --enable-ffn-fault-tolerance?)"
                )
            elif ep in self._joiners and now - self._admitted > args.ffn_recovery_timeout + args.comm_timeout:
                lost[rank] = "a replacement that did not stage its experts within --ffn-recovery-timeout"
        self._why = lost
        return sorted(lost)

    def _take_heartbeats(self, ep: int, now: float) -> None:
        """Every heartbeat ep's current process has sent; a lost process's (an older incarnation,
        over ZeroMQ, or one that came back after it was given up) are dropped."""
        while True:
            try:
                beat = self.transport.recv(ep, "heartbeat", MsgKey(self._heartbeats[ep], HEARTBEAT_LAYER, 0), 0.0)
            except CommTimeout:
                return
            except KeyMismatchError:  # not the next one expected: take it whatever its id
                beat = self.transport.inbox.pop(ep, "heartbeat")
                if beat is None:
                    return
                if beat.meta.get("incarnation", 0) == self.incarnations.get(ep, 0):
                    self._heartbeats[ep] = beat.key.step  # the current process's: count on from it
            if beat.meta.get("incarnation", 0) != self.incarnations.get(ep, 0):
                continue
            self._heartbeats[ep] += 1
            self._heard[ep] = now
            self._beating.add(ep)
            if self._space and beat.meta.get("space") == self._space:
                self._pids[ep] = beat.meta["pid"]

    def _check_ffn(self) -> None:
        """The interrupt of this rank's waits for results: FfnRankLost once an FFN rank it uses is
        lost (a replacement not serving yet counts in the next agreement round, not here)."""
        serving = {ep - self.spec.topology.num_senders for ep in self.ffn}
        lost = [r for r in self._lost_ffn() if r in serving]
        if lost:
            why = "; ".join(f"FFN rank {r}: {self._why[r]}" for r in lost)
            raise FfnRankLost(lost, f"lost {why} (--comm-timeout {self.spec.args.comm_timeout:g} s)")

    def _recover(self, metas: list[dict], since: float) -> None:
        """Every attention rank runs this after the same round, from the same metas: the lost
        ranks masked, their experts given slots on the survivors, which load them and answer.
        `since`: when the step (or round) that saw the loss began, for the log's pause."""
        args, topo, start = self.spec.args, self.spec.topology, time.monotonic()
        lost = sorted({r for m in metas for r in m["lost"]})
        old = self.rebalancer.map
        try:
            new = old.without_ranks(set(lost), self.rebalancer.next_version)
        except RecoveryImpossible as exc:
            raise RecoveryFailed(
                f"cannot serve without FFN rank(s) {lost}: {exc}; start with more --ep-num-redundant-experts "
                "or more FFN ranks"
            ) from None
        self.recoveries += 1
        key = MsgKey(self.recoveries, RECOVER_LAYER, 0)
        next_step = max(m["step_id"] for m in metas) + 1
        live = self._endpoints_without(new.dead)
        plan = {"placement": new.describe(), "next_step": next_step}
        for ep in live:
            self.transport.send(ep, Message("recover", key, self.sender.endpoint, meta=plan))
        read, deadline = 0, start + args.ffn_recovery_timeout + args.comm_timeout
        for ep in live:
            try:
                answer = self.transport.recv(ep, "recovered", key, max(deadline - time.monotonic(), 0.0)).meta
            except CommTimeout:
                rank = ep - topo.num_senders
                why = self._why.get(rank, "it did not answer") if rank in self._lost_ffn() else "it did not answer"
                raise RecoveryFailed(
                    f"FFN rank {rank} did not take part in the recovery from the loss of FFN rank(s) {lost} within "
                    f"{args.ffn_recovery_timeout + args.comm_timeout:g} s (--ffn-recovery-timeout + --comm-timeout): "
                    f"{why}"
                ) from None
            if answer["error"] is not None:
                raise RecoveryFailed(answer["error"])
            read += answer["read"]
        self.experts_read += read
        self._void_admission(f"FFN rank(s) {lost} were lost while it staged")
        self.rebalancer.recovered(new, live)
        if self.store is not None and self.rank == 0:
            self.store.set_lost(new.dead)
        self.ffn, self.ffn_alive = live, len(live)
        self._heard = {ep: self._heard[ep] for ep in live}
        self._use_topology(new.dead)
        self.executor.expert_map = new
        self.transport.drop_stale({**dict.fromkeys(STEP_KINDS, next_step), "eplb_ready": new.version})
        self.step_id = next_step
        moved = {layer: _moved(old.placements[layer].slot_expert, p.slot_expert) for layer, p in new.placements.items()}
        log.warning(
            "attention rank %d: serving without FFN rank(s) %s after %.2f s of recovery (serving paused %.2f s): "
            "%d FFN ranks left; experts given new slots: %s; %d read from the checkpoint",
            self.rank,
            sorted(new.dead),
            time.monotonic() - start,
            time.monotonic() - since,
            len(live),
            "; ".join(f"layer {layer}: {m}" for layer, m in moved.items() if m) or "none (copies took over)",
            read,
        )
        self.last_recovery = {"lost": lost, "dead": sorted(new.dead), "experts_read": read, "moved": moved}

    def _micro_batches(self, num_seqs: int) -> int:
        """This step's micro-batch count: --micro-batches, or fewer where a lone attention rank
        has fewer sequences (an empty micro-batch still costs a message per layer and peer; with
        several attention ranks the count stays fixed, as they plan their steps apart)."""
        if len(self.peers) > 0:
            return self.n
        return max(1, min(self.n, num_seqs))

    def _run(self, micro: list[dict]) -> torch.Tensor:
        with self.timeline.span("eplb_switch", 0, -1) if self.rebalancer.switching else nullcontext():
            eplb = self.rebalancer.begin_step(self.spec.args.comm_timeout)
        if self._readmit_next:  # the FFN ranks of the replacements' nodes link to them
            eplb["readmit"], self._readmit_next = self._readmit_next, {}
        if self._joiners and "eplb_switch" in eplb:
            self._serve_joiners()
        self.executor.expert_map = self.rebalancer.map
        self._announce([int(m["fb"].num_tokens) for m in micro], extra=eplb)
        self.executor.step = self.step_id
        if self.server is not None:
            self.server.step = self.step_id
        outs = run_micro_batches(self.ops, micro, self.strategy.delays(len(micro)))
        self.rebalancer.end_step()
        self.timeline.end_step(self.step_id)
        self.step_id += 1
        return torch.cat(outs) if outs else torch.empty(0, device=self.pool.device)

    def _micro_batch(self, inputs: StepInputs, group: range) -> dict:
        n_ext = len(inputs.extend)
        ext = [inputs.extend[i] for i in group if i < n_ext]
        dec = [inputs.decode[i - n_ext] for i in group if i >= n_ext]
        fb = ForwardBatch.build(ext, dec, self.pool.page_table, self.pool.page_size, self.pool.device)
        rows = logit_rows(ext + dec, [inputs.rows[i] for i in group], self.pool.device)
        return {"fb": fb, "kv_cache": self.pool.cache, "rows": rows}

    def _announce(self, tokens: list[int], shutdown: bool = False, extra: dict | None = None) -> None:
        """The step descriptor every FFN rank checks before serving the step (`extra`: a
        rebalance's plan or switch)."""
        key = MsgKey(self.step_id, STEP_LAYER, 0)
        meta = {"tokens": tokens, "shutdown": shutdown, **(extra or {})}
        for ep in self.ffn:
            self.transport.send(ep, Message("step", key, self.sender.endpoint, meta=meta))
        self.last_ffn_send = time.monotonic()

    def _keepalive(self) -> None:
        """While idle, tells the FFN ranks every KEEPALIVE_S that this rank is alive: an FFN rank
        on another machine cannot otherwise tell a quiet deployment from a dead one."""
        if not self.ffn or time.monotonic() - self.last_ffn_send < KEEPALIVE_S:
            return
        key = MsgKey(self.keepalive_id, KEEPALIVE_LAYER, 0)
        for ep in self.ffn:
            self.transport.send(ep, Message("keepalive", key, self.sender.endpoint))
        self.keepalive_id += 1
        self.last_ffn_send = time.monotonic()

    def close(self) -> None:
        self._void_admission("the deployment shut down")
        self._announce([], shutdown=True)  # to the live FFN ranks
        self.rebalancer.close()
        if self.server is not None:
            self.server.endpoint.close()


def _moved(before: list[int], after: list[int]) -> str:
    """The slots a recovery gave another expert: "expert 4 -> slot 7, ..."."""
    return ", ".join(f"expert {e} -> slot {s}" for s, (b, e) in enumerate(zip(before, after)) if b != e)
