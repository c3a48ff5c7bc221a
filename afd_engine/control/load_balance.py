"""Which attention rank takes a request (`--load-balance-method`).

Every policy sees the same load: the requests the front end routed to a rank and that have not
finished yet (finished, rejected or aborted). The front end knows it exactly and at once, unlike
the ranks' stats, which arrive with their next step.

- round_robin: ranks in turn.
- shortest_queue: the least loaded rank; ties go to the lowest index.
- cache_aware: the rank most likely to hold the prompt's prefix in its prefix cache, unless it is
  much busier than the least loaded rank. The router keeps, per rank, an approximate record of
  the prompts it sent there, cut into blocks of `block_size` tokens (the KV page size: the engine
  caches whole pages only). A block is named by a chained hash of the whole prefix up to its end,
  so looking blocks up one after another walks a trie without building one:

      prompt  [t0 .. t15][t16 .. t31][t32 .. t40]      block_size 16; the partial block is ignored
      blocks   h0 = H(root, t0..t15)   h1 = H(h0, t16..t31)

  The record is bounded (least recently used blocks go first) and never told what a rank
  evicted, so it can claim a prefix the rank no longer holds: a wrong guess costs one prefill.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from afd_engine.errors import ConfigError

# A rank with the longest match still yields to the least loaded rank when it has more than
# BALANCE_ABS_THRESHOLD requests more AND more than BALANCE_REL_THRESHOLD times as many. A few
# extra requests cost a rank little (a decode step's time barely grows with its batch), while a
# prefix hit saves a whole prefill of the prefix; 32 extra requests are a batch that visibly slows
# every step. The relative bound keeps affinity under heavy load, where 32 more on top of hundreds
# changes little: the busy rank must also carry half as much again as the idle one.
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.5
# Blocks remembered per rank: 1 << 16 blocks of 16 tokens are 1M tokens, more than a rank's KV
# pool usually holds, so a longer record would mostly name prefixes the rank has evicted. About
# 100 bytes per entry: some 7 MB per rank.
MAX_BLOCKS_PER_RANK = 1 << 16


class LoadBalancer(ABC):
    """Routes requests to `num_ranks` ranks and counts each rank's unfinished requests."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.load = [0] * num_ranks  # unfinished requests per rank
        self._rank_of: dict[str, int] = {}

    @staticmethod
    def of(method: str, num_ranks: int, block_size: int) -> LoadBalancer:
        """The router of `--load-balance-method`; `block_size` is the KV page size in tokens."""
        if method == "cache_aware":
            return CacheAwareBalancer(num_ranks, block_size)
        if method == "shortest_queue":
            return ShortestQueueBalancer(num_ranks)
        if method == "round_robin":
            return RoundRobinBalancer(num_ranks)
        raise ConfigError(f"--load-balance-method={method!r}: use cache_aware, shortest_queue or round_robin")

    def route(self, rid: str, prompt_ids: Sequence[int]) -> int:
        """The rank that takes request `rid`; it counts there until `finished(rid)`."""
        self.finished(rid)  # an id routed again counts once
        rank = self._choose(prompt_ids)
        self._rank_of[rid] = rank
        self.load[rank] += 1
        return rank

    def route_to(self, rid: str, rank: int) -> int:
        """Routes `rid` to a rank chosen elsewhere (a prefill instance's rank follows the room)."""
        self.finished(rid)
        self._rank_of[rid] = rank
        self.load[rank] += 1
        return rank

    def finished(self, rid: str) -> None:
        """The request finished, was rejected or was aborted; an unknown id is ignored."""
        rank = self._rank_of.pop(rid, None)
        if rank is not None:
            self.load[rank] -= 1

    def rank_of(self, rid: str) -> int | None:
        """The rank of an unfinished request."""
        return self._rank_of.get(rid)

    def least_loaded(self) -> int:
        return min(range(self.num_ranks), key=self.load.__getitem__)  # min keeps the first of equals

    @abstractmethod
    def _choose(self, prompt_ids: Sequence[int]) -> int: ...


class RoundRobinBalancer(LoadBalancer):
    def __init__(self, num_ranks: int) -> None:
        super().__init__(num_ranks)
        self._next = 0

    def _choose(self, prompt_ids: Sequence[int]) -> int:
        rank, self._next = self._next, (self._next + 1) % self.num_ranks
        return rank


class ShortestQueueBalancer(LoadBalancer):
    def _choose(self, prompt_ids: Sequence[int]) -> int:
        return self.least_loaded()


class CacheAwareBalancer(LoadBalancer):
    def __init__(self, num_ranks: int, block_size: int, max_blocks: int = MAX_BLOCKS_PER_RANK) -> None:
        super().__init__(num_ranks)
        self.block_size, self.max_blocks = block_size, max_blocks
        # per rank: block hash -> None, least recently used first
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]

    def _choose(self, prompt_ids: Sequence[int]) -> int:
        hashes = self.block_hashes(prompt_ids)
        matched = [self.matched_blocks(r, hashes) for r in range(self.num_ranks)]
        # the longest match; among equal matches the least loaded, then the lowest index (when
        # nothing matches, that is the least loaded rank)
        best = min(range(self.num_ranks), key=lambda r: (-matched[r], self.load[r]))
        idle = self.least_loaded()
        rank = idle if self._overloaded(best, idle) else best
        self._remember(rank, hashes)
        return rank

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """One chained hash per full block of the prompt."""
        hashes, h, bs = [], 0, self.block_size
        for end in range(bs, len(prompt_ids) + 1, bs):
            h = hash((h, tuple(prompt_ids[end - bs : end])))
            hashes.append(h)
        return hashes

    def matched_blocks(self, rank: int, hashes: list[int]) -> int:
        """How many leading blocks of the prompt `rank` was sent (as far as the record knows)."""
        seen, n = self.blocks[rank], 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def _overloaded(self, rank: int, idle: int) -> bool:
        busy, least = self.load[rank], self.load[idle]
        return busy - least > BALANCE_ABS_THRESHOLD and busy > least * BALANCE_REL_THRESHOLD

    def _remember(self, rank: int, hashes: list[int]) -> None:
        seen = self.blocks[rank]
        # last block first: a prompt's first block ends up the most recently used, so eviction
        # trims prefixes from their ends, as the engine's cache does, and never orphans a tail
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
