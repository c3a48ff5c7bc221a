"""Routing requests among the ranks of one role, as the engine's router does (control/load_balance.py).

Like the engine's, the cache-aware router matches a prompt against a record of the prompts it sent
to each rank, kept from the moment it routes them (bounded, least recently used blocks first) and
never told what a rank evicted; not against what the ranks' caches hold. The difference shows in
bursts: the requests of a burst that share a first block all follow the first one to its rank,
before any of them is prefilled.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from afd_engine.control.load_balance import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, MAX_BLOCKS_PER_RANK
from afd_engine.planner.sim.request import Request

R = TypeVar("R")  # a rank (generic so that the router needs nothing of the rank's module)


class Domain(Generic[R]):
    """Ranks a router chooses among (one per role): their loads and which hold which block."""

    def __init__(self, method: str, max_blocks: int = MAX_BLOCKS_PER_RANK) -> None:
        self.method = method
        self.ranks: list[R] = []
        self.load: list[int] = []  # routed, unfinished requests per rank
        self.index: dict[object, set[int]] = {}  # trace block id -> ranks it was sent to (the record)
        self.sent: list[OrderedDict] = []  # per rank: the record's blocks, least recently used first
        self.max_blocks = max_blocks
        self.turn = 0

    def add(self, rank: R) -> None:
        """Adds a rank (its index in the domain: the ranks before it)."""
        self.ranks.append(rank)
        self.load.append(0)
        self.sent.append(OrderedDict())

    def route(self, req: Request, limit: int) -> R:
        """cache_aware: the rank the longest prefix of req was sent to (least loaded among equals),
        unless it is much busier than the least loaded rank (control/load_balance.py's thresholds);
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
        self._remember(best, keys)
        return self.ranks[best]

    def _remember(self, rank: int, keys) -> None:
        """Records that the blocks `keys` were sent to `rank` (the first block the most recently
        used, as the engine's router keeps it), dropping its least recently used beyond the bound."""
        seen, index = self.sent[rank], self.index
        for key in reversed(keys):
            if key in seen:
                seen.move_to_end(key)
            else:
                seen[key] = None
                holders = index.get(key)
                if holders is None:
                    index[key] = {rank}
                else:
                    holders.add(rank)
        while len(seen) > self.max_blocks:
            key, _ = seen.popitem(last=False)
            holders = index[key]
            holders.discard(rank)
            if not holders:
                del index[key]
