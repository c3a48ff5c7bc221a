"""A rank's KV pool of pages and its prefix cache of blocks, keyed by the trace's block ids.

Pages are counted, not placed: a request holds `held` cached blocks (shared, locked while it runs)
and `priv` private tokens of its own; computed full blocks move into the cache as it goes, and
unlocked leaves are evicted least recently used first when a request needs pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from afd_engine.planner.sim.cluster import InstanceConfig
from afd_engine.planner.sim.request import Block, Request


class RankCache:
    """The KV pages and prefix cache of rank `lid` of a router's domain; `seq` is the simulation's
    counter, which stamps how recently a block was used."""

    def __init__(self, lid: int, cfg: InstanceConfig, block_tokens: int, seq: Iterator[int]) -> None:
        self.lid, self.seq = lid, seq
        self.P, self.B = cfg.page_tokens, block_tokens
        self.bp = -(-self.B // self.P)  # pages of one cached block
        self.capacity, self.used, self.evictable = cfg.kv_pages, 0, 0
        self.caching = cfg.prefix_cache
        self.cache: dict[object, Block] = {}
        self.heap: list = []  # (stamp, seq, key): eviction candidates, checked when popped
        self.evicted = 0

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
            freed += bp
            if b.parent is not None:
                p = cache[b.parent]
                p.children -= 1
                if not p.children and not p.ref:
                    heapq.heappush(heap, (p.stamp, next(self.seq), b.parent))
        self.used -= freed
        self.evictable -= freed
        self.evicted += freed

    def _match(self, req: Request, limit: int) -> int:
        """Blocks of req's longest cached prefix, at most `limit`."""
        cache, n = self.cache, 0
        while n < limit and req.key(n) in cache:
            n += 1
        return n

    def _lock(self, req: Request, limit: int) -> int:
        """Locks req's longest cached prefix (at most `limit` blocks) and returns its length."""
        if not self.caching:
            return 0
        cache, n, stamp = self.cache, 0, next(self.seq)
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

    def _unlock(self, req: Request, blocks: int) -> None:
        cache, bp = self.cache, self.bp
        for n in range(blocks):
            key = req.key(n)
            b = cache[key]
            b.ref -= 1
            if not b.ref:
                self.evictable += bp
                if not b.children:
                    heapq.heappush(self.heap, (b.stamp, next(self.seq), key))

    def _insert(self, req: Request, upto: int) -> None:
        """Moves req's computed full blocks up to block `upto` into the cache, locked by req (a
        block the cache holds already is shared and req's copy freed)."""
        if not self.caching or upto <= req.held:
            return
        cache, bp, stamp, B, P = self.cache, self.bp, next(self.seq), self.B, self.P
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
                cache[key] = Block(stamp, parent)
                self.used += bp
                if parent is not None:
                    cache[parent].children += 1
            parent = key
        old = -(-req.priv // P)
        req.priv -= (upto - req.held) * B
        self.used += -(-req.priv // P) - old
        req.held = upto

    def _release(self, req: Request, kv: int) -> None:
        """req leaves this rank with `kv` tokens computed: its full blocks stay cached, unlocked;
        its other pages are freed."""
        self._insert(req, kv // self.B)
        self._unlock(req, req.held)
        self.used -= -(-req.priv // self.P)
        req.held = req.priv = 0
