"""The discrete-event simulation of a deployment: instances stepping in lockstep, and the events
between them (arrivals, step ends, KV transfers under PD disaggregation).

An instance's ranks step together because every MoE layer exchanges tokens between all of them and
the expert GPUs; its step takes the time its `StepTimeModel` gives for the loads of its busy ranks.
"""

from __future__ import annotations

import heapq
from itertools import count

import numpy as np

from afd_engine.errors import ConfigError
from afd_engine.planner.sim.cluster import ClusterConfig, InstanceConfig
from afd_engine.planner.sim.drafting_rank import DraftingRank
from afd_engine.planner.sim.rank import Rank
from afd_engine.planner.sim.request import DONE, INF, SENDING, Request
from afd_engine.planner.sim.router import Domain
from afd_engine.planner.sim.speculative import draft_time
from afd_engine.planner.traces import Trace


class Group:
    """One instance: ranks that step together."""

    def __init__(self, sim: Simulation, cfg: InstanceConfig, role: str, name: str) -> None:
        self.sim, self.cfg, self.role, self.name = sim, cfg, role, name
        self.model = cfg.step_time
        # a fit of this engine's CPU steps: its steps depend on other instances, on the step before,
        # on requests joining from a prefill instance and on those that left since the step before
        self.context = bool(getattr(self.model, "prices_context", False))
        self.prefilled = False  # the instance's last step prefilled (it ended at last_end)
        self.spec = cfg.speculative
        self.ranks: list[Rank] = []
        self.active: dict[int, Rank] = {}
        self.busy = False
        self.steps = 0
        self.prefill_steps = 0  # steps in which some rank prefilled
        self.planned: list[Rank] = []
        self.stepping_s = 0.0
        self.role_busy = [0.0] * len(self.model.roles)
        self.last_end = 0.0

    def activate(self, rank: Rank) -> None:
        if rank.lid not in self.active:
            self.active[rank.lid] = rank
        if not self.busy:
            self.sim.wake[id(self)] = self

    def start(self, t: float) -> None:
        s, loads, planned = self.steps, [], self.planned
        for lid, rank in list(self.active.items()):
            load = rank.schedule(s)
            if load is None:
                if not rank.has_work():
                    del self.active[lid]
                continue
            loads.append(load)
            planned.append(rank)
        if not loads:
            return
        prefills = any(ld[3] > 0 for ld in loads)
        if self.context:  # another instance computing as it starts (instances sharing CPUs), the step before
            joined = any(rank.first_out for rank in planned)  # (PD: requests from a prefill rank)
            after = self.prefilled and t <= self.last_end
            left = sum(rank.left for rank in self.ranks)
            for rank in self.ranks:
                rank.left = 0
            seconds, busy = self.model.step(loads, self.sim.computing > 0, after, joined, left)
        else:
            seconds, busy = self.model.step(loads)
        self.prefilled = prefills
        if self.spec is not None:  # the MTP module's draft passes after the verify
            chain = [ld for ld in (rank.draft_load() for rank in planned) if ld is not None]
            extra, extra_busy = draft_time(self.model, self.spec, loads, chain, (seconds, busy))
            seconds += extra
            busy = tuple(b + x for b, x in zip(busy, extra_busy))
        if not seconds > 0:
            raise ConfigError(f"the step time model gave {seconds!r} s for a step; it must be > 0")
        self.steps += 1
        if prefills:
            self.prefill_steps += 1
        self.busy = True
        self.sim.computing += 1
        self.stepping_s += seconds
        for k, b in enumerate(busy):
            self.role_busy[k] += b
        self.sim.push(t + seconds, self)

    def end(self, t: float) -> None:
        s = self.steps - 1
        for rank in self.planned:
            rank.commit(s, t)
        self.planned.clear()
        self.busy = False
        self.sim.computing -= 1
        self.last_end = t
        if self.active:
            self.sim.wake[id(self)] = self


class Simulation:
    """The event loop: trace arrivals, instances' step ends and (under PD) KV arriving at decode
    ranks, in time order; instances woken by new work start a step once no other event is due at
    the same time."""

    def __init__(self, trace: Trace, cluster: ClusterConfig) -> None:
        cluster.validate()
        self.trace, self.cluster = trace, cluster
        self.block_tokens = trace.block_tokens
        self.max_output = max(r.output_len for r in trace.requests)
        self.kv_link = cluster.kv_link if cluster.decode is not None else None
        self.seq = count()
        self.now = 0.0
        self.heap: list = []
        self.wake: dict[int, Group] = {}
        self.groups: list[Group] = []
        self.computing = 0  # instances in a step now
        self.done = 0
        self.serving = Domain(cluster.router)
        self.decoding = Domain(cluster.router) if cluster.decode is not None else None
        role = "prefill" if cluster.decode is not None else "serve"
        self._build(cluster.serving, self.serving, role)
        if cluster.decode is not None:
            self._build(cluster.decode, self.decoding, "decode")
        B = self.block_tokens
        self.reqs = []
        for i, r in enumerate(trace.requests):
            full = min(len(r.blocks), r.input_len // B)
            self.reqs.append(Request(i, r.arrival_s, r.input_len, r.output_len, tuple(r.blocks[:full])))
        # when each request reaches an instance (through the front end, one at a time); latencies
        # still count from its arrival
        self.delivered = cluster.front_end.deliveries([req.arrival for req in self.reqs])
        spec = (cluster.decode or cluster.serving).speculative
        if spec is not None:  # each request's draws, one per verify it can need
            need = np.array([max(req.output_len - 1, 0) for req in self.reqs], dtype=np.int64)
            draws, ends = spec.draws(int(need.sum())), np.cumsum(need).tolist()
            for req, end, n in zip(self.reqs, ends, need.tolist()):
                req.draws = draws[end - n : end]
        caps = [cluster.serving.kv_pages * cluster.serving.page_tokens]
        if cluster.decode is not None:
            caps.append(cluster.decode.kv_pages * cluster.decode.page_tokens)
        self.max_prompt = min(caps) - 1  # longest prompt a pool can hold with its first token

    def _build(self, cfg: InstanceConfig, domain: Domain[Rank], role: str) -> None:
        for k in range(cfg.replicas):
            g = Group(self, cfg, role, f"{role}{k}")
            kind = Rank if cfg.speculative is None else DraftingRank
            for _ in range(cfg.ranks):
                g.ranks.append(kind(self, g, domain, cfg, role))
            self.groups.append(g)

    def push(self, t: float, group: Group) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), 0, group))

    def finished(self, req: Request, t: float, outcome: str) -> None:
        req.state, req.finish, req.outcome = DONE, t, outcome
        self.done += 1

    # -- PD -----------------------------------------------------------------------------------

    def send(self, req: Request, src: Rank, t: float) -> None:
        """KV computed by a prefill chunk goes out at once (after what the link is still sending)."""
        if req.output_len <= 1 or req.kv <= req.sent:
            return
        dst, link = req.decode_rank, self.kv_link
        start = max(t, src.nic_free, dst.nic_free)
        end = start + link.seconds(req.kv - req.sent)
        src.nic_free = dst.nic_free = end
        req.sent, req.xfer_end = req.kv, end

    def sent_all(self, req: Request, t: float) -> None:
        """The prompt is done on its prefill rank: the first token follows the last KV bytes."""
        req.state = SENDING
        at = max(t, req.xfer_end) + self.kv_link.latency_s
        heapq.heappush(self.heap, (at, next(self.seq), 1, req))

    # -- the event loop -----------------------------------------------------------------------

    def _arrive(self, req: Request, t: float) -> None:
        if req.input_len > self.max_prompt:
            self.finished(req, t, "rejected")
            return
        limit = min(len(req.keys), (req.input_len - 1) // self.block_tokens)
        if self.decoding is None:
            self.serving.route(req, limit).add(req)
            return
        req.decode_rank = self.decoding.route(req, limit)
        req.prefill_rank = self.serving.route(req, limit)
        req.decode_rank.incoming.append(req)
        if len(req.decode_rank.incoming) == 1:
            req.decode_rank.try_reserve(t)

    def run(self) -> None:
        reqs, heap, wake, delivered = self.reqs, self.heap, self.wake, self.delivered
        n, i = len(reqs), 0
        while i < n or heap:
            ta = delivered[i] if i < n else INF
            if ta <= (heap[0][0] if heap else INF):
                self.now = t = ta
                self._arrive(reqs[i], t)
                i += 1
            else:
                t, _, kind, obj = heapq.heappop(heap)
                self.now = t
                if kind == 0:
                    obj.end(t)
                    if obj.role == "decode":
                        for rank in obj.ranks:
                            if rank.incoming:
                                rank.try_reserve(t)
                else:  # the first token reaches the client with the second (Rank.activate)
                    obj.decode_rank.activate(obj, t)
            if wake:
                nxt = min(delivered[i] if i < n else INF, heap[0][0] if heap else INF)
                if nxt > t:
                    for g in list(wake.values()):
                        if not g.busy:
                            g.start(t)
                    wake.clear()
        for req in reqs:
            if req.state != DONE:
                req.outcome = "unfinished"
