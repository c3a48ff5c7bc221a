"""One attention rank's scheduler, as the engine's (runtime/scheduler.py): decodes first, then
chunked prefill continuations, then admissions in fcfs or lpm order, under a token budget per step,
a cap on running requests and the KV pool of its `RankCache`. When a decode needs a page and none is
free or evictable, the newest running request is preempted, to be redone later from whatever of it
the prefix cache still holds.

A step costs the simulation time in proportion to the ranks with work, not to their requests: a
rank keeps its decoders' context-length sum, and which of them need a new KV page in which step,
incrementally. With sparse attention (`attention_topk` K) it also keeps the sum of min(context, K)
over its decoders, the decoders still short of K, and the step at which each of them reaches K.
Where the step-time model prices padding (`padded_loads`, a fit of this engine's CPU steps), a load
also carries the query-key pairs of its prefill chunks padded to the longest chunk and context,
and the decoders' positions padded to the longest context (found in a heap keyed by each decoder's
context less its decode steps, which stays fixed while it decodes).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from afd_engine.planner.sim.cluster import InstanceConfig, KVLink
from afd_engine.planner.sim.kv_cache import RankCache
from afd_engine.planner.sim.request import DECODE, INF, JOINING, PREFILL, RESERVED, WAITING, Request
from afd_engine.planner.sim.router import Domain
from afd_engine.planner.sim.step_time import Load

# Same values as runtime/scheduler.py (not imported: that module needs torch).
LPM_MAX_WAIT_ROUNDS = 64
LPM_MAX_QUEUE = 128


def attended_pairs(start: int, n: int, k: int) -> float:
    """Query-key pairs a prefill chunk of n tokens after `start` cached ones attends to when each
    query attends to at most k positions: the sum of min(p, k) for p = start+1 .. start+n."""
    if start >= k:
        return float(n * k)
    below = min(n, k - start)  # queries at positions up to k attend to all they see
    return below * start + below * (below + 1) / 2 + (n - below) * k


class Host(Protocol):
    """What a rank needs of the simulation that runs it (loop.Simulation)."""

    block_tokens: int
    max_output: int  # the longest output of the trace
    seq: Iterator[int]
    now: float
    kv_link: KVLink | None

    def finished(self, req: Request, t: float, outcome: str) -> None: ...

    def send(self, req: Request, src: Rank, t: float) -> None: ...

    def sent_all(self, req: Request, t: float) -> None: ...


class Instance(Protocol):
    """What a rank needs of the instance it steps with (loop.Group)."""

    steps: int

    def activate(self, rank: Rank) -> None: ...


class Rank(RankCache):
    """One attention rank: its scheduler, over the KV pool and prefix cache it inherits."""

    def __init__(self, sim: Host, group: Instance, domain: Domain[Rank], cfg: InstanceConfig, role: str) -> None:
        super().__init__(len(domain.ranks), cfg, sim.block_tokens, sim.seq)
        self.sim, self.group, self.domain, self.role = sim, group, domain, role
        domain.add(self)
        self.max_tokens, self.max_running, self.policy = cfg.max_batch_tokens, cfg.max_running, cfg.policy
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # admission order: the last is preempted first
        self.prefilling: dict[int, Request] = {}
        self.joining: list[Request] = []  # start decoding at the next step
        self.first_out: list[Request] = []  # PD: first tokens that go out when this step ends
        self.left = 0  # requests that left since the instance's last step began (finished, handed on)
        self.n_dec, self.ctx = 0, 0  # decoders and the sum of their KV lengths
        # sparse attention: the sum of min(KV length, K) over decoders, those below K, and the step
        # at which each of those reaches K
        self.K = cfg.attention_topk
        self.attended, self.n_below = 0, 0
        self.reach_k_at: dict[int, list[tuple[Request, int]]] = {}
        self.chunk_attended = 0.0  # this step's prefill pairs attended to (sparse attention)
        self.padded = bool(getattr(cfg.step_time, "padded_loads", False))
        self.longest: list[tuple[int, int, int, Request]] = []  # (-(t0 - s0), i, epoch, decoder)
        self.buckets: list[set[Request]] = [set() for _ in range(self.P)]  # decoders needing a page at step % P
        self.finish_at: dict[int, list[tuple[Request, int]]] = {}
        self.chunks: list[tuple[Request, int]] = []
        self.incoming: deque[Request] = deque()  # PD decode side: waiting to reserve pages
        self.reserved = 0
        self.nic_free = 0.0
        self.preemptions = self.prompt_tokens = self.hit_tokens = 0

    # -- requests arriving and leaving --------------------------------------------------------

    def add(self, req: Request) -> None:
        req.rank, req.state, req.queued = self, WAITING, self.group.steps
        self.waiting.append(req)
        self.group.activate(self)

    def _leave_decode(self, req: Request, kv: int) -> None:
        self.n_dec -= 1
        self.ctx -= kv
        if self.K:
            self.attended -= min(kv, self.K)
            self.n_below -= kv < self.K
        self.buckets[req.phase].discard(req)
        req.epoch += 1

    def _finish(self, req: Request, t: float, kv: int, outcome: str = "ok") -> None:
        self.left += 1
        self.running.pop(req.i, None)
        self.prefilling.pop(req.i, None)
        self._release(req, kv)
        self.domain.load[self.lid] -= 1
        self.sim.finished(req, t, outcome)

    def _preempt(self, req: Request, s: int) -> None:
        """Back to the queue's head; the work is redone, less what the prefix cache keeps."""
        if req.state == DECODE:
            d = self._gained(req, s - req.s0)
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

    def _start_decode(self, req: Request, s: int) -> None:
        req.state, req.s0, req.t0, req.g0, req.u0 = DECODE, s, req.kv, req.gen, req.priv
        req.phase = (s - req.priv) % self.P  # steps at which its private tokens fill a page
        self.buckets[req.phase].add(req)
        self.n_dec += 1
        self.ctx += req.kv
        if self.padded:
            heapq.heappush(self.longest, (s - req.kv, req.i, req.epoch, req))
        if self.K:
            self.attended += min(req.kv, self.K)
            if req.kv < self.K:  # its KV grows by one a step from this one on: K after K - kv steps
                self.n_below += 1
                self.reach_k_at.setdefault(s + self.K - 1 - req.kv, []).append((req, req.epoch))
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

    def cancel(self, req: Request) -> None:
        """A reserved request will not come (its prefill rank dropped it): its pages go back."""
        self.reserved -= 1
        req.held, req.priv = req.d_held, req.d_priv
        self._unlock(req, req.held)
        self.used -= -(-req.priv // self.P)
        req.held = req.priv = 0
        self.domain.load[self.lid] -= 1

    def activate(self, req: Request, t: float) -> None:
        """req's KV and first token arrived: it decodes from the next step, and its first token
        goes out with the second, when that step ends (the engine's decode side hands it on with
        the step's outputs)."""
        self.reserved -= 1
        req.kv, req.gen, req.held, req.priv = req.input_len, 1, req.d_held, req.d_priv
        if req.output_len <= 1:
            req.first = t
            self._release(req, req.kv)
            self.domain.load[self.lid] -= 1
            self.sim.finished(req, t, "ok")
            return
        self._insert(req, req.input_len // self.B)
        req.order = next(self.seq)
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
                if req.first == INF:  # PD: its first token goes out when this step ends (activate)
                    self.first_out.append(req)
                self._start_decode(req, s)
            self.joining.clear()
        rows = self._decode_rows(s)
        budget = self.max_tokens - rows
        tokens = seqs = rows
        pairs = 0.0
        self.chunk_attended = 0.0
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
                    if self.K:
                        self.chunk_attended += attended_pairs(req.kv, n, self.K)
                    if budget == 0:
                        break
        if self.waiting and budget > 0 and len(self.running) + self.reserved < self.max_running:
            budget, tokens, seqs, pairs = self._admit(s, budget, tokens, seqs, pairs)
        if not tokens:
            return None
        return self._load(tokens, seqs, pairs)

    def _decode_rows(self, s: int) -> int:
        """Step s's decodes: their pages (preempting when short), one more position each; returns
        their rows in the step."""
        bucket = self.buckets[s % self.P]
        if bucket and not self._grow(len(bucket)):
            self._decode_pages_short([(req, 1) for req in bucket], s)
        self.ctx += self.n_dec
        if self.K:
            self._grow_attended(s)
        return self.n_dec

    def _load(self, tokens: int, seqs: int, pairs: float) -> Load:
        """This step's load (step_time.Load) from its token rows, sequences and prefill pairs."""
        if self.K:
            return tokens, seqs, self.ctx, pairs, self.attended, self.chunk_attended
        if self.padded:
            return tokens, seqs, self.ctx, pairs, *self._padded()
        return tokens, seqs, self.ctx, pairs

    def _padded(self) -> tuple[float, float]:
        """(prefill pairs padded to the longest chunk and context, decode positions padded to the
        longest context) of the step being planned."""
        ext = 0.0
        if self.chunks:
            q = max(n for _, n in self.chunks)
            ext = float(len(self.chunks) * q * max(req.kv + n for req, n in self.chunks))
        heap = self.longest
        while heap and (heap[0][3].epoch != heap[0][2] or heap[0][3].state != DECODE):
            heapq.heappop(heap)  # a decoder that left since
        if not self.n_dec or not heap:
            return ext, 0.0
        # a decoder's context at step s is t0 + (s - s0) + 1; the heap's head has the largest t0 - s0
        return ext, float(self.n_dec * (self.group.steps - heap[0][0] + 1))

    def _gained(self, req: Request, steps: int) -> int:
        """Tokens a decoder gained in its first `steps` decode steps: one each."""
        return steps

    def _grow_attended(self, s: int) -> None:
        """Step s added a position to every decoder: those below K attend to one more; those that
        reach K with it stop growing (entries of requests that left decoding since are stale)."""
        self.attended += self.n_below
        reached = self.reach_k_at.pop(s, None)
        if reached:
            for req, epoch in reached:
                if req.epoch == epoch and req.state == DECODE:
                    self.n_below -= 1

    def _decode_pages_short(self, needs: list[tuple[Request, int]], s: int) -> None:
        """Pages ran out: decodes in running order take theirs (`needs`: request, pages),
        preempting the newest running request until one fits or the decode itself was preempted
        (as the engine does)."""
        for req, pages in sorted(needs, key=lambda e: e[0].order):
            if req.state != DECODE:
                continue  # preempted for an older request in this loop
            while not self._grow(pages):
                victim = next(reversed(self.running.values()))
                if victim is req and len(self.running) == 1:  # the pool cannot hold this one sequence
                    d = self._gained(req, s - req.s0)
                    req.gen, req.priv = req.g0 + d, req.u0 + d
                    self._leave_decode(req, req.t0 + d)
                    self._finish(req, self.sim.now, req.t0 + d, "truncated")
                    break
                self._preempt(victim, s)
                if victim is req:
                    break
            else:
                self._took_pages(req, pages)

    def _took_pages(self, req: Request, pages: int) -> None:
        """A decode got the pages it needed for this step (kept track of by a drafting rank)."""

    def _admission_order(self, s: int) -> Iterator[Request]:
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
            req.order = next(self.seq)
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
            if self.K:
                self.chunk_attended += attended_pairs(req.kv, n, self.K)
        return budget, tokens, seqs, pairs

    def commit(self, s: int, t: float) -> None:
        """Step s ended at t: decodes got their tokens, chunks their KV; some requests are done."""
        if self.first_out:
            for req in self.first_out:
                req.first = t
            self.first_out.clear()
        done = self.finish_at.pop(s, None)
        if done:
            for req, epoch in done:
                if req.epoch == epoch and req.state == DECODE:
                    d = req.output_len - req.g0  # (its last step's tokens complete its output)
                    kv = req.t0 + d
                    req.gen, req.priv = req.output_len, req.u0 + d
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
                self.left += 1
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
