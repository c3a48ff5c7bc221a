"""Continuous batching: which requests run in the next step, and with how many tokens.

Each step, in order: every decoding request gets one token (pages permitting, preempting the
newest request when they do not), partially prefilled requests continue their prompt in chunks,
then waiting requests are admitted while the token budget, sequence slots and free pages allow.
An admitted request starts from its longest prefix in the prefix cache and prefills the rest.

Pages come from the free list first, then from evicting unused prefix-cache pages, and only then
from preempting: a preempted request leaves its computed pages in the cache and later resumes
from whatever of them is still there.

Admission order (--schedule-policy): fcfs takes the queue in arrival order; lpm takes requests
with the longest cached prefix first, but a request that has waited LPM_MAX_WAIT_ROUNDS rounds
(or was preempted) goes before any of them, so no request starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.kv_cache import KVPool, pages_for
from afd_engine.runtime.radix_cache import RadixCache
from afd_engine.runtime.request import Request

LPM_MAX_WAIT_ROUNDS = 64
LPM_MAX_QUEUE = 128  # longer queues are taken fcfs: ordering them costs a tree walk per request


@dataclass
class StepPlan:
    extend: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    decode: list[Request] = field(default_factory=list)
    # speculative decoding: decodes that verify draft tokens, (request, its newest token + drafts)
    verify: list[tuple[Request, int]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (KV exhausted)

    @property
    def empty(self) -> bool:
        return not self.extend and not self.decode and not self.verify

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.extend) + len(self.decode) + sum(n for _, n in self.verify)


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        max_batch_tokens: int,
        max_running: int,
        context_len: int,
        cache: RadixCache | None = None,
        policy: str = "lpm",
    ) -> None:
        self.pool = pool
        self.cache = cache or RadixCache(pool, enabled=False)
        self.policy = policy
        self.max_batch_tokens, self.max_running, self.context_len = max_batch_tokens, max_running, context_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.round = 0
        self.prompt_tokens = 0  # of admitted requests, since start
        self.cache_hit_tokens = 0  # of those, served from the prefix cache
        self.scoring: set[Request] = set()  # live requests that asked for prompt logprobs
        # speculative decoding: draft steps per verify (runtime/spec_step.py); a request's pages
        # then also hold its drafts and the chained draft steps after them
        self.spec_steps = 0

    def add(self, req: Request) -> None:
        """Queues a request; raises InvalidRequestError if it can never run."""
        self.check(req)
        req.queued_round = self.round
        self.waiting.append(req)
        if req.prompt_logprobs is not None:
            self.scoring.add(req)

    def check(self, req: Request) -> None:
        """Raises InvalidRequestError if the request can never run here."""
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if n >= self.context_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the context length is {self.context_len}; "
                f"shorten the prompt to at most {self.context_len - 1} tokens",
                param="prompt",
            )
        if n + 1 > self.pool.capacity_tokens:
            raise InvalidRequestError(
                f"the prompt needs {n + 1} KV cache slots but the whole pool holds {self.pool.capacity_tokens}; "
                "raise --kv-cache-memory-mb",
                param="prompt",
            )

    # -- prefill-decode disaggregation (decode side) -------------------------------------------

    def reserve(self, req: Request, reserved: int) -> bool:
        """Opens req's row with its cached prefix and the pages its prompt and first token need,
        as admission would (one page kept per running request); False, and nothing held, when
        they do not fit now. `reserved` requests hold rows already without running."""
        if len(self.running) + reserved >= self.max_running or self.pool.free_rows == 0:
            return False
        prefix = self.cache.acquire(req)
        tokens = req.known_len + 1  # (a resumed request's output so far is filled from outside too)
        need = pages_for(tokens, self.pool.page_size) - len(prefix)
        if need > self._available_pages() - len(self.running):
            self.cache.release(req)
            return False
        req.row = self.pool.open_row(prefix)
        req.num_cached = 0
        if not self._grow(req.row, tokens):  # (cannot fail: checked above)
            self._drop_cache(req)
            return False
        return True

    def activate(self, req: Request) -> None:
        """A reserved request whose prompt's pages were filled from outside (a prefill instance)
        and whose first token is in output_ids: it decodes from now on; its full pages join the
        prefix cache."""
        req.num_cached = req.known_len - 1
        req.admitted = True
        self.prompt_tokens += len(req.prompt_ids)
        self.running.append(req)
        self.cache.cache(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Takes a finished or aborted request out and frees its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.scoring.discard(req)
        self._drop_cache(req)

    def schedule(self) -> StepPlan:
        self.round += 1
        plan = StepPlan()
        budget = self._schedule_decodes(plan, self.max_batch_tokens)
        budget = self._continue_prefills(plan, budget)
        self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        capacity = self.pool.tokens_capacity
        for req in [r for r in self.running if r.is_decode]:
            if budget == 0:
                break
            if req.row is None or req.last_token_under_way(self.context_len):  # preempted in this loop, or done
                continue
            # (most decodes still have room in their last page: no allocation to try)
            if capacity(req.row) > req.num_cached or self._reserve(req, req.num_cached + 1, plan):
                drafts = self._room_for_drafts(req, budget - 1) if req.draft_ids else 0
                if drafts:
                    plan.verify.append((req, 1 + drafts))
                else:
                    plan.decode.append(req)
                budget -= 1 + drafts
        return budget

    def _room_for_drafts(self, req: Request, budget: int) -> int:
        """How many of its drafts a speculating decode verifies: those its pages hold (grown where
        pages are free or evictable, with the chained draft steps' positions too; never by
        preempting), within the step's token budget."""
        need = req.num_cached + 1 + len(req.draft_ids)
        if not self._grow(req.row, self.spec_need(need)):
            self._grow(req.row, need)
        return max(0, min(len(req.draft_ids), self.pool.tokens_capacity(req.row) - req.num_cached - 1, budget))

    def spec_need(self, tokens: int) -> int:
        """Tokens of cache a speculating request holds for a step that computes up to `tokens`:
        those, and the positions its chained draft steps write after them (runtime/spec_step.py),
        within the context length."""
        return min(tokens + self.spec_steps - 1, self.context_len)

    def _grow_sampler(self, req: Request, n: int) -> None:
        """A prefill chunk that completes its prompt: with speculation, room for the chained draft
        steps after it too where pages are free (without, its first draft steps are skipped)."""
        if self.spec_steps and n == req.pending:
            self._grow(req.row, self.spec_need(req.num_cached + n))

    def _reserve(self, req: Request, tokens: int, plan: StepPlan) -> bool:
        """Grows req's pages to `tokens`, preempting newer requests; False if req itself lost out."""
        while not self._grow(req.row, tokens):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                if self.pool.open_rows > 1:  # pages held for requests whose KV is on its way (PD decode)
                    self._preempt(req)  # it resumes once they run (and can be preempted) or fail
                    return False
                req.finish_reason = "length"  # the pool cannot hold this one sequence
                plan.finished.append(req)
                self.remove(req)
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _continue_prefills(self, plan: StepPlan, budget: int) -> int:
        for req in self.running:
            if budget == 0:
                break
            if req.is_decode or req.row is None:
                continue
            n = min(req.pending, budget, self._room(req))
            if n > 0 and self._grow(req.row, req.num_cached + n):
                self._grow_sampler(req, n)
                plan.extend.append((req, n))
                budget -= n
        return budget

    def step_done(self, plan: StepPlan) -> None:
        """After a step's forward: prefilled pages go into the prefix cache for others to reuse."""
        for req, _ in plan.extend:
            if req.row is not None:
                self.cache.cache(req)

    def _grow(self, row: int, tokens: int) -> bool:
        """Grows the row's pages to `tokens`, evicting unused cached pages when the pool is short."""
        short = self.pool.extra_pages_needed(row, tokens) - self.pool.free_pages
        if short > 0:
            self.cache.evict(short)
        return self.pool.grow(row, tokens)

    def _available_pages(self) -> int:
        return self.pool.free_pages + self.cache.evictable_pages

    def _room(self, req: Request) -> int:
        """Tokens req could still add now: its own free slots plus all free or evictable pages."""
        own = self.pool.tokens_capacity(req.row) - req.num_cached
        return own + self._available_pages() * self.pool.page_size

    def _admit(self, plan: StepPlan, budget: int) -> None:
        if not self._can_admit(budget):
            return  # (ordering the queue costs a tree walk per request: only when it matters)
        for req in self._admission_order():
            if not self._can_admit(budget):
                break
            prefix = self.cache.acquire(req)
            # Admission by pages: the whole pending prompt must fit, with one page kept per running
            # request so that decodes do not preempt what was just admitted.
            need = pages_for(req.total_len + 1, self.pool.page_size) - len(prefix)
            if need > self._available_pages() - len(self.running):
                self.cache.release(req)
                if not self.running and self.pool.open_rows == 0:  # grew past the whole pool: cannot resume
                    self.waiting.remove(req)
                    req.finish_reason = "length"
                    plan.finished.append(req)
                    continue
                break
            self.waiting.remove(req)
            req.row = self.pool.open_row(prefix)
            req.num_cached = len(prefix) * self.pool.page_size
            if not req.admitted:
                req.admitted, req.num_cached_tokens = True, req.num_cached
                self.prompt_tokens += len(req.prompt_ids)
                self.cache_hit_tokens += req.num_cached
            self.running.append(req)
            n = min(req.pending, budget)
            self._grow(req.row, req.num_cached + n)
            self._grow_sampler(req, n)
            plan.extend.append((req, n))
            budget -= n

    def _can_admit(self, budget: int) -> bool:
        return bool(self.waiting) and budget > 0 and len(self.running) < self.max_running and self.pool.free_rows > 0

    def _admission_order(self) -> list[Request]:
        if self.policy == "fcfs" or not self.cache.enabled or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            return list(self.waiting)
        patient = self.round - LPM_MAX_WAIT_ROUNDS  # queued before this round: waited long enough
        return sorted(
            self.waiting,
            key=lambda r: (r.num_preemptions == 0 and r.queued_round > patient, -self.cache.prefix_len(r)),
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_cache(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.queued_round = self.round
        self.waiting.appendleft(req)

    def _drop_cache(self, req: Request) -> None:
        if req.prefix is not None:
            self.cache.release(req)
        req.num_cached = 0
