"""Continuous batching: which requests run in the next step, and with how many tokens.

Each step, in order: every decoding request gets one token (pages permitting, preempting the
newest request when they do not), partially prefilled requests continue their prompt in chunks,
then waiting requests are admitted while the token budget, sequence slots and free pages allow.
A preempted request gives back all its pages and later recomputes its prompt and output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.kv_cache import KVPool, pages_for
from afd_engine.runtime.request import Request


@dataclass
class StepPlan:
    extend: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    decode: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (KV exhausted)

    @property
    def empty(self) -> bool:
        return not self.extend and not self.decode


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_tokens: int, max_running: int, context_len: int) -> None:
        self.pool = pool
        self.max_batch_tokens, self.max_running, self.context_len = max_batch_tokens, max_running, context_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        """Queues a request; raises InvalidRequestError if it can never run."""
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
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Takes a finished or aborted request out and frees its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._drop_cache(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_decodes(plan, self.max_batch_tokens)
        budget = self._continue_prefills(plan, budget)
        self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        for req in [r for r in self.running if r.is_decode]:
            if budget == 0:
                break
            if req.row is None:  # preempted earlier in this loop
                continue
            if self._reserve(req, req.num_cached + 1, plan):
                plan.decode.append(req)
                budget -= 1
        return budget

    def _reserve(self, req: Request, tokens: int, plan: StepPlan) -> bool:
        """Grows req's pages to `tokens`, preempting newer requests; False if req itself lost out."""
        while not self.pool.grow(req.row, tokens):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
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
            if n > 0 and self.pool.grow(req.row, req.num_cached + n):
                plan.extend.append((req, n))
                budget -= n
        return budget

    def _room(self, req: Request) -> int:
        """Tokens req could still add now: its own free slots plus all free pages."""
        own = self.pool.tokens_capacity(req.row) - req.num_cached
        return own + self.pool.free_pages * self.pool.page_size

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.pool.free_rows:
            req = self.waiting[0]
            # Admission by free pages: the whole pending prompt must fit, with one page kept per
            # running request so that decodes do not preempt what was just admitted.
            if pages_for(req.pending + 1, self.pool.page_size) > self.pool.free_pages - len(self.running):
                if not self.running:  # grew past the whole pool (after preemption): cannot resume
                    self.waiting.popleft()
                    req.finish_reason = "length"
                    plan.finished.append(req)
                    continue
                break
            self.waiting.popleft()
            req.row = self.pool.open_row()
            self.running.append(req)
            n = min(req.pending, budget)
            self.pool.grow(req.row, n)
            plan.extend.append((req, n))
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_cache(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _drop_cache(self, req: Request) -> None:
        if req.row is not None:
            self.pool.release(req.row)
            req.row = None
        req.num_cached = 0
