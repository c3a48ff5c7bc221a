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

import functools
import logging
import time
from contextlib import nullcontext

import torch

from afd_engine.eplb.rebalancer import Rebalancer
from afd_engine.eplb.stager import ExpertStager, load_shard
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.operations import run_micro_batches, split_micro_batches
from afd_engine.operations.strategy import AFD_ATTENTION, COLOCATED
from afd_engine.ranks.expert_capacity import expert_capacity
from afd_engine.ranks.fault_tolerance import (
    JOIN,
    FfnRankLost,
    RecoveryFailed,
    agreed,
    from_live_senders,
    join_key,
    join_wait,
    round_wait,
)
from afd_engine.ranks.fault_tolerance_recovery import RecoveryCoordinator
from afd_engine.ranks.remote_experts import CommExpertServer, RemoteExpertExecutor
from afd_engine.ranks.spec import DeploymentSpec
from afd_engine.ranks.static_decode import expert_graphs, graphs_on, static_received
from afd_engine.ranks.static_stages import StaticAttention
from afd_engine.ranks.timeline import Timeline
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.model_runner import PreparedStep, StepInputs, StepRunner, logit_rows
from afd_engine.runtime.scheduler import StepPlan
from comm.attention_side import attention_endpoint
from comm.endpoint import INTERRUPT_CHECK_S
from comm.ffn_side import ffn_endpoint
from comm.messages import CommTimeout, Message, MsgKey
from comm.protocol import KEEPALIVE_LAYER, STEP_LAYER, SYNC_LAYER
from comm.transport.base import Transport

KEEPALIVE_S = 1.0  # an attention rank that has sent its FFN ranks nothing for this long sends a keepalive
log = logging.getLogger("afd.recovery")


class PipelineRunner(StepRunner):
    lockstep = True

    def __init__(
        self,
        model,
        pool: KVPool,
        spec: DeploymentSpec,
        rank: int,
        transport: Transport,
        store=None,
        incarnation: int = 0,
    ) -> None:
        """`store` (rendezvous.DeploymentStore, fault tolerance in a deployment of roles): where
        lost ranks are recorded and replacements announce themselves. `incarnation` > 0: this rank
        replaces a lost one, and waits for the others to admit it before its first round."""
        super().__init__()
        self.model, self.pool = model, pool
        self.spec, self.rank, self.transport = spec, rank, transport
        topo, config = spec.topology, spec.comm_config()
        self.sender = attention_endpoint(topo, rank, transport, config)
        args = spec.args
        self.server = (
            CommExpertServer(
                ffn_endpoint(topo, rank, transport, config),
                model.config,
                pool.device,
                args.torch_dtype,
                static_received(args, model.config, pool.device),
            )
            if topo.colocated
            else None
        )
        ffn = [] if topo.colocated else [topo.ffn_endpoint(r) for r in range(topo.num_ffn_ranks)]
        stager, cap = None, None
        if topo.colocated and (spec.args.enable_eplb or spec.args.enable_ffn_fault_tolerance):
            load = functools.partial(load_shard, spec.args, model.config, pool.device)
            stager = ExpertStager(load, rank, model.routed_experts())
            if spec.args.enable_ffn_fault_tolerance:  # the most slots this rank may grow to (a lost peer's)
                cap = expert_capacity(spec.args.ffn_expert_memory_mb, model.routed_experts(), pool.device, rank)
        every = spec.args.eplb_rebalance_num_iterations if spec.args.enable_eplb else None
        self.rebalancer = Rebalancer(spec.initial_map(), model.load_recorder, every, transport, ffn, stager)
        # fault tolerance: the FFN ranks in use, their recoveries and replacements
        load_own = self._load_own if topo.colocated else None
        self.recovery = RecoveryCoordinator(
            spec, rank, transport, self.rebalancer, ffn, store, self._use_topology, load_own, cap
        )
        held = model.routed_experts(with_mtp=True)  # (with the MTP draft module's, colocated)
        own = (held, self.server.endpoint.to_local) if self.server is not None else (None, None)
        self.executor = RemoteExpertExecutor(self.sender, self.rebalancer.map, pool.device, model.load_recorder, *own)
        self.executor.skip_empty = not topo.colocated  # AFD: the FFN ranks know each micro-batch's count
        if transport.payload_device == pool.device:  # tensors stay on the device (remote_experts.py)
            self.executor.wire = pool.device
        self.n = spec.args.num_micro_batches
        # static decode (ranks/static_stages.py): persistent batches, captured stages on a GPU
        capture = graphs_on(args, pool.device) and not topo.colocated
        self.static = (
            StaticAttention(args, model, pool, self.executor, spec.layout, self.n, topo.colocated)
            if args.static_decode or capture
            else None
        )
        if self.server is not None:  # colocated: this rank's experts, from graphs where they replay
            graphs = expert_graphs(args, model.config, model.routed_experts(), self.server.static, pool.device)
            self.server.graphs = graphs
            if graphs is not None and graphs.capture:
                log.info("attention rank %d: expert graphs captured in %.1f s", rank, graphs.capture_all())
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
        mtp = getattr(model, "mtp", None)  # speculative decoding: the draft module's passes
        self.draft_ops = strategy.arrange(mtp[0].draft_operations(self.executor, self.server)) if mtp else None
        if capture:
            log.info(
                "attention rank %d: stage graphs captured in %.1f s",
                rank,
                self.static.capture(self.ops, self.rebalancer.map),
            )
        self.strategy = strategy
        self.ft = self.recovery.enabled
        self._last: list[dict] | None = None  # the last step's micro-batches, as they were before it ran
        self.incarnation, self._joining = incarnation, incarnation > 0
        if self.ft:
            self.sender.interrupt = self.recovery.check
            if self.server is not None:
                self.server.endpoint.interrupt = self.recovery.check

    @property
    def peers(self) -> list[int]:
        """The other attention ranks' endpoints (without those lost, with fault tolerance)."""
        return self.recovery.live_peers

    @property
    def ffn(self) -> list[int]:
        """The endpoints of the FFN ranks in use (AFD)."""
        return self.recovery.ffn

    # what the deployment's stats report of fault tolerance (Engine.ffn_fault_counters)

    @property
    def ffn_alive(self) -> int:
        return len(self.recovery.ffn)

    @property
    def recoveries(self) -> int:
        return self.recovery.recoveries

    @property
    def experts_read(self) -> int:
        """By the survivors of every recovery, from the checkpoint."""
        return self.recovery.experts_read

    @property
    def experts_loaded(self) -> tuple[int, int]:
        """(layer, expert) pairs the expert ranks loaded since start for recoveries, admissions and
        rebalances: (copied from a live peer, read from the checkpoint). AFD: the deployment's,
        reported by the first live attention rank only (every attention rank counts them alike);
        colocated: this rank's own."""
        if not self.spec.topology.colocated and any(p < self.sender.endpoint for p in self.peers):
            return 0, 0
        r = self.rebalancer.loaded
        return r["peer"] + self.recovery.experts_copied, r["checkpoint"] + self.recovery.experts_read

    @property
    def last_recovery(self) -> dict | None:
        return self.recovery.last_recovery

    # -- lockstep --------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.want_stop = True

    def begin_step(self, plan: StepPlan) -> bool:
        """True when any attention rank has work this step (every rank calls this every round)."""
        if self._joining:
            self._join()
        self._keepalive()
        mine = plan.num_tokens
        while True:
            round_start = time.monotonic()
            eplb_meta, loads = self.rebalancer.sync_out(self.step_id)
            meta = {"tokens": mine, "stop": self.want_stop, **eplb_meta, **self.recovery.round_meta(self.step_id)}
            msgs, missing = self._exchange(meta, loads)
            metas = [m.meta for m in msgs]
            if missing and self.recovery.unagreed(missing, [meta, *metas]):
                continue  # the loss is agreed on in the next round
            if not self.recovery.anyone_lost([meta, *metas]):
                self.recovery.admit([meta, *metas])
                break
            self._recover([meta, *metas], since=round_start)
            if any(m["failed"] for m in metas):  # a peer's step failed: it runs again, this rank's too
                if self._last is None:
                    raise RecoveryFailed(f"attention rank {self.rank} has no step to run again")
                self._run_resilient(self._last)
        with self.timeline.span("eplb_plan", 0, -1) if eplb_meta["eplb_plan"] else nullcontext():
            self.rebalancer.sync_in(self.step_id, [meta, *metas], loads + [t for m in msgs for t in m.tensors])
        self.stopped = self.want_stop or any(m["stop"] for m in metas)
        tokens = mine + sum(m["tokens"] for m in metas)
        # AFD: an idle deployment steps without tokens for a descriptor with news for the FFN ranks
        news = self.server is None and self.rebalancer.has_news
        self.ran = not self.stopped and (tokens > 0 or news)
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

    def _exchange(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[list[Message], list[int]]:
        """One agreement round: this rank's meta (and tensors) to every peer, theirs back; and,
        with fault tolerance, the peers whose process exited before their message came."""
        key = MsgKey(self.sync_id, SYNC_LAYER, 0)
        peers = self.peers
        for peer in peers:
            self.transport.send(peer, Message("sync", key, self.sender.endpoint, tensors, meta))
        msgs, missing = [], []
        for peer in peers:
            msg = self._receive_round(peer, key)
            if msg is None:
                missing.append(peer)
            else:
                msgs.append(msg)
        self.sync_id += 1
        return msgs, missing

    def _receive_round(self, peer: int, key: MsgKey) -> Message | None:
        """A peer's message of an agreement round; with fault tolerance None once its process has
        exited (it waits in slices, looking)."""
        wait = round_wait(self.spec.args, self.ft)
        if not self.ft:
            return self.transport.recv(peer, "sync", key, wait)
        deadline = time.monotonic() + wait
        while True:
            try:
                left = max(deadline - time.monotonic(), 0.0)
                msg = self.transport.recv(peer, "sync", key, min(INTERRUPT_CHECK_S, left))
            except CommTimeout:
                if self.recovery.peer_exited(peer, None):
                    return None
                if time.monotonic() >= deadline:
                    raise
                continue
            self.recovery.peer_exited(peer, msg.meta)
            return msg

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor:
        with self.timeline.span("step", 0, -1, step.num_tokens):
            return self._cat(self._run_resilient(step.batches))

    def _cat(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outs) if outs else torch.empty(0, device=self.pool.device)

    # -- speculative decoding (runtime/spec_step.py): the MTP module's passes are steps of their own
    # for the expert ranks (descriptors say "draft"), which serve its layer's experts in them

    @torch.inference_mode()
    def execute_spec(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        for m in step.batches:
            m["keep_hidden"] = True
        with self.timeline.span("step", 0, -1, step.num_tokens):
            outs = self._run(step.batches)
        return self._cat([o[0] for o in outs]), self._cat([o[1] for o in outs])

    @torch.inference_mode()
    def draft_extend(self, step, next_ids, hidden, at):
        micro, start = [], 0
        for batch in step.batches:
            end = start + batch["fb"].num_tokens
            mine = at[(at >= start) & (at < end)] - start
            micro.append(self._draft_batch(batch["fb"], next_ids[start:end], hidden[start:end], mine))
            start = end
        return self._draft_pass(micro)

    @torch.inference_mode()
    def draft_chain(self, chunks, tokens, hidden):
        micro = []
        for group in split_micro_batches([1] * len(chunks), self._micro_batches(len(chunks))):
            fb = ForwardBatch.build(
                [], [chunks[i] for i in group], self.pool.page_table, self.pool.page_size, self.pool.device
            )
            rows = torch.arange(len(group), device=self.pool.device)
            micro.append(
                self._draft_batch(fb, tokens[group.start : group.stop], hidden[group.start : group.stop], rows)
            )
        return self._draft_pass(micro)

    def _draft_batch(self, fb, next_ids, hidden, rows) -> dict:
        return {"fb": fb, "kv_cache": self.pool.cache, "next_ids": next_ids, "hidden": hidden, "rows": rows}

    def _draft_pass(self, micro: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        outs = self._run(micro, self.draft_ops, draft=True)
        return self._cat([o[0] for o in outs]), self._cat([o[1] for o in outs])

    @torch.inference_mode()
    def _run_resilient(self, batches: list[dict]) -> list[torch.Tensor]:
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
                meta = self.recovery.failure_meta(exc.ranks, self.step_id)
                msgs, _ = self._exchange(meta, [])  # (a lost peer that sent nothing is named in meta)
                self._recover([meta, *(m.meta for m in msgs)], since=attempt)
                batches = [dict(m) for m in before]

    def admit_peer(self, rank: int, process: dict) -> None:
        """The front end started a replacement of lost attention rank `rank` (its process:
        incarnation, address, host): admitted once every live rank has heard of it."""
        self.recovery.rejoining[self.spec.topology.sender_endpoint(rank)] = process

    def _join(self) -> None:
        """A replacement's way in: every live attention rank admits it in a recovery, and sends
        it the deployment's state (the next round's and step's ids, the placement, who is lost);
        it joins the next round."""

        def joined(state: dict) -> list[int]:  # the first admission: who is lost, and all else
            self.recovery.joined(state)
            return self.peers

        wait, key = join_wait(self.spec.args), join_key(self.incarnation)
        views = from_live_senders(self.transport, self.recovery.peers, JOIN, key, wait, joined)
        state = agreed(views, f"attention rank {self.rank}: the attention ranks disagree on its admission")
        self.sync_id, self.step_id = state["sync_id"], state["step_id"]
        self.executor.expert_map = self.rebalancer.map
        self._joining = False
        log.warning(
            "attention rank %d (replacement %d) joined: from step %d", self.rank, self.incarnation, self.step_id
        )

    def _recover(self, metas: list[dict], since: float) -> None:
        """A recovery (RecoveryCoordinator.recover); the step that runs next takes its id.
        Colocated: until the next agreement round, every live rank sends to every other, tokens or
        none (the step run again may be another one on each rank, with other token counts)."""
        self.step_id = self.recovery.recover(metas, since, self.sync_id)
        self.executor.expert_map = self.rebalancer.map
        if self.server is not None:
            self.executor.expected, self.executor.keep_own = True, False
            self.server.senders = [sorted([self.rank, *self.peers])] * self.n

    def _load_own(self, expert_map) -> tuple[int, int]:
        """Colocated: this rank's slots of a recovery's placement, loaded and served from now on
        (its graphs captured again where its storage grew); the experts (copied, read)."""
        stager = self.rebalancer.stager
        stager.stage(expert_map)
        if stager.switch(expert_map.version, self.spec.args.ffn_recovery_timeout) and self.server.graphs is not None:
            self.server.graphs = expert_graphs(
                self.spec.args, self.model.config, self.model.routed_experts(), self.server.static, self.pool.device
            )
            if self.server.graphs is not None and self.server.graphs.capture:
                self.server.graphs.capture_all()
        return stager.loaded["peer"], stager.loaded["checkpoint"]

    def _use_topology(self, expert_map) -> None:
        """A fresh sender endpoint for this placement's dead ranks (relays move with them) and its
        slots per rank (a recovery may have grown some)."""
        topo = self.spec.topology_of(expert_map)
        sender = attention_endpoint(topo, self.rank, self.transport, self.spec.comm_config())
        sender.stats, sender.interrupt = self.sender.stats, self.recovery.check
        self.sender = self.executor.endpoint = sender
        if self.server is not None:  # colocated: this rank's expert side over the same placement
            self.server.endpoint.close(drain=False)
            self.server.endpoint = ffn_endpoint(topo, self.rank, self.transport, self.spec.comm_config())
            self.server.endpoint.interrupt = self.recovery.check
            self.executor.to_local = self.server.endpoint.to_local

    def _micro_batches(self, num_seqs: int) -> int:
        """This step's micro-batch count: --micro-batches, or fewer where the deployment has one
        attention rank and it has fewer sequences (an empty micro-batch still costs a message per
        layer and peer). With several attention ranks the count stays fixed, as they plan their
        steps apart: also on a survivor whose peers are all lost, since it plans a step before the
        round that may admit a replacement into that very step."""
        if self.spec.topology.num_senders > 1:
            return self.n
        return max(1, min(self.n, num_seqs))

    def _run(self, micro: list[dict], ops: list | None = None, draft: bool = False) -> list:
        """One step of the expert ranks: the model's (or with `draft`, the MTP module's `ops`)."""
        with self.timeline.span("eplb_switch", 0, -1) if self.rebalancer.switching else nullcontext():
            eplb = self.rebalancer.begin_step(self.spec.args.comm_timeout)
        self.recovery.on_step(eplb, self.step_id, self.keepalive_id)
        self.executor.expert_map = self.rebalancer.map
        self._announce([int(m["fb"].num_tokens) for m in micro], extra={**eplb, "draft": True} if draft else eplb)
        self.executor.step = self.step_id
        if self.server is not None:
            self.server.step = self.step_id
        if self.static is None or draft:
            outs = run_micro_batches(ops or self.ops, micro, self.strategy.delays(len(micro)))
        else:
            micro, keep = self.static.begin_step(micro, self.step_id, self.executor.expert_map)
            outs = run_micro_batches(
                self.ops, micro, self.strategy.delays(len(micro)), run_stage=self.static.stages.run
            )
            outs = self.static.finish(outs, keep)
        self.rebalancer.end_step()
        self.timeline.end_step(self.step_id)
        self.step_id += 1
        return outs

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
        self.recovery.close()
        self._announce([], shutdown=True)  # to the live FFN ranks
        self.rebalancer.close()
        if self.server is not None:
            self.server.endpoint.close()
        # flushes what is still queued (the shutdown descriptor above travels on a sender thread
        # with --transport torch) before the process may exit, and tells every peer we are gone
        self.transport.close()
