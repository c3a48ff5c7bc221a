"""The prefix cache: the radix tree's bookkeeping on its own, then the engine reusing cached prefixes
(tokens equal transformers', cached-token counts exact, no page lost under aborts and eviction)."""

from __future__ import annotations

import random

import pytest
import torch

from afd_engine import Engine, SamplingParams
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.radix_cache import RadixCache
from afd_engine.runtime.request import Request
from afd_engine.runtime.scheduler import LPM_MAX_WAIT_ROUNDS, Scheduler
from tests.engine_helpers import prefix_sharing_rounds
from tests.hf_reference import assert_greedy_matches, hf_greedy

PS = 4  # page size of the bookkeeping tests


def pool(num_pages: int = 16) -> KVPool:
    return KVPool(1, 1, num_pages, PS, max_seqs=8, max_pages_per_seq=16, dtype=torch.float32)


def request(ids: list[int], rid: str = "r") -> Request:
    return Request(rid, list(ids), SamplingParams(), seed=0)


def run(cache: RadixCache, req: Request) -> None:
    """Admits req with its cached prefix and computes all its tokens, as the scheduler would."""
    prefix = cache.acquire(req)
    req.row = cache.pool.open_row(prefix)
    req.num_cached = len(prefix) * PS
    assert cache.pool.grow(req.row, req.total_len)
    req.num_cached = req.total_len


def check_pages(cache: RadixCache) -> None:
    """Every used page is the tree's or exactly one row's own; rows start with tree pages only."""
    tree = cache.pages()
    assert len(tree) == len(set(tree)) == cache.num_pages
    own = []
    for pages in cache.pool.row_pages().values():
        shared = [p for p in pages if p in set(tree)]
        assert pages[: len(shared)] == shared, "a row's tree pages come first"
        own += pages[len(shared) :]
    assert len(own) == len(set(own)) and not set(own) & set(tree)
    assert cache.pool.used_pages == len(tree) + len(own)


def matched(cache: RadixCache, ids) -> int:
    """Pages a request of these tokens would start from."""
    req = request(ids)
    n = len(cache.acquire(req))
    cache.release(req)
    return n


def test_a_request_reuses_the_whole_pages_of_a_cached_prefix():
    cache = RadixCache(pool())
    first = request(range(10))
    run(cache, first)
    cache.cache(first)
    assert cache.num_pages == 2 and cache.evictable_pages == 0  # 10 tokens: 2 full pages, locked
    cache.release(first)
    assert cache.evictable_pages == 2 and cache.pool.used_pages == 2  # the partial page went back
    assert matched(cache, [*range(9), 99]) == 2  # shares 9 tokens: the 2 whole pages
    assert matched(cache, range(8)) == 1  # all cached, but its last token must be computed
    assert matched(cache, [0, 1, 2, 7, 8]) == 0
    check_pages(cache)


def test_pages_computed_twice_are_shared_and_the_copy_freed():
    cache = RadixCache(pool())
    a, b = request(range(8), "a"), request([*range(8), 50, 51, 52, 53], "b")
    run(cache, a)
    run(cache, b)  # admitted together: both computed tokens 0..7 on their own pages
    assert cache.pool.used_pages == 5
    cache.cache(a)
    cache.cache(b)
    assert cache.num_pages == 3 and cache.pool.used_pages == 3
    rows = cache.pool.row_pages()
    assert rows[b.row][:2] == rows[a.row][:2]  # b now reads a's copy
    check_pages(cache)
    cache.release(a)
    assert cache.evictable_pages == 0  # b still holds the shared pages
    cache.release(b)
    assert cache.evictable_pages == 3
    check_pages(cache)


def test_eviction_takes_least_recently_used_unlocked_leaves():
    cache = RadixCache(pool())
    old, new, held = request(range(8), "old"), request(range(100, 108), "new"), request(range(200, 209), "held")
    for req in (old, new):
        run(cache, req)
        cache.release(req)
    run(cache, held)
    cache.cache(held)
    assert matched(cache, [*range(8), 1]) == 2  # touches "old": now "new" is the least recent
    assert cache.evict(1) == 1
    assert matched(cache, range(100, 109)) == 1  # its leaf went first
    assert cache.evict(100) == 3  # everything but the locked pages
    assert cache.num_pages == 2 and matched(cache, range(200, 210)) == 2
    assert cache.evicted_pages == 4
    check_pages(cache)


def test_disabled_cache_keeps_nothing():
    cache = RadixCache(pool(), enabled=False)
    req = request(range(10))
    run(cache, req)
    cache.release(req)
    assert cache.num_pages == 0 and cache.pool.used_pages == 0 and matched(cache, range(10)) == 0


def test_lpm_admits_cache_hits_first_but_not_past_requests_that_waited_long():
    p = pool(64)
    cache = RadixCache(p)
    warm = request(range(12), "warm")
    run(cache, warm)
    cache.release(warm)
    sched = Scheduler(p, max_batch_tokens=13, max_running=8, context_len=64, cache=cache, policy="lpm")
    cold, hit = request(range(50, 62), "cold"), request([*range(12), 7], "hit")
    sched.add(cold)
    sched.add(hit)
    plan = sched.schedule()
    assert [(r.rid, n) for r, n in plan.extend] == [("hit", 1), ("cold", 12)]  # 12 of hit's 13 were cached
    assert hit.num_cached_tokens == 12 and cold.num_cached_tokens == 0

    fcfs = Scheduler(pool(64), max_batch_tokens=64, max_running=1, context_len=64, cache=RadixCache(pool(64)))
    fcfs.policy = "fcfs"
    fcfs.add(request(range(5), "first"))
    fcfs.add(request(range(50, 55), "second"))
    assert [r.rid for r, _ in fcfs.schedule().extend] == ["first"]

    sched = Scheduler(p, max_batch_tokens=64, max_running=1, context_len=64, cache=cache, policy="lpm")
    patient = request(range(50, 62), "patient")
    sched.add(patient)
    sched.round += LPM_MAX_WAIT_ROUNDS  # it has waited that long
    sched.add(request([*range(12), 9], "hit2"))
    assert [r.rid for r, _ in sched.schedule().extend] == ["patient"]


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
# page size 8: (prompt, cached tokens) per round, see prefix_sharing_rounds
EXPECTED_CACHED = [0, 0, 0, 0] + [24, 32, 24, 16] + [40, 16, 32, 48]


def check_against_transformers(path, results) -> None:
    for ids, out, _ in results:
        assert_greedy_matches(out, *hf_greedy(path, ids, GREEDY.max_new_tokens), f"prompt of {len(ids)} tokens")


def test_cached_prefixes_give_transformers_tokens(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1, page_size=8) as engine:
        results = prefix_sharing_rounds(engine, engine.config.vocab_size, GREEDY)
        assert [c for _, _, c in results] == EXPECTED_CACHED
        assert engine.scheduler.cache_hit_tokens == sum(EXPECTED_CACHED)
        assert engine.pool.used_pages == engine.cache.num_pages > 0
    check_against_transformers(tiny_v3, results)
    with Engine(model_path=tiny_v3, num_threads=1, page_size=8, disable_radix_cache=True) as engine:
        uncached = prefix_sharing_rounds(engine, engine.config.vocab_size, GREEDY)
        assert engine.pool.used_pages == 0
    assert [c for _, _, c in uncached] == [0] * len(results)
    assert [out for _, out, _ in uncached] == [out for _, out, _ in results]


def test_cached_prefixes_under_eviction_and_preemption(tiny_v3):
    # 11 pages of 8 tokens: the longest request (48 + 8 tokens) fits alone, a round does not
    with Engine(model_path=tiny_v3, num_threads=1, page_size=8, max_total_tokens=88) as engine:
        results = prefix_sharing_rounds(engine, engine.config.vocab_size, GREEDY)
        assert engine.cache.evicted_pages > 0 and engine.scheduler.num_preemptions > 0
        assert engine.pool.used_pages == engine.cache.num_pages
        check_pages(engine.cache)
    assert sum(c for _, _, c in results) > 0
    check_against_transformers(tiny_v3, results)


@pytest.mark.parametrize("disable", [False, True], ids=["cache", "no-cache"])
def test_random_aborts_lose_no_page(tiny_v3, disable):
    rng = random.Random(5)
    bases = [[rng.randrange(5, 100) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    flags = dict(page_size=4, max_total_tokens=160, max_num_batched_tokens=48, disable_radix_cache=disable)
    with Engine(model_path=tiny_v3, num_threads=1, **flags) as engine:
        added, live = 0, []
        while added < 200 or engine.has_unfinished():
            for _ in range(rng.randrange(0, 4) if added < 200 else 0):
                ids = rng.choice(bases)[: rng.randrange(1, 41)] + [rng.randrange(5, 100)]
                params = SamplingParams(max_new_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True)
                live.append(engine.add_request(prompt_token_ids=ids, params=params))
                added += 1
            if live and rng.random() < 0.3:
                engine.abort(live.pop(rng.randrange(len(live))))
            done = {o.request_id for o in engine.step()}
            live = [rid for rid in live if rid not in done]
            check_pages(engine.cache)
        assert engine.pool.used_pages == engine.cache.num_pages == (0 if disable else len(engine.cache.pages()))
        assert engine.cache.evictable_pages == engine.cache.num_pages  # nothing left locked
        if not disable:
            assert engine.scheduler.cache_hit_tokens > 0 and engine.cache.evicted_pages > 0
