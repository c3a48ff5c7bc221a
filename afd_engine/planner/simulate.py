"""Discrete-event simulation of a deployment serving a request trace (`afd plan simulate`).

A deployment is one or more *instances*. An instance is a set of attention ranks (data-parallel
attention, one KV pool each) that step in lockstep, because every MoE layer exchanges tokens between
all of them and the expert GPUs: a colocated DP+EP instance (N GPUs, each an attention rank holding
1/N of the experts) or an AFD instance (A attention GPUs + F expert GPUs, m micro-batches). Under PD
disaggregation, prefill instances compute prompts and send their KV to decode instances.

Each rank schedules as the engine does (runtime/scheduler.py): decodes first, then chunked prefill
continuations, then admissions in fcfs or lpm order, under a token budget per step, a cap on running
requests and a KV pool of pages; when a decode needs a page and none is free or evictable, the newest
running request is preempted and later redone from whatever of it the prefix cache still holds. The
prefix cache is keyed by the trace's block ids; a router sends each request to the rank that holds
the longest cached prefix, unless that rank is much busier than the least loaded one (control/router.py).

An instance's step takes the time a `StepTimeModel` gives for the loads of its ranks: the planner's
roofline (`StageStepTime`, with stage times from `StageModel` or from a `Calibration`, through the
same pipeline formula as `deploy.estimate`), or any other object with a `step` method (the tests use
`LinearStepTime`). Per step the work is proportional to the ranks that have requests, not to the
requests: each rank keeps its decoders' context-length sum, and which of them need a new KV page in
which step, incrementally.
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import count
from typing import Protocol

import numpy as np

from afd_engine.control.router import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD
from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration
from afd_engine.planner.deploy import MEMORY_RESERVE, Deployment, memory_gb, moe_layers_time, pipeline_period
from afd_engine.planner.hardware import Hardware
from afd_engine.planner.model_spec import ModelSpec
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.stages import StageModel
from afd_engine.planner.step_calibration import FittedStepTime, StepCalibration
from afd_engine.planner.traces import Trace

# Same values as runtime/scheduler.py (not imported: that module needs torch).
LPM_MAX_WAIT_ROUNDS = 64
LPM_MAX_QUEUE = 128
POLICIES = ("lpm", "fcfs")
ROUTERS = ("cache_aware", "shortest_queue", "round_robin")  # the engine's --load-balance-method
INF = math.inf

# A load is what one rank puts into one step:
#   (tokens, sequences, KV positions its decodes attend to, query-key pairs of its prefill chunks)
Load = tuple[int, int, float, float]


# -- step-time models ------------------------------------------------------------------------------


class StepTimeModel(Protocol):
    """The time of one lockstep step of an instance, from the loads of its ranks that have work.

    `roles` names the GPU roles whose busy time `step` reports (e.g. ("attention", "ffn")); `step`
    returns (seconds, busy seconds per GPU of each role, in `roles` order)."""

    roles: tuple[str, ...]

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]: ...


@dataclass(frozen=True)
class LinearStepTime:
    """A step of `fixed_s + per_token_s * tokens` on the busiest rank (tests and what-ifs)."""

    fixed_s: float
    per_token_s: float
    roles: tuple[str, ...] = ("gpu",)

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]:
        seconds = self.fixed_s + self.per_token_s * max(ld[0] for ld in loads)
        return seconds, (seconds,) * len(self.roles)


class StageStepTime:
    """One instance's step from the planner's stage model, with the batch, context and tokens of
    each rank as they are in this step (`deploy.estimate` does the same for a uniform batch).

    Per MoE layer and micro-batch the attention stage of rank i takes its share (1/m) of the rank's
    tokens through the projections, gate and shared expert (`StageModel.attention_us` without its
    core), plus the attention core: decode positions at the roofline's per-position cost, prefill
    query-key pairs at the compute roofline. The slowest rank sets the stage (lockstep). The expert
    stage takes all ranks' tokens (`StageModel.experts_us`, times the expert imbalance); dispatch and
    combine come from `network.comm_time` for the busiest rank's tokens. `deploy.pipeline_period`
    and `moe_layers_time` turn these into the MoE layers' time; dense layers, the lm_head over the
    sampled sequences and the fixed per-step overhead are added, as in `estimate`.

    With a calibration the measured attention line replaces projections and core alike (it has no
    context term), and the measured expert line the grouped GEMM."""

    def __init__(
        self,
        sm: StageModel,
        mode: str,
        attn_ranks: int,
        ffn_gpus: int,
        micro_batches: int = 1,
        dispatch: str = "two-stage",
        shared_expert: str = "attention",
        max_tokens: int = 2048,
    ) -> None:
        if mode not in ("afd", "colocated"):
            raise ConfigError(f"instance mode {mode!r} must be 'afd' or 'colocated'")
        Deployment(
            mode, attn_ranks, ffn_gpus if mode == "afd" else 0, micro_batches, 0, dispatch, shared_expert
        ).validate()
        self.sm, self.mode, self.afd = sm, mode, mode == "afd"
        self.attn_ranks, self.m = attn_ranks, micro_batches
        self.ep = ffn_gpus if self.afd else attn_ranks
        self.dispatch = dispatch if self.afd else "direct"
        self.shared_on_f = self.afd and shared_expert == "ffn"
        self.roles = ("attention", "ffn") if self.afd else ("gpu",)
        model, hw = sm.model, sm.attn_hw
        self.moe_layers, self.dense_layers = model.moe_layers, model.dense_layers
        self.overhead_us = hw.efficiency.step_overhead_us
        m = micro_batches
        calibrated = sm.calibration is not None
        # attention core: linear in positions (decode) and in query-key pairs (prefill)
        self.pos_us = 0.0 if calibrated else sm.attention_core_us(1.0) / sm.context
        a = model.attention
        pair_flops = 2 * a.heads * (a.qk_nope_dim + a.qk_rope_dim + a.head_dim) if a.kind == "mla" else None
        pair_flops = pair_flops or a.core_flops_per_position  # MLA prefill runs un-absorbed
        peak = hw.tflops(sm.attn_dtype) * hw.efficiency.attn_compute * 1e6
        self.pair_us = 0.0 if calibrated else pair_flops / peak
        # everything else on the attention GPU, per micro-batch, indexed by the rank's tokens
        n = max_tokens + 1
        core = [0.0 if calibrated else sm.attention_core_us(t / m) for t in range(n)]
        self.attn_rest = [sm.attention_us(t / m, shared_expert=not self.shared_on_f) - core[t] for t in range(n)]
        self.dense_rest = [sm.dense_layer_us(t / m) - core[t] for t in range(n)] if self.dense_layers else None
        self._ffn = lru_cache(maxsize=None)(self._ffn_us)
        self._comm = lru_cache(maxsize=None)(self._comm_us)
        self._head = lru_cache(maxsize=None)(sm.head_us)

    def _ffn_us(self, total_tokens: int) -> float:
        hw = self.sm.ffn_hw if self.afd else self.sm.attn_hw
        return self.sm.experts_us(total_tokens / self.m, self.ep, hw=hw, shared_expert=self.shared_on_f)

    def _comm_us(self, tokens: int) -> tuple[float, float, float, float]:
        sm = self.sm
        case = CommCase(
            tokens=tokens,
            hidden=sm.model.hidden,
            topk=sm.model.topk,
            experts=sm.model.experts,
            senders=self.attn_ranks,
            receivers=self.ep,
            mode=self.dispatch,
            symmetric=not self.afd,
            imbalance=sm.expert_imbalance,
        )
        c = comm_time(case, sm.attn_hw, sm.ffn_hw if self.afd else None)
        return c.dispatch_us, c.combine_us, c.dispatch_busy_us, c.combine_busy_us

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]:
        m, attn_rest, dense_rest = self.m, self.attn_rest, self.dense_rest
        pos_us, pair_us = self.pos_us, self.pair_us
        t_a = t_dense = 0.0
        t_max = total = seqs_max = 0
        a_sum = 0.0
        for tokens, seqs, positions, pairs in loads:
            core = (pos_us * positions + pair_us * pairs) / m
            a = attn_rest[tokens] + core
            a_sum += a
            if a > t_a:
                t_a = a
            if dense_rest is not None:
                d = dense_rest[tokens] + core
                if d > t_dense:
                    t_dense = d
            total += tokens
            if tokens > t_max:
                t_max = tokens
            if seqs > seqs_max:
                seqs_max = seqs
        t_f = self._ffn(total)
        d, c, d_busy, c_busy = self._comm(round(t_max / m))
        round_trip = t_a + d + t_f + c
        period, _ = pipeline_period(m, t_a, t_f, d_busy, c_busy, round_trip, self.afd)
        a_work = t_a if self.afd else t_a + t_f
        moe = moe_layers_time(self.moe_layers, m, period, a_work, round_trip)
        head = self._head(seqs_max)
        dense = self.dense_layers * m * t_dense
        step_us = self.overhead_us + head + dense + moe
        # busy time per GPU of each role: the attention work averaged over all attention ranks
        # (idle ones included), the expert stage on the busiest expert GPU
        attn_busy = self.moe_layers * m * a_sum / self.attn_ranks + dense + head
        ffn_busy = self.moe_layers * m * t_f
        if self.afd:
            return step_us * 1e-6, (attn_busy * 1e-6, ffn_busy * 1e-6)
        return step_us * 1e-6, ((attn_busy + ffn_busy) * 1e-6,)


# -- deployments -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLink:
    """The KV transfer from a prefill rank to a decode rank: bytes per token of KV, the goodput of
    the link (the slower of the two GPUs' NIC shares) and a fixed latency per transfer."""

    bytes_per_token: float
    bandwidth_bps: float  # bytes per second
    latency_s: float

    @classmethod
    def between(cls, src: Hardware, dst: Hardware, kv_bytes_per_token: float) -> KVLink:
        """network.py's model of one link: line rate x goodput factor, plus the fixed latency."""
        bw = min(src.nic_gbs_per_gpu * src.efficiency.nic, dst.nic_gbs_per_gpu * dst.efficiency.nic) * 1e9
        return cls(kv_bytes_per_token, bw, src.efficiency.comm_latency_us * 1e-6)

    def seconds(self, tokens: int) -> float:
        """Time the link is occupied by `tokens` tokens of KV (the latency comes on top, once)."""
        return tokens * self.bytes_per_token / self.bandwidth_bps


@dataclass(frozen=True)
class InstanceConfig:
    """`replicas` identical instances of `ranks` lockstep attention ranks each."""

    ranks: int
    step_time: StepTimeModel
    kv_pages: int  # per rank
    gpus: int = 0  # per instance, attention and expert GPUs (0: `ranks`)
    replicas: int = 1
    page_tokens: int = 16
    max_batch_tokens: int = 2048
    max_running: int = 256
    policy: str = "lpm"
    prefix_cache: bool = True

    def validate(self, where: str) -> None:
        if self.ranks < 1 or self.replicas < 1:
            raise ConfigError(f"{where}: ranks and replicas must be >= 1")
        if self.kv_pages < 1 or self.page_tokens < 1:
            raise ConfigError(f"{where}: KV pages and page size must be >= 1 (got {self.kv_pages}, {self.page_tokens})")
        if self.max_batch_tokens < 1 or not 1 <= self.max_running <= self.max_batch_tokens:
            raise ConfigError(
                f"{where}: need 1 <= max running requests ({self.max_running}) <= max batched tokens "
                f"({self.max_batch_tokens}), so that every running request decodes in every step"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"{where}: schedule policy {self.policy!r} must be one of {', '.join(POLICIES)}")

    @property
    def total_gpus(self) -> int:
        return (self.gpus or self.ranks) * self.replicas


@dataclass(frozen=True)
class ClusterConfig:
    """What is simulated: `serving` instances alone, or, with `decode` and `kv_link`, prefill
    instances (`serving`) and decode instances under PD disaggregation."""

    name: str
    serving: InstanceConfig
    decode: InstanceConfig | None = None
    kv_link: KVLink | None = None
    router: str = "cache_aware"

    def validate(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"{self.name}: router {self.router!r} must be one of {', '.join(ROUTERS)}")
        self.serving.validate(f"{self.name}: prefill" if self.decode else self.name)
        if self.decode is not None:
            self.decode.validate(f"{self.name}: decode")
            if self.kv_link is None:
                raise ConfigError(f"{self.name}: PD disaggregation needs a KV link")

    @property
    def gpus(self) -> int:
        return self.serving.total_gpus + (self.decode.total_gpus if self.decode else 0)


# -- the simulation --------------------------------------------------------------------------------

WAITING, PREFILL, JOINING, DECODE, RESERVED, SENDING, DONE = range(7)


class _Req:
    __slots__ = (
        "i",
        "arrival",
        "input_len",
        "output_len",
        "keys",
        "state",
        "target",
        "kv",
        "held",
        "priv",
        "gen",
        "order",
        "s0",
        "t0",
        "g0",
        "u0",
        "phase",
        "epoch",
        "first",
        "finish",
        "preempts",
        "queued",
        "rank",
        "prefill_rank",
        "decode_rank",
        "sent",
        "xfer_end",
        "admitted",
        "outcome",
        "d_held",
        "d_priv",
    )

    def __init__(self, i: int, arrival: float, input_len: int, output_len: int, keys: tuple) -> None:
        self.i, self.arrival, self.input_len, self.output_len, self.keys = i, arrival, input_len, output_len, keys
        self.state = WAITING
        self.target = input_len  # tokens to prefill: the prompt, plus the output so far after a preemption
        self.kv = self.held = self.priv = self.gen = self.order = 0
        self.s0 = self.t0 = self.g0 = self.u0 = self.phase = self.epoch = 0
        self.first = self.finish = INF
        self.preempts = self.queued = 0
        self.rank = self.prefill_rank = self.decode_rank = None
        self.sent, self.xfer_end, self.admitted, self.outcome = 0, 0.0, False, "ok"
        self.d_held = self.d_priv = 0  # PD: blocks and private tokens reserved on the decode rank

    def key(self, n: int):
        """Block n's cache key: the trace's id for a full prompt block, else one of its own."""
        return self.keys[n] if n < len(self.keys) else (self.i, n)


class _Block:
    __slots__ = ("ref", "children", "stamp", "parent")

    def __init__(self, stamp: int, parent) -> None:
        self.ref, self.children, self.stamp, self.parent = 1, 0, stamp, parent


class _Domain:
    """Ranks a router chooses among (one per role): their loads and which hold which block."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.ranks: list[_Rank] = []
        self.load: list[int] = []  # routed, unfinished requests per rank
        self.index: dict[object, set[int]] = {}  # trace block id -> ranks whose cache holds it
        self.turn = 0

    def route(self, req: _Req, limit: int) -> _Rank:
        """cache_aware: the rank with the longest cached prefix of req (least loaded among equals),
        unless it is much busier than the least loaded rank (control/router.py's thresholds);
        shortest_queue: the least loaded rank; round_robin: ranks in turn. Ties: lowest index."""
        load = self.load
        if self.method == "round_robin":
            best, self.turn = self.turn, (self.turn + 1) % len(load)
            load[best] += 1
            return self.ranks[best]
        idle = min(range(len(load)), key=load.__getitem__)
        if self.method == "shortest_queue":
            load[idle] += 1
            return self.ranks[idle]
        alive = None
        index, keys = self.index, req.keys
        for n in range(limit):
            holders = index.get(keys[n])
            if not holders:
                break
            nxt = holders if alive is None else alive & holders
            if not nxt:
                break
            alive = nxt
        best = idle if alive is None else min(alive, key=lambda r: (load[r], r))
        if load[best] - load[idle] > BALANCE_ABS_THRESHOLD and load[best] > load[idle] * BALANCE_REL_THRESHOLD:
            best = idle
        load[best] += 1
        return self.ranks[best]


class _Rank:
    """One attention rank: its scheduler, KV pool and prefix cache."""

    def __init__(self, sim: _Simulation, group: _Group, domain: _Domain, cfg: InstanceConfig, role: str) -> None:
        self.sim, self.group, self.domain, self.role = sim, group, domain, role
        self.lid = len(domain.ranks)
        domain.ranks.append(self)
        domain.load.append(0)
        self.P, self.B = cfg.page_tokens, sim.block_tokens
        self.bp = -(-self.B // self.P)  # pages of one cached block
        self.capacity, self.used, self.evictable = cfg.kv_pages, 0, 0
        self.max_tokens, self.max_running, self.policy = cfg.max_batch_tokens, cfg.max_running, cfg.policy
        self.caching = cfg.prefix_cache
        self.cache: dict[object, _Block] = {}
        self.heap: list = []  # (stamp, seq, key): eviction candidates, checked when popped
        self.waiting: deque[_Req] = deque()
        self.running: dict[int, _Req] = {}  # admission order: the last is preempted first
        self.prefilling: dict[int, _Req] = {}
        self.joining: list[_Req] = []  # start decoding at the next step
        self.n_dec, self.ctx = 0, 0  # decoders and the sum of their KV lengths
        self.buckets: list[set[_Req]] = [set() for _ in range(self.P)]  # decoders needing a page at step % P
        self.finish_at: dict[int, list[tuple[_Req, int]]] = {}
        self.chunks: list[tuple[_Req, int]] = []
        self.incoming: deque[_Req] = deque()  # PD decode side: waiting to reserve pages
        self.reserved = 0
        self.nic_free = 0.0
        self.preemptions = self.prompt_tokens = self.hit_tokens = self.evicted = 0

    # -- KV pages and the prefix cache --------------------------------------------------------

    def _grow(self, pages: int) -> bool:
        """Takes `pages` pages, evicting unused cached blocks when short; False if they don't fit."""
        short = pages - (self.capacity - self.used)
        if short > 0:
            self._evict(short)
            if pages > self.capacity - self.used:
                return False
        self.used += pages
        return True

    def _evict(self, pages: int) -> None:
        """Frees up to `pages` pages of unlocked cached blocks, least recently used leaves first."""
        freed, heap, cache, bp = 0, self.heap, self.cache, self.bp
        while freed < pages and heap:
            stamp, _, key = heapq.heappop(heap)
            b = cache.get(key)
            if b is None or b.ref or b.children or b.stamp != stamp:
                continue  # stale entry
            del cache[key]
            holders = self.domain.index.get(key)
            if holders is not None:
                holders.discard(self.lid)
                if not holders:
                    del self.domain.index[key]
            freed += bp
            if b.parent is not None:
                p = cache[b.parent]
                p.children -= 1
                if not p.children and not p.ref:
                    heapq.heappush(heap, (p.stamp, next(self.sim.seq), b.parent))
        self.used -= freed
        self.evictable -= freed
        self.evicted += freed

    def _match(self, req: _Req, limit: int) -> int:
        """Blocks of req's longest cached prefix, at most `limit`."""
        cache, n = self.cache, 0
        while n < limit and req.key(n) in cache:
            n += 1
        return n

    def _lock(self, req: _Req, limit: int) -> int:
        """Locks req's longest cached prefix (at most `limit` blocks) and returns its length."""
        if not self.caching:
            return 0
        cache, n, stamp = self.cache, 0, next(self.sim.seq)
        while n < limit:
            b = cache.get(req.key(n))
            if b is None:
                break
            if not b.ref:
                self.evictable -= self.bp
            b.ref += 1
            b.stamp = stamp
            n += 1
        return n

    def _unlock(self, req: _Req, blocks: int) -> None:
        cache, bp = self.cache, self.bp
        for n in range(blocks):
            key = req.key(n)
            b = cache[key]
            b.ref -= 1
            if not b.ref:
                self.evictable += bp
                if not b.children:
                    heapq.heappush(self.heap, (b.stamp, next(self.sim.seq), key))

    def _insert(self, req: _Req, upto: int) -> None:
        """Moves req's computed full blocks up to block `upto` into the cache, locked by req (a
        block the cache holds already is shared and req's copy freed)."""
        if not self.caching or upto <= req.held:
            return
        cache, bp, stamp, B, P = self.cache, self.bp, next(self.sim.seq), self.B, self.P
        index, n_trace = self.domain.index, len(req.keys)
        parent = req.key(req.held - 1) if req.held else None
        for n in range(req.held, upto):
            key = req.key(n)
            b = cache.get(key)
            if b is not None:
                if not b.ref:
                    self.evictable -= bp
                b.ref += 1
                b.stamp = stamp
            else:
                cache[key] = _Block(stamp, parent)
                self.used += bp
                if parent is not None:
                    cache[parent].children += 1
                if n < n_trace:
                    holders = index.get(key)
                    if holders is None:
                        index[key] = {self.lid}
                    else:
                        holders.add(self.lid)
            parent = key
        old = -(-req.priv // P)
        req.priv -= (upto - req.held) * B
        self.used += -(-req.priv // P) - old
        req.held = upto

    def _release(self, req: _Req, kv: int) -> None:
        """req leaves this rank with `kv` tokens computed: its full blocks stay cached, unlocked;
        its other pages are freed."""
        self._insert(req, kv // self.B)
        self._unlock(req, req.held)
        self.used -= -(-req.priv // self.P)
        req.held = req.priv = 0

    # -- requests arriving and leaving --------------------------------------------------------

    def add(self, req: _Req) -> None:
        req.rank, req.state, req.queued = self, WAITING, self.group.steps
        self.waiting.append(req)
        self.group.activate(self)

    def _leave_decode(self, req: _Req, kv: int) -> None:
        self.n_dec -= 1
        self.ctx -= kv
        self.buckets[req.phase].discard(req)
        req.epoch += 1

    def _finish(self, req: _Req, t: float, kv: int, outcome: str = "ok") -> None:
        self.running.pop(req.i, None)
        self.prefilling.pop(req.i, None)
        self._release(req, kv)
        self.domain.load[self.lid] -= 1
        self.sim.finished(req, t, outcome)

    def _preempt(self, req: _Req, s: int) -> None:
        """Back to the queue's head; the work is redone, less what the prefix cache keeps."""
        if req.state == DECODE:
            d = s - req.s0
            kv, req.gen, req.priv = req.t0 + d, req.g0 + d, req.u0 + d
            self._leave_decode(req, kv)
        else:
            kv = req.kv
            self.prefilling.pop(req.i, None)
        del self.running[req.i]
        self._release(req, kv)
        req.target, req.kv, req.state, req.queued = req.input_len + req.gen, 0, WAITING, s
        req.preempts += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _start_decode(self, req: _Req, s: int) -> None:
        req.state, req.s0, req.t0, req.g0, req.u0 = DECODE, s, req.kv, req.gen, req.priv
        req.phase = (s - req.priv) % self.P  # steps at which its private tokens fill a page
        self.buckets[req.phase].add(req)
        self.n_dec += 1
        self.ctx += req.kv
        end = s + req.output_len - req.gen - 1
        self.finish_at.setdefault(end, []).append((req, req.epoch))

    # -- PD: the decode side ------------------------------------------------------------------

    def try_reserve(self, t: float) -> None:
        """Reserves pages for queued incoming requests in arrival order while they fit; each one
        reserved is sent to its prefill rank."""
        while self.incoming:
            req = self.incoming[0]
            if len(self.running) + self.reserved >= self.max_running:
                return
            m = self._lock(req, (req.input_len - 1) // self.B)
            need = -(-(req.input_len + 1 - m * self.B) // self.P)
            if need > self.capacity - self.used + self.evictable - len(self.running):
                self._unlock(req, m)
                if not self.running and not self.reserved:  # cannot ever fit here
                    self.incoming.popleft()
                    self.domain.load[self.lid] -= 1
                    req.prefill_rank.domain.load[req.prefill_rank.lid] -= 1
                    self.sim.finished(req, t, "rejected")
                    continue
                return
            self.incoming.popleft()
            req.d_held, req.d_priv, req.sent = m, req.input_len - m * self.B, m * self.B
            self._grow(-(-req.d_priv // self.P))
            self.reserved += 1
            req.state = RESERVED
            req.prefill_rank.add(req)

    def cancel(self, req: _Req) -> None:
        """A reserved request will not come (its prefill rank dropped it): its pages go back."""
        self.reserved -= 1
        req.held, req.priv = req.d_held, req.d_priv
        self._unlock(req, req.held)
        self.used -= -(-req.priv // self.P)
        req.held = req.priv = 0
        self.domain.load[self.lid] -= 1

    def activate(self, req: _Req, t: float) -> None:
        """req's KV and first token arrived: it decodes from the next step."""
        self.reserved -= 1
        req.kv, req.gen, req.held, req.priv = req.input_len, 1, req.d_held, req.d_priv
        if req.output_len <= 1:
            self._release(req, req.kv)
            self.domain.load[self.lid] -= 1
            self.sim.finished(req, t, "ok")
            return
        self._insert(req, req.input_len // self.B)
        req.order = next(self.sim.seq)
        req.rank, req.state = self, JOINING
        self.running[req.i] = req
        self.joining.append(req)
        self.group.activate(self)

    # -- one step -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.joining)

    def schedule(self, s: int) -> Load | None:
        """Plans step s as the engine's scheduler does; returns this rank's load, None if idle."""
        if self.joining:
            for req in self.joining:
                self._start_decode(req, s)
            self.joining.clear()
        bucket = self.buckets[s % self.P]
        if bucket and not self._grow(len(bucket)):
            self._decode_pages_short(bucket, s)
        n_dec = self.n_dec
        self.ctx += n_dec
        budget = self.max_tokens - n_dec
        tokens = seqs = n_dec
        pairs = 0.0
        if self.prefilling and budget > 0:
            for req in list(self.prefilling.values()):
                own = -(-req.priv // self.P) * self.P - req.priv
                room = own + (self.capacity - self.used + self.evictable) * self.P
                n = min(req.target - req.kv, budget, room)
                if n > 0 and self._grow(-(-(req.priv + n) // self.P) - -(-req.priv // self.P)):
                    req.priv += n
                    self.chunks.append((req, n))
                    budget -= n
                    tokens += n
                    seqs += 1
                    pairs += n * req.kv + n * (n + 1) / 2
                    if budget == 0:
                        break
        if self.waiting and budget > 0 and len(self.running) + self.reserved < self.max_running:
            budget, tokens, seqs, pairs = self._admit(s, budget, tokens, seqs, pairs)
        if not tokens:
            return None
        return tokens, seqs, self.ctx, pairs

    def _decode_pages_short(self, bucket: set[_Req], s: int) -> None:
        """Pages ran out: decodes in running order take theirs, preempting the newest running
        request until one fits or the decode itself was preempted (as the engine does)."""
        for req in sorted(bucket, key=lambda r: r.order):
            if req.state != DECODE:
                continue  # preempted for an older request in this loop
            while not self._grow(1):
                victim = next(reversed(self.running.values()))
                if victim is req and len(self.running) == 1:  # the pool cannot hold this one sequence
                    d = s - req.s0
                    req.gen, req.priv = req.g0 + d, req.u0 + d
                    self._leave_decode(req, req.t0 + d)
                    self._finish(req, self.sim.now, req.t0 + d, "truncated")
                    break
                self._preempt(victim, s)
                if victim is req:
                    break

    def _admission_order(self, s: int) -> Iterator[_Req]:
        """Waiting requests in the order admission tries them: fcfs takes the queue's head (each
        one tried leaves it or ends the round, so a long queue costs nothing); lpm, for queues of
        2 to LPM_MAX_QUEUE, the longest cached prefix first unless a request waited long or was
        preempted (runtime/scheduler.py)."""
        if self.policy == "fcfs" or not self.caching or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            while self.waiting:
                yield self.waiting[0]
            return
        patient = s - LPM_MAX_WAIT_ROUNDS
        B = self.B
        yield from sorted(
            self.waiting,
            key=lambda r: (r.preempts == 0 and r.queued > patient, -self._match(r, (r.target - 1) // B)),
        )

    def _admit(self, s: int, budget: int, tokens: int, seqs: int, pairs: float) -> tuple[int, int, int, float]:
        P, B = self.P, self.B
        for req in self._admission_order(s):
            if budget <= 0 or len(self.running) + self.reserved >= self.max_running:
                break
            m = self._lock(req, (req.target - 1) // B)
            need = -(-(req.target + 1 - m * B) // P)
            if need > self.capacity - self.used + self.evictable - len(self.running):
                self._unlock(req, m)
                if not self.running:  # grew past the whole pool (after preemption): cannot resume
                    self.waiting.remove(req)
                    self.domain.load[self.lid] -= 1
                    if self.role == "prefill":
                        req.decode_rank.cancel(req)
                    self.sim.finished(req, self.sim.now, "truncated")
                    continue
                break
            self.waiting.remove(req)
            req.held, req.kv, req.priv = m, m * B, 0
            if not req.admitted:
                req.admitted = True
                self.prompt_tokens += req.input_len
                self.hit_tokens += req.kv
            req.order = next(self.sim.seq)
            req.state = PREFILL
            self.running[req.i] = req
            self.prefilling[req.i] = req
            n = min(req.target - req.kv, budget)
            self._grow(-(-n // P))  # (fits: checked above)
            req.priv = n
            self.chunks.append((req, n))
            budget -= n
            tokens += n
            seqs += 1
            pairs += n * req.kv + n * (n + 1) / 2
        return budget, tokens, seqs, pairs

    def commit(self, s: int, t: float) -> None:
        """Step s ended at t: decodes got their tokens, chunks their KV; some requests are done."""
        done = self.finish_at.pop(s, None)
        if done:
            for req, epoch in done:
                if req.epoch == epoch and req.state == DECODE:
                    kv = req.t0 + s + 1 - req.s0
                    req.gen, req.priv = req.output_len, req.u0 + s + 1 - req.s0
                    self._leave_decode(req, kv)
                    self._finish(req, t, kv)
        if not self.chunks:
            return
        sim, B = self.sim, self.B
        for req, n in self.chunks:
            req.kv += n
            self._insert(req, req.kv // B)
            if sim.kv_link is not None and self.role == "prefill":
                sim.send(req, self, t)
            if req.kv < req.target:
                continue
            req.gen += 1  # the prompt is done: its next token is sampled
            if self.role == "prefill":
                self.running.pop(req.i)
                self.prefilling.pop(req.i)
                self._release(req, req.kv)
                self.domain.load[self.lid] -= 1
                sim.sent_all(req, t)
                continue
            if req.first == INF:
                req.first = t
            if req.gen >= req.output_len:
                self._finish(req, t, req.kv)
                continue
            del self.prefilling[req.i]
            req.state = JOINING
            self.joining.append(req)
        self.chunks.clear()


class _Group:
    """One instance: ranks that step together."""

    def __init__(self, sim: _Simulation, cfg: InstanceConfig, role: str, name: str) -> None:
        self.sim, self.cfg, self.role, self.name = sim, cfg, role, name
        self.model = cfg.step_time
        self.ranks: list[_Rank] = []
        self.active: dict[int, _Rank] = {}
        self.busy = False
        self.steps = 0
        self.planned: list[_Rank] = []
        self.stepping_s = 0.0
        self.role_busy = [0.0] * len(self.model.roles)
        self.last_end = 0.0

    def activate(self, rank: _Rank) -> None:
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
        seconds, busy = self.model.step(loads)
        if not seconds > 0:
            raise ConfigError(f"the step time model gave {seconds!r} s for a step; it must be > 0")
        self.steps += 1
        self.busy = True
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
        self.last_end = t
        if self.active:
            self.sim.wake[id(self)] = self


class _Simulation:
    def __init__(self, trace: Trace, cluster: ClusterConfig) -> None:
        cluster.validate()
        self.trace, self.cluster = trace, cluster
        self.block_tokens = trace.block_tokens
        self.kv_link = cluster.kv_link if cluster.decode is not None else None
        self.seq = count()
        self.now = 0.0
        self.heap: list = []
        self.wake: dict[int, _Group] = {}
        self.groups: list[_Group] = []
        self.done = 0
        self.serving = _Domain(cluster.router)
        self.decoding = _Domain(cluster.router) if cluster.decode is not None else None
        role = "prefill" if cluster.decode is not None else "serve"
        self._build(cluster.serving, self.serving, role)
        if cluster.decode is not None:
            self._build(cluster.decode, self.decoding, "decode")
        B = self.block_tokens
        self.reqs = []
        for i, r in enumerate(trace.requests):
            full = min(len(r.blocks), r.input_len // B)
            self.reqs.append(_Req(i, r.arrival_s, r.input_len, r.output_len, tuple(r.blocks[:full])))
        caps = [cluster.serving.kv_pages * cluster.serving.page_tokens]
        if cluster.decode is not None:
            caps.append(cluster.decode.kv_pages * cluster.decode.page_tokens)
        self.max_prompt = min(caps) - 1  # longest prompt a pool can hold with its first token

    def _build(self, cfg: InstanceConfig, domain: _Domain, role: str) -> None:
        for k in range(cfg.replicas):
            g = _Group(self, cfg, role, f"{role}{k}")
            for _ in range(cfg.ranks):
                g.ranks.append(_Rank(self, g, domain, cfg, role))
            self.groups.append(g)

    def push(self, t: float, group: _Group) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), 0, group))

    def finished(self, req: _Req, t: float, outcome: str) -> None:
        req.state, req.finish, req.outcome = DONE, t, outcome
        self.done += 1

    # -- PD -----------------------------------------------------------------------------------

    def send(self, req: _Req, src: _Rank, t: float) -> None:
        """KV computed by a prefill chunk goes out at once (after what the link is still sending)."""
        if req.output_len <= 1 or req.kv <= req.sent:
            return
        dst, link = req.decode_rank, self.kv_link
        start = max(t, src.nic_free, dst.nic_free)
        end = start + link.seconds(req.kv - req.sent)
        src.nic_free = dst.nic_free = end
        req.sent, req.xfer_end = req.kv, end

    def sent_all(self, req: _Req, t: float) -> None:
        """The prompt is done on its prefill rank: the first token follows the last KV bytes."""
        req.state = SENDING
        at = max(t, req.xfer_end) + self.kv_link.latency_s
        heapq.heappush(self.heap, (at, next(self.seq), 1, req))

    # -- the event loop -----------------------------------------------------------------------

    def _arrive(self, req: _Req, t: float) -> None:
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
        reqs, heap, wake = self.reqs, self.heap, self.wake
        n, i = len(reqs), 0
        while i < n or heap:
            ta = reqs[i].arrival if i < n else INF
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
                else:
                    obj.first = t
                    obj.decode_rank.activate(obj, t)
            if wake:
                nxt = min(reqs[i].arrival if i < n else INF, heap[0][0] if heap else INF)
                if nxt > t:
                    for g in list(wake.values()):
                        if not g.busy:
                            g.start(t)
                    wake.clear()
        for req in reqs:
            if req.state != DONE:
                req.outcome = "unfinished"


# -- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


def _pcts(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class SimResult:
    """Per-request times (seconds; inf where a request never got there) and the summary."""

    name: str
    gpus: int
    arrival: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray  # nan for single-token answers
    e2e: np.ndarray
    outcome: list[str]
    preemptions: np.ndarray
    summary: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "gpus": self.gpus, **self.summary}


def simulate(trace: Trace, cluster: ClusterConfig, slo: SLO) -> SimResult:
    """Runs `cluster` on `trace` and measures every request against `slo`."""
    if not trace.requests:
        raise ConfigError("the trace has no requests")
    wall = time.perf_counter()
    sim = _Simulation(trace, cluster)
    sim.run()
    wall = time.perf_counter() - wall
    reqs = sim.reqs
    arrival = np.array([r.arrival for r in reqs])
    first = np.array([r.first for r in reqs])
    finish = np.array([r.finish if r.outcome == "ok" else INF for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    ok = np.array([r.outcome == "ok" for r in reqs])
    ttft = np.where(ok, first - arrival, INF)
    e2e = np.where(ok, finish - arrival, INF)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outs > 1, (finish - first) / np.maximum(outs - 1, 1), np.nan)
    tpot = np.where(ok, tpot, np.where(outs > 1, INF, np.nan))
    meet_ttft = ttft <= slo.ttft_s
    meet_tpot = np.where(np.isnan(tpot), True, tpot <= slo.tpot_s)
    good = meet_ttft & meet_tpot
    end = max([g.last_end for g in sim.groups] + [float(np.max(np.where(ok, finish, -INF), initial=0.0))])
    span = max(end, float(arrival.max())) - float(arrival.min())  # first arrival to last step
    # goodput is over the window requests arrived in (the offered load's): rate x attainment
    window = float(arrival.max() - arrival.min()) or span
    n = len(reqs)
    gpus = cluster.gpus
    util: dict[str, float] = {}
    for cfg, role in ((cluster.serving, "prefill" if cluster.decode else ""), (cluster.decode, "decode")):
        if cfg is None:
            continue
        groups = [g for g in sim.groups if g.cfg is cfg]
        prefix = f"{role}." if role else ""
        util[f"{prefix}stepping"] = sum(g.stepping_s for g in groups) / len(groups) / span if span > 0 else 0.0
        for k, name in enumerate(cfg.step_time.roles):
            busy = sum(g.role_busy[k] for g in groups) / len(groups)
            util[f"{prefix}{name}"] = busy / span if span > 0 else 0.0
    ranks = [r for g in sim.groups for r in g.ranks]
    prompt = sum(r.prompt_tokens for r in ranks)
    finite = np.isfinite
    summary = {
        "requests": n,
        "completed": int(ok.sum()),
        "rejected": sum(r.outcome == "rejected" for r in reqs),
        "truncated": sum(r.outcome == "truncated" for r in reqs),
        "unfinished": sum(r.outcome == "unfinished" for r in reqs),
        "request_rate_rps": trace.rate,
        "span_s": span,
        "ttft_s": _pcts(ttft[finite(ttft)]),
        "tpot_s": _pcts(tpot[finite(tpot)]),
        "e2e_s": _pcts(e2e[finite(e2e)]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "attainment": float(good.mean()),
        "ttft_attainment": float(meet_ttft.mean()),
        "tpot_attainment": float((meet_tpot & ok).mean()),
        "goodput_rps": float(good.sum()) / window if window > 0 else 0.0,
        "goodput_rps_per_gpu": float(good.sum()) / window / gpus if window > 0 else 0.0,
        "output_tokens_per_s": float(outs[ok].sum()) / span if span > 0 else 0.0,
        "utilisation": util,
        "preemptions": sum(r.preemptions for r in ranks),
        "prefix_hit_rate": sum(r.hit_tokens for r in ranks) / prompt if prompt else 0.0,
        "evicted_pages": sum(r.evicted for r in ranks),
        "steps": sum(g.steps for g in sim.groups),
        "wall_s": wall,
    }
    return SimResult(
        cluster.name,
        gpus,
        arrival,
        ttft,
        tpot,
        e2e,
        [r.outcome for r in reqs],
        np.array([r.preempts for r in reqs]),
        summary,
    )


# -- deployment SPEC strings -----------------------------------------------------------------------

SPEC_HELP = """\
A deployment SPEC is KIND:KEY=VALUE,... (quote it in a shell: pd's brackets are glob characters).
  colocated:gpus=N           N GPUs, each a DP attention rank holding 1/N of the experts (EP N)
  afd:a=A,f=F                A attention GPUs (DP A) + F expert GPUs (EP F)
  pd:prefill=[SPEC],decode=[SPEC]   PD disaggregation: prefill instances send KV to decode instances
Keys of colocated and afd (defaults in brackets):
  hw=NAME [H800]   ahw=, fhw= (afd: attention / expert GPUs [hw])   mb=MICRO_BATCHES [1; afd 2]
  replicas=R [1]: R such instances   shared=attention|ffn (afd) [attention]   dispatch=two-stage|direct (afd)
  tokens= (--max-num-batched-tokens)   running= (--max-running-requests)   pages= (--kv-pages)
  policy=lpm|fcfs (--schedule-policy)   imb= (--expert-imbalance)
Examples: colocated:gpus=64   afd:a=48,f=16,mb=3   'pd:prefill=[colocated:gpus=16],decode=[afd:a=32,f=16,mb=2]'"""

_KEYS = {
    "colocated": {"gpus", "hw", "mb", "replicas", "tokens", "running", "pages", "policy", "imb"},
    "afd": {"a", "f", "hw", "ahw", "fhw", "mb", "replicas", "shared", "dispatch", "tokens", "running", "pages"}
    | {"policy", "imb"},
    "pd": {"prefill", "decode"},
}
_REQUIRED = {"colocated": ("gpus",), "afd": ("a", "f"), "pd": ("prefill", "decode")}
_INT_KEYS = {"gpus", "a", "f", "mb", "replicas", "tokens", "running", "pages"}


@dataclass(frozen=True)
class DeploymentSpec:
    """A parsed SPEC: its kind, its options, and for pd the two inner SPECs."""

    text: str
    kind: str
    opts: dict
    prefill: DeploymentSpec | None = None
    decode: DeploymentSpec | None = None

    @property
    def gpus(self) -> int:
        if self.kind == "pd":
            return self.prefill.gpus + self.decode.gpus
        per = self.opts["gpus"] if self.kind == "colocated" else self.opts["a"] + self.opts["f"]
        return per * self.opts.get("replicas", 1)


def _split_top(text: str, where: str) -> list[str]:
    """Splits at commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{where}: a ']' without its '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"{where}: a '[' without its ']'")
    parts.append("".join(cur))
    return parts


def parse_spec(text: str, nested: bool = False) -> DeploymentSpec:
    """Parses a deployment SPEC (SPEC_HELP); raises ConfigError naming what is wrong."""
    where = f"--deployment {text!r}"
    kind, sep, rest = text.strip().partition(":")
    if kind not in _KEYS:
        raise ConfigError(f"{where}: kind {kind!r} must be colocated, afd or pd (e.g. colocated:gpus=64)")
    if nested and kind == "pd":
        raise ConfigError(f"{where}: pd cannot be nested inside pd")
    if not sep or not rest.strip():
        raise ConfigError(f"{where}: give KEY=VALUE options after '{kind}:' (needs {', '.join(_REQUIRED[kind])})")
    opts: dict = {}
    for part in _split_top(rest, where):
        key, eq, value = part.strip().partition("=")
        if not eq or not key or not value:
            raise ConfigError(f"{where}: {part!r} is not KEY=VALUE")
        if key not in _KEYS[kind]:
            raise ConfigError(f"{where}: unknown key {key!r} for {kind}; known: {', '.join(sorted(_KEYS[kind]))}")
        if key in opts:
            raise ConfigError(f"{where}: key {key!r} given twice")
        if key in _INT_KEYS:
            try:
                opts[key] = int(value)
            except ValueError:
                raise ConfigError(f"{where}: {key}={value!r} must be an integer") from None
            if opts[key] < 1:
                raise ConfigError(f"{where}: {key}={value} must be >= 1")
        elif key == "imb":
            try:
                opts[key] = float(value)
            except ValueError:
                raise ConfigError(f"{where}: imb={value!r} must be a number >= 1.0") from None
        elif key in ("prefill", "decode"):
            if not (value.startswith("[") and value.endswith("]")):
                raise ConfigError(f"{where}: {key}= takes a bracketed SPEC, e.g. {key}=[colocated:gpus=16]")
            opts[key] = parse_spec(value[1:-1], nested=True)
        else:
            opts[key] = value
    missing = [k for k in _REQUIRED[kind] if k not in opts]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    if opts.get("shared", "attention") not in ("attention", "ffn"):
        raise ConfigError(f"{where}: shared={opts['shared']!r} must be attention or ffn")
    if opts.get("dispatch", "two-stage") not in ("two-stage", "direct"):
        raise ConfigError(f"{where}: dispatch={opts['dispatch']!r} must be two-stage or direct")
    if opts.get("policy", "lpm") not in POLICIES:
        raise ConfigError(f"{where}: policy={opts['policy']!r} must be lpm or fcfs")
    if kind == "pd":
        return DeploymentSpec(text, kind, {}, opts["prefill"], opts["decode"])
    return DeploymentSpec(text, kind, opts)


@dataclass(frozen=True)
class BuildOptions:
    """What every instance shares unless its SPEC says otherwise."""

    model: ModelSpec
    hw: Callable[[str], Hardware]  # a hardware name -> its entry (catalog or --hw-file)
    attn_dtype: str
    weight_dtype: str = "fp8"
    calibration: Calibration | None = None
    step_calibration: StepCalibration | None = None  # replaces the stage model with a fit of this engine's steps
    expert_imbalance: float = 1.0
    page_tokens: int = 16
    max_batch_tokens: int = 2048
    max_running: int = 256
    policy: str = "lpm"
    kv_pages: int | None = None
    prefix_cache: bool = True
    router: str = "cache_aware"


def _instance(spec: DeploymentSpec, b: BuildOptions) -> tuple[InstanceConfig, Hardware, float]:
    """An instance from a colocated or afd SPEC, with its KV pages from the memory left after the
    weights (deploy.memory_gb's accounting); also its attention hardware and KV bytes per token."""
    o = spec.opts
    afd = spec.kind == "afd"
    attn_hw = b.hw(o.get("ahw", o.get("hw", "H800")))
    ffn_hw = b.hw(o.get("fhw", o.get("hw", "H800"))) if afd else attn_hw
    sm = StageModel(
        b.model,
        attn_hw,
        ffn_hw,
        4096,  # (the per-position costs used here do not depend on it)
        b.attn_dtype,
        b.calibration,
        b.weight_dtype,
        expert_imbalance=o.get("imb", b.expert_imbalance),
    )
    mb = o.get("mb", 2 if afd else 1)
    ranks = o["a"] if afd else o["gpus"]
    ffn = o["f"] if afd else 0
    shared = o.get("shared", "attention")
    dispatch = o.get("dispatch", "two-stage")
    tokens = o.get("tokens", b.max_batch_tokens)
    dep = Deployment(spec.kind, ranks, ffn, mb, 0, dispatch, shared)
    dep.validate()
    if ffn > b.model.experts or (not afd and ranks > b.model.experts):
        raise ConfigError(f"--deployment {spec.text!r}: EP size above the model's {b.model.experts} experts")
    attn_gb, ffn_gb = memory_gb(sm, dep)
    if afd and ffn_gb > ffn_hw.mem_gb * (1 - MEMORY_RESERVE):
        raise ConfigError(
            f"--deployment {spec.text!r}: the experts need {ffn_gb:.0f} GB per FFN GPU, more than "
            f"{ffn_hw.name}'s {ffn_hw.mem_gb:g} GB less {MEMORY_RESERVE:.0%}; use more FFN GPUs"
        )
    kv_per_token = b.model.kv_bytes_per_token(sm.attn_bytes)
    pages = o.get("pages", b.kv_pages)
    if pages is None:
        room = (attn_hw.mem_gb * (1 - MEMORY_RESERVE) - attn_gb) * 1e9
        pages = int(room // (kv_per_token * b.page_tokens))
        if pages < 1:
            raise ConfigError(
                f"--deployment {spec.text!r}: the weights need {attn_gb:.0f} GB per attention GPU, more than "
                f"{attn_hw.name}'s {attn_hw.mem_gb:g} GB less {MEMORY_RESERVE:.0%}; use more GPUs"
            )
    step = StageStepTime(sm, spec.kind, ranks, ffn, mb, dispatch, shared, tokens)
    if b.step_calibration is not None:
        step = FittedStepTime(b.step_calibration, step.roles)
    cfg = InstanceConfig(
        ranks=ranks,
        step_time=step,
        kv_pages=pages,
        gpus=ranks + ffn,
        replicas=o.get("replicas", 1),
        page_tokens=b.page_tokens,
        max_batch_tokens=tokens,
        max_running=o.get("running", b.max_running),
        policy=o.get("policy", b.policy),
        prefix_cache=b.prefix_cache,
    )
    cfg.validate(f"--deployment {spec.text!r}")
    return cfg, attn_hw, kv_per_token


def build_cluster(spec: DeploymentSpec, b: BuildOptions) -> ClusterConfig:
    """The simulated deployment of a SPEC, on the model and hardware of `b`."""
    if spec.kind != "pd":
        cfg, _, _ = _instance(spec, b)
        return ClusterConfig(spec.text, cfg, router=b.router)
    pre, pre_hw, kv_per_token = _instance(spec.prefill, b)
    dec, dec_hw, _ = _instance(spec.decode, b)
    return ClusterConfig(spec.text, pre, dec, KVLink.between(pre_hw, dec_hw, kv_per_token), b.router)


# -- the command line ------------------------------------------------------------------------------

DEFAULT_SWEEP = (0.25, 0.5, 1.0, 2.0)


def parse_rates(text: str) -> list[float]:
    """`--rates 0.5,1,2` -> [0.5, 1.0, 2.0] (positive numbers)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise ConfigError(f"--rates {text!r}: give positive numbers separated by commas, e.g. 0.5,1,2")
    return sorted(set(rates))


def _load_trace(ns: argparse.Namespace, rate_scale: float) -> Trace:
    from afd_engine.planner.traces import load_mooncake, poisson

    if ns.trace:
        return load_mooncake(ns.trace, rate_scale, ns.length_scale, ns.limit)
    if ns.duration is None:
        raise ConfigError("--poisson RATE needs --duration SECONDS")
    return poisson(ns.poisson * rate_scale, ns.duration, ns.seed, ns.lengths, ns.length_scale)


def run_cli(ns: argparse.Namespace) -> dict:
    """`afd plan simulate`: every --deployment on the trace, at --rate-scale and, for --rates or
    --plot, at each rate of the sweep; JSON to --json PATH (or stdout with '-'), PNG to --plot."""
    from afd_engine.planner.hardware import get_hardware, load_hardware_file
    from afd_engine.planner.model_spec import get_model
    from afd_engine.planner.traces import check_scale

    if ns.trace and ns.poisson is not None:
        raise ConfigError("give either --trace FILE or --poisson RATE, not both")
    if not ns.trace and ns.poisson is None:
        raise ConfigError("give a workload: --trace FILE (Mooncake JSONL) or --poisson RATE --duration SECONDS")
    check_scale(ns.rate_scale, "--rate-scale")
    if ns.limit is not None and ns.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {ns.limit})")
    if ns.ttft_slo <= 0 or ns.tpot_slo <= 0:
        raise ConfigError("--ttft-slo and --tpot-slo must be > 0 (milliseconds)")
    specs = [parse_spec(s) for s in ns.deployment]
    model = get_model(ns.model)
    extra = load_hardware_file(ns.hw_file) if ns.hw_file else None
    build = BuildOptions(
        model=model,
        hw=lambda name: get_hardware(name, extra),
        attn_dtype=ns.attn_dtype or model.default_attn_dtype,
        weight_dtype=ns.weight_dtype,
        calibration=Calibration.load(ns.calibration) if ns.calibration else None,
        step_calibration=StepCalibration.load(ns.step_calibration) if ns.step_calibration else None,
        expert_imbalance=ns.expert_imbalance,
        page_tokens=ns.page_size,
        max_batch_tokens=ns.max_num_batched_tokens,
        max_running=ns.max_running_requests,
        policy=ns.schedule_policy,
        kv_pages=ns.kv_pages,
        prefix_cache=not ns.no_prefix_cache,
        router=ns.router,
    )
    clusters = [build_cluster(s, build) for s in specs]
    slo = SLO(ns.ttft_slo / 1e3, ns.tpot_slo / 1e3)
    trace = _load_trace(ns, ns.rate_scale)
    wall = time.perf_counter()
    results = [simulate(trace, c, slo) for c in clusters]
    out: dict = {
        "model": model.name,
        "stage_times": (
            f"fitted to this engine's steps ({ns.step_calibration})"
            if build.step_calibration
            else f"measured ({ns.calibration}: {build.calibration.source or 'no source given'})"
            if build.calibration
            else "roofline (planner efficiency factors)"
        ),
        "router": build.router,
        "trace": trace.summary(),
        "deployments": [{**r.as_dict(), **_describe(c)} for r, c in zip(results, clusters)],
    }
    if ns.rates or ns.plot:
        scales = parse_rates(ns.rates) if ns.rates else list(DEFAULT_SWEEP)
        sweep: dict[str, list[dict]] = {c.name: [] for c in clusters}
        for scale in scales:
            t = _load_trace(ns, ns.rate_scale * scale)
            for c in clusters:
                d = simulate(t, c, slo).as_dict()
                sweep[c.name].append(
                    {
                        "rate_scale": ns.rate_scale * scale,
                        "request_rate_rps": t.rate,
                        **{k: d[k] for k in ("attainment", "goodput_rps", "goodput_rps_per_gpu", "wall_s")},
                        "ttft_p90_s": d["ttft_s"]["p90"],
                        "tpot_p90_s": d["tpot_s"]["p90"],
                    }
                )
        out["sweep"] = sweep
        if ns.plot:
            plot_attainment(sweep, {c.name: c.gpus for c in clusters}, slo, ns.plot, f"{model.name}, {trace.source}")
            out["plot"] = ns.plot
    out["wall_s"] = time.perf_counter() - wall
    if ns.json_path == "-":
        ns.json = True  # (the caller prints JSON only)
    elif ns.json_path:
        import json

        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        out["json"] = ns.json_path
    return out


def _describe(c: ClusterConfig) -> dict:
    """The instances behind a result, for the report."""

    def one(cfg: InstanceConfig) -> dict:
        return {
            "instances": cfg.replicas,
            "attention_ranks": cfg.ranks,
            "gpus_per_instance": cfg.gpus or cfg.ranks,
            "kv_pages_per_rank": cfg.kv_pages,
            "kv_tokens_per_rank": cfg.kv_pages * cfg.page_tokens,
            "max_batch_tokens": cfg.max_batch_tokens,
            "max_running": cfg.max_running,
            "policy": cfg.policy,
        }

    if c.decode is None:
        return {"layout": one(c.serving)}
    link = c.kv_link
    return {
        "layout": {"prefill": one(c.serving), "decode": one(c.decode)},
        "kv_link": {"gb_per_s": link.bandwidth_bps / 1e9, "latency_us": link.latency_s * 1e6},
    }


def plot_attainment(sweep: dict[str, list[dict]], gpus: dict[str, int], slo: SLO, png: str, title: str) -> None:
    """SLO attainment (left) and goodput per GPU (right) against the request rate, one line per
    deployment (plot.py's conventions: Agg backend, one PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in sweep.items():
        x = [p["request_rate_rps"] for p in points]
        label = f"{name} ({gpus[name]} GPUs)"
        left.plot(x, [100 * p["attainment"] for p in points], marker="o", markersize=3, label=label)
        right.plot(x, [p["goodput_rps_per_gpu"] for p in points], marker="o", markersize=3, label=label)
    left.set_ylabel(f"SLO attainment (%): TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms")
    left.set_ylim(-2, 102)
    right.set_ylabel("goodput (requests / s / GPU)")
    for ax in (left, right):
        ax.set_xlabel("request rate (requests / s)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def print_report(out: dict) -> None:
    """The human table of `afd plan simulate`."""
    tr = out["trace"]
    print(
        f"{out['model']}; trace {tr['source']}: {tr['requests']} requests over {tr['span_s']:.0f} s "
        f"({tr['rate_rps']:.2f}/s), mean prompt {tr['mean_input']:.0f}, mean output {tr['mean_output']:.0f} tokens"
    )
    print(f"stage times: {out['stage_times']}; router: {out['router']}")
    d0 = out["deployments"][0]
    slo = d0["slo"]
    print(f"SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= {slo['tpot_s'] * 1e3:g} ms")
    print(
        f"{'deployment':<44} {'GPUs':>4} {'TTFT p50/p90/p99 s':>20} {'TPOT p50/p90/p99 ms':>20} "
        f"{'E2E p50/p99 s':>14} {'SLO%':>5} {'good/s':>7} {'good/s/GPU':>10} {'wall s':>6}"
    )

    def trio(p: dict, k: float, keys=("p50", "p90", "p99")) -> str:
        return "/".join("-" if p[x] is None else f"{p[x] * k:.{0 if p[x] * k >= 100 else 1}f}" for x in keys)

    for d in out["deployments"]:
        print(
            f"{d['name'][:44]:<44} {d['gpus']:>4} {trio(d['ttft_s'], 1):>20} {trio(d['tpot_s'], 1e3):>20} "
            f"{trio(d['e2e_s'], 1, ('p50', 'p99')):>14} {100 * d['attainment']:>5.1f} {d['goodput_rps']:>7.3f} "
            f"{d['goodput_rps_per_gpu']:>10.4f} {d['wall_s']:>6.1f}"
        )
    for d in out["deployments"]:
        util = ", ".join(f"{k} {100 * v:.0f}%" for k, v in d["utilisation"].items())
        lost = [f"{d[k]} {k}" for k in ("rejected", "truncated", "unfinished") if d[k]]
        print(
            f"  {d['name']}: busy {util}; prefix hits {100 * d['prefix_hit_rate']:.0f}% of prompt tokens; "
            f"{d['preemptions']} preemptions; {d['steps']} steps" + (f"; {', '.join(lost)}" if lost else "")
        )
    for name, points in out.get("sweep", {}).items():
        row = ", ".join(f"{p['request_rate_rps']:.2f}/s: {100 * p['attainment']:.0f}%" for p in points)
        print(f"  sweep {name}: SLO attainment {row}")
    if "plot" in out:
        print(f"plot: {out['plot']}")
    if "json" in out:
        print(f"json: {out['json']}")
    print(f"simulation wall time: {out['wall_s']:.1f} s")
