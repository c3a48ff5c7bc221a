"""The front end's part in attention-rank failover (--enable-fault-tolerance, AFD and colocated).

An attention rank holds its requests' KV caches; when its process exits they are gone, but the
front end knows what each request needs to go on: its prompt, its settings, and the tokens it has
handed on so far. The surviving attention ranks and the FFN ranks agree to continue without the
lost rank (ranks/fault_tolerance_recovery.py); the front end routes nothing new to it, and
resubmits each of its unfinished requests to a survivor under the same id, with those tokens as
"resume": the engine puts them at the head of the request's output, prefills the prompt and them
(through the prefix cache where it helps), and goes on as with a preempted request (max_tokens,
min_tokens, stop strings, grammars and penalties count them). The consumer's stream continues: no
error, no token twice or missing, one request in the usage.

Seeded draws depend on (seed, position) only, so a resumed request draws what it would have; the
front end gives every request without a seed one of its own for that reason (an unseeded request
also samples on as if nothing happened). Updates that the lost rank sent before it died and that
arrive late are dropped: the resumed request computes those tokens again, the same ones.

A disaggregated request (with a bootstrap room) cannot resume here, as its prefill instance sent
its KV to the lost rank: it ends with an error, which `afd router`'s own failover resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from afd_engine.control import messages as msgs
from afd_engine.runtime.request import TokenUpdate
from afd_engine.sampling_params import SamplingParams

log = logging.getLogger("afd.failover")


@dataclass
class Tracked:
    """What resuming one unfinished request takes."""

    prompt_ids: list[int]
    params: SamplingParams
    disaggregation: dict | None
    rank: int
    tokens: list[int] = field(default_factory=list)  # handed to the consumer's queue so far
    prompt_logprobs_sent: bool = False


class Failover:
    """Tracks the requests of a front end whose attention ranks may be lost one by one, and says
    what to do once some are: `lost_ranks()` gives the attention ranks whose process exited."""

    def __init__(self, lost_ranks: Callable[[], set[int]], num_ranks: int) -> None:
        self.lost_ranks, self.num_ranks = lost_ranks, num_ranks
        self.lost: set[int] = set()
        self.rejoining: set[int] = set()  # lost ranks whose replacement is up, until it first reports
        self.requests: dict[str, Tracked] = {}
        self.resumed = 0  # requests resubmitted to a survivor, since start
        self._seeds = random.Random()

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.num_ranks) if r not in self.lost]

    def params_of(self, params: SamplingParams) -> SamplingParams:
        """A request's settings with a seed of the front end's where it has none: its draws then
        depend on nothing a lost rank takes with it."""
        return params if params.seed is not None else dataclasses.replace(params, seed=self._seeds.getrandbits(63))

    def track(self, rid: str, prompt_ids: list[int], params: SamplingParams, disaggregation, rank: int) -> None:
        self.requests[rid] = Tracked(list(prompt_ids), params, disaggregation, rank)

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def accepts(self, rank: int, update: TokenUpdate) -> bool:
        """Whether an update from `rank` is the request's (not a late one of a lost rank it moved
        off); notes its tokens."""
        req = self.requests.get(update.request_id)
        if req is None:
            return True
        if req.rank != rank:
            return False
        req.tokens += update.token_ids
        req.prompt_logprobs_sent |= update.prompt_logprobs is not None
        if update.finish_reason is not None:
            del self.requests[update.request_id]
        return True

    def newly_lost(self) -> list[int]:
        """Attention ranks found lost since the last call (never the last one left: with none, the
        deployment is down)."""
        new = sorted(self.lost_ranks() - self.lost)
        self.lost.update(new)
        return new

    def moves(self, ranks: list[int]) -> list[tuple[str, Tracked]]:
        """The unfinished requests of lost `ranks`."""
        gone = set(ranks)
        return [(rid, req) for rid, req in self.requests.items() if req.rank in gone]

    def resubmission(self, rid: str, req: Tracked, rank: int) -> msgs.AddRequest | TokenUpdate:
        """What resumes request `rid` on `rank`: its AddRequest, or, where it cannot resume there,
        the update that ends it with an error."""
        if req.disaggregation is not None:
            del self.requests[rid]
            why = "its attention rank was lost, and a disaggregated request cannot resume on another rank of it"
            return TokenUpdate(rid, [], None, "error", why)
        params = req.params
        if req.prompt_logprobs_sent and params.prompt_logprobs is not None:  # the consumer has them
            params = dataclasses.replace(params, prompt_logprobs=None)
        req.rank = rank
        self.resumed += 1
        resume = {"resume": list(req.tokens)} if req.tokens else None
        return msgs.AddRequest(rid, req.prompt_ids, params, resume)


def without_lost_rank(stats: msgs.EngineStats) -> msgs.EngineStats:
    """A lost rank's last counters, its gauges emptied: its pages and requests are gone (its
    totals since start still count in the deployment's)."""
    return msgspec.structs.replace(
        stats,
        running=0,
        waiting=0,
        kv_pages_used=0,
        kv_pages_total=0,
        cache_pages=0,
        kv_pages_reserved=0,
        expert_rank_load=(),
    )
