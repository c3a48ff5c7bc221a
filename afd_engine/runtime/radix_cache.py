"""The prefix cache: a radix tree of token ids over the paged KV pool, one node per full page.

A node's key is the `page_size` token ids of one page and its value the pool page holding their
latents; the path from the root spells a token prefix. A request starts from the longest cached
prefix of its tokens (whole pages only, and never all of them: the last token is always computed
so that it has logits to sample from) and prefills the rest.

Pages move between two owners: a request's private pages (listed in its page-table row after its
cached prefix) and the tree's pages (immutable: full, and never written again). When a request
caches its pages (after each prefill chunk and when it ends), its full private pages become tree
nodes; a page whose tokens the tree already holds is swapped for the tree's copy and freed.

Reference counts: a request holds a lock on its deepest tree node, which counts on that node and
every ancestor. Only unlocked leaves are evicted, least recently used first, when the pool needs
pages. With the cache disabled nothing is ever inserted and every page is private.
"""

from __future__ import annotations

import heapq
import itertools

from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.request import Request


class Node:
    __slots__ = ("key", "page", "parent", "children", "depth", "ref", "last_used")

    def __init__(self, key: tuple[int, ...] | None, page: int, parent: Node | None) -> None:
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root
        self.ref = 0  # requests whose locked node is this one or a descendant
        self.last_used = 0

    def __lt__(self, other: Node) -> bool:  # heap order on ties of last_used
        return self.page < other.page


class RadixCache:
    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        self.pool, self.enabled = pool, enabled
        self.page_size = pool.page_size
        self.root = Node(None, -1, None)
        self.num_pages = 0  # pages held by the tree
        self.evictable_pages = 0  # tree pages no request locks
        self.evicted_pages = 0  # since start
        self._leaves: set[Node] = set()  # unlocked nodes without children: the eviction candidates
        self._clock = itertools.count(1)

    # -- lookup --------------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> tuple[Node, list[int]]:
        """The deepest node spelling a prefix of tokens[:limit] in whole pages, and its pages."""
        node, pages, ps = self.root, [], self.page_size
        if not self.enabled:
            return node, pages
        for start in range(0, limit - ps + 1, ps):
            child = node.children.get(tuple(tokens[start : start + ps]))
            if child is None:
                break
            node = child
            pages.append(node.page)
        return node, pages

    def prefix_len(self, req: Request) -> int:
        """Tokens of req that admitting it now would take from the cache."""
        return len(self.match(req.tokens(0, req.total_len), req.cacheable_len())[1]) * self.page_size

    # -- a request's life ----------------------------------------------------------------------

    def acquire(self, req: Request) -> list[int]:
        """Locks req's longest cached prefix (up to req.cacheable_len() tokens) as req.prefix and
        returns that prefix's pages; the caller opens req's row with them."""
        node, pages = self.match(req.tokens(0, req.total_len), req.cacheable_len())
        self._touch(node)
        self._lock(node)
        req.prefix = node
        return pages

    def cache(self, req: Request) -> None:
        """Moves req's computed full pages into the tree; req keeps them locked."""
        if not self.enabled:
            return
        ps, node, row = self.page_size, req.prefix, req.row
        full = min(req.num_cached, req.known_len) // ps  # (a token under way has no value yet)
        if full <= node.depth:
            return
        base = node.depth
        tokens = req.tokens(base * ps, full * ps)
        for i in range(base, full):
            key = tuple(tokens[(i - base) * ps : (i - base + 1) * ps])
            child = node.children.get(key)
            if child is not None:  # the tree computed these tokens already: share its page
                self.pool.replace_page(row, i, child.page)
            else:
                child = Node(key, self.pool.page_of(row, i), node)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.num_pages += 1
                self.evictable_pages += 1
            node = child
        self._touch(node)
        self._lock(node)
        self._unlock(req.prefix)
        req.prefix = node

    def release(self, req: Request) -> None:
        """req leaves the running batch (finished, aborted or preempted), or was not admitted after
        all: its computed pages stay in the tree, unlocked; its other pages and its row go back."""
        if req.row is not None:
            self.cache(req)
            self.pool.release(req.row, keep=req.prefix.depth)
        self._unlock(req.prefix)
        req.row, req.prefix = None, None

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.page)
            stack.extend(node.children.values())
        return out

    # -- memory --------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Frees up to num_pages unlocked pages, least recently used leaves first; returns how many."""
        heap = [(n.last_used, n) for n in self._leaves]
        heapq.heapify(heap)
        freed = []
        while heap and len(freed) < num_pages:
            _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self._leaves.discard(node)
            freed.append(node.page)
            if parent is not self.root and parent.ref == 0 and not parent.children:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_used, parent))
        self.pool.free(freed)
        self.num_pages -= len(freed)
        self.evictable_pages -= len(freed)
        self.evicted_pages += len(freed)
        return len(freed)

    def _touch(self, node: Node) -> None:
        now = next(self._clock)
        while node is not self.root:
            node.last_used = now
            node = node.parent

    def _lock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref == 0:
                self.evictable_pages -= 1
                self._leaves.discard(node)
            node.ref += 1
            node = node.parent

    def _unlock(self, node: Node) -> None:
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.evictable_pages += 1
                if not node.children:
                    self._leaves.add(node)
            node = node.parent
