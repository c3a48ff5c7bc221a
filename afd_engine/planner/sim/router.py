"""Routing requests among the ranks of one role, as the engine's router does (control/load_balance.py)."""

from __future__ import annotations

from typing import Generic, TypeVar

from afd_engine.control.load_balance import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD
from afd_engine.planner.sim.request import Request

R = TypeVar("R")  # a rank (generic so that the router needs nothing of the rank's module)


class Domain(Generic[R]):
    """Ranks a router chooses among (one per role): their loads and which hold which block."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.ranks: list[R] = []
        self.load: list[int] = []  # routed, unfinished requests per rank
        self.index: dict[object, set[int]] = {}  # trace block id -> ranks whose cache holds it
        self.turn = 0

    def route(self, req: Request, limit: int) -> R:
        """cache_aware: the rank with the longest cached prefix of req (least loaded among equals),
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
        return self.ranks[best]
