"""A rank whose decodes speculate (`speculative.SpecDecoding`): each decode step verifies k drafts
per request (k + 1 rows) and keeps the number of tokens its request's next draw says.

A decoder's draws are known when it starts decoding, so the whole of its decode is laid out then,
with numpy: how many tokens it has gained before each of its verifies, the step it finishes at, the
steps at which it needs pages and how many, and what it adds to the rank's sums of KV lengths and
attended positions at each step. The sums' increments wait in ring buffers indexed by step, so a
step still costs the simulation work in proportion to the ranks, not to their requests; a decoder
that stops early (preempted, truncated) takes its future increments back out.

Pages: before verify j a request holds its cached positions and, after them, its newest token, its
k drafts and the k - 1 positions the chained draft passes write (the engine's scheduler holds
these, runtime/scheduler.py `spec_need`), never past its output's end. Unlike the engine, which
verifies fewer drafts where pages are short, the rank takes them like any decode's page, preempting.
"""

from __future__ import annotations

import numpy as np

from afd_engine.planner.sim.cluster import InstanceConfig
from afd_engine.planner.sim.rank import Host, Instance, Rank
from afd_engine.planner.sim.request import DECODE, Request
from afd_engine.planner.sim.router import Domain
from afd_engine.planner.sim.step_time import Load


class DraftingRank(Rank):
    """An attention rank of an instance with speculative decoding (`cfg.speculative`)."""

    def __init__(self, sim: Host, group: Instance, domain: Domain[Rank], cfg: InstanceConfig, role: str) -> None:
        super().__init__(sim, group, domain, cfg, role)
        k = cfg.speculative.drafts
        self.k = k
        self.tri = (k + 1) * (k + 2) // 2  # positions its k + 1 verify rows add to what they read
        self.hold = 2 * k  # positions held past the cached ones (module docstring)
        size = 1 << (sim.max_output + 2).bit_length()  # more steps than any decode spans
        self.mask = size - 1
        self.d_ctx = np.zeros(size, np.int64)  # increments of ctx, attended and n_below at step & mask
        self.d_att = np.zeros(size, np.int64)
        self.d_below = np.zeros(size, np.int64)
        self.page_need: dict[int, list[tuple[Request, int, int]]] = {}  # step -> (request, epoch, pages)
        self.step_now = 0  # the step being scheduled or committed
        self.verifies = self.spec_tokens = 0  # verify rows so far, tokens their decodes kept

    def _ring_add(self, buf: np.ndarray, first: int, values: np.ndarray) -> None:
        """Adds values[i] to the entry of step first + i."""
        n = len(values)
        if not n:
            return
        i = first & self.mask
        head = min(n, self.mask + 1 - i)
        buf[i : i + head] += values[:head]
        if head < n:
            buf[: n - head] += values[head:]

    def _start_decode(self, req: Request, s: int) -> None:
        rem = req.output_len - req.gen
        kept = req.draws[req.drawn : req.drawn + rem]
        total = np.cumsum(kept)
        n = int(np.searchsorted(total, rem)) + 1  # verifies until its output is complete
        gains = np.zeros(n, np.int64)
        gains[1:] = total[: n - 1]
        req.gains = gains
        req.state, req.s0, req.t0, req.g0, req.u0 = DECODE, s, req.kv, req.gen, req.priv
        self.n_dec += 1
        self.ctx += req.kv
        self._ring_add(self.d_ctx, s + 1, kept[: n - 1])
        if self.K:
            lengths = req.kv + gains
            attended = np.minimum(lengths, self.K)
            self.attended += int(attended[0])
            self._ring_add(self.d_att, s + 1, np.diff(attended))
            if req.kv < self.K:
                self.n_below += 1
                j = int(np.searchsorted(lengths, self.K))  # its first verify at K or past it
                if j < n:
                    self.d_below[(s + j) & self.mask] -= 1
        held = -(-req.priv // self.P)
        pages = -(-(req.priv + np.minimum(gains + self.hold, rem)) // self.P)
        grants = np.diff(pages, prepend=held)
        req.pages_held = held
        for j in np.flatnonzero(grants).tolist():
            self.page_need.setdefault(s + j, []).append((req, req.epoch, int(grants[j])))
        self.finish_at.setdefault(s + n - 1, []).append((req, req.epoch))

    def _gained(self, req: Request, steps: int) -> int:
        return int(req.gains[steps])

    def _leave_decode(self, req: Request, kv: int) -> None:
        """req stops decoding at step_now (its tokens and private positions already set): what it
        adds to the sums now and later comes out, and the pages held past its tokens go back."""
        d = self.step_now - req.s0
        gains = req.gains
        self.n_dec -= 1
        self.ctx -= req.t0 + int(gains[d])
        self._ring_add(self.d_ctx, self.step_now + 1, -np.diff(gains[d:]))
        if self.K:
            lengths = req.t0 + gains
            attended = np.minimum(lengths[d:], self.K)
            self.attended -= int(attended[0])
            self._ring_add(self.d_att, self.step_now + 1, -np.diff(attended))
            if lengths[d] < self.K:
                self.n_below -= 1
                j = int(np.searchsorted(lengths, self.K))
                if j < len(gains):
                    self.d_below[(req.s0 + j) & self.mask] += 1
        self.used -= req.pages_held - -(-req.priv // self.P)
        req.pages_held = 0
        req.drawn += d
        self.spec_tokens += req.gen - req.g0
        req.epoch += 1

    def _took_pages(self, req: Request, pages: int) -> None:
        req.pages_held += pages

    def _decode_rows(self, s: int) -> int:
        self.step_now = s
        i = s & self.mask
        self.ctx += int(self.d_ctx[i])
        self.d_ctx[i] = 0
        if self.K:
            self.attended += int(self.d_att[i])
            self.n_below += int(self.d_below[i])
            self.d_att[i] = self.d_below[i] = 0
        needs = self.page_need.pop(s, None)
        if needs:
            live = [(req, p) for req, epoch, p in needs if req.epoch == epoch and req.state == DECODE]
            if self._grow(sum(p for _, p in live)):
                for req, p in live:
                    req.pages_held += p
            else:
                self._decode_pages_short(live, s)
        self.verifies += self.n_dec
        return self.n_dec * (self.k + 1)

    def _load(self, tokens: int, seqs: int, pairs: float) -> Load:
        # each decoder's k + 1 rows read its cached positions and 1..k+1 more (a decoder fewer than
        # k + 1 positions short of top-k is counted as if all its rows were below it)
        k1, n = self.k + 1, self.n_dec
        ctx = k1 * self.ctx + n * self.tri
        if self.K:
            return tokens, seqs, ctx, pairs, k1 * self.attended + self.n_below * self.tri, self.chunk_attended
        return tokens, seqs, ctx, pairs

    def draft_load(self) -> Load | None:
        """The load of one chained draft pass of this step: a row per decoder, past its drafts."""
        n = self.n_dec
        if not n:
            return None
        ahead = self.k + 2
        if self.K:
            return n, n, self.ctx + n * ahead, 0.0, self.attended + self.n_below * ahead, 0.0
        return n, n, self.ctx + n * ahead, 0.0

    def commit(self, s: int, t: float) -> None:
        self.step_now = s
        super().commit(s, t)
