"""The routers' exact choices, and a deployment whose requests land where its policy says."""

from __future__ import annotations

import math

import pytest

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.control.load_balance import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CacheAwareBalancer,
    LoadBalancer,
)
from afd_engine.errors import ConfigError, InvalidRequestError

PREFIX = list(range(10, 26))  # four blocks of 4


def routes(router: LoadBalancer, prompts: list[list[int]], tag: str = "r") -> list[int]:
    return [router.route(f"{tag}{i}", ids) for i, ids in enumerate(prompts)]


def first_overloaded(least: int) -> int:
    """The smallest load at which a rank yields to a rank carrying `least`."""
    return max(least + BALANCE_ABS_THRESHOLD + 1, math.floor(least * BALANCE_REL_THRESHOLD) + 1)


def test_round_robin_cycles_the_ranks_whatever_their_load():
    router = LoadBalancer.of("round_robin", 3, block_size=4)
    assert routes(router, [[1]] * 4) == [0, 1, 2, 0]
    router.finished("r1")
    router.finished("r2")
    assert routes(router, [[1]] * 3, tag="s") == [1, 2, 0]
    assert router.load == [3, 1, 1]


def test_shortest_queue_follows_finished_requests():
    router = LoadBalancer.of("shortest_queue", 3, block_size=4)
    assert routes(router, [[1]] * 4) == [0, 1, 2, 0]  # ties go to the lowest rank
    router.finished("r1")
    router.finished("unknown")  # ignored
    assert router.route("a", [1]) == 1
    for rid in ("r0", "r3", "r2"):
        router.finished(rid)
    assert router.load == [0, 1, 0]
    assert routes(router, [[1]] * 3, tag="b") == [0, 2, 0]


def test_an_unknown_method_names_the_flag():
    with pytest.raises(ConfigError, match="--load-balance-method"):
        LoadBalancer.of("random", 2, block_size=4)


def test_block_hashes_chain_over_the_whole_prefix():
    router = CacheAwareBalancer(2, block_size=4)
    a = router.block_hashes(PREFIX + [1, 2, 3])
    assert len(a) == 4  # the partial last block is not a block
    assert router.block_hashes(PREFIX[:8] + [0] * 8)[:2] == a[:2]
    other = router.block_hashes([0] + PREFIX[1:])  # one token differs in the first block
    assert set(other).isdisjoint(a)


def test_cache_aware_sends_a_shared_prefix_to_the_rank_that_saw_it():
    router = LoadBalancer.of("cache_aware", 3, block_size=4)
    assert router.route("a", PREFIX + [1]) == 0  # nothing matched: the least loaded, lowest first
    assert router.route("b", [7] * 12) == 1  # unmatched: the least loaded
    assert router.route("c", PREFIX + [2, 3]) == 0  # four blocks matched, though rank 0 is busier
    assert router.route("d", [7] * 8 + [9] * 4) == 1  # two blocks matched
    assert router.route("e", PREFIX[:3] + [5]) == 2  # less than a block shared: unmatched
    assert router.route("f", [9] + PREFIX[1:]) == 2  # same later blocks, another first one: unmatched
    assert router.load == [2, 2, 2]
    router.finished("b")
    router.finished("d")  # rank 1's requests are gone, its record is not
    assert routes(router, [[1], [2]], tag="s") == [1, 1]  # shorter than a block: the least loaded
    assert router.route("g", [7] * 8) == 1  # all loads equal: unmatched would go to rank 0


def test_cache_aware_yields_to_the_least_loaded_beyond_the_absolute_threshold():
    router = LoadBalancer.of("cache_aware", 2, block_size=4)
    n = first_overloaded(0)  # rank 1 stays idle: the absolute margin decides
    assert n == BALANCE_ABS_THRESHOLD + 1
    assert routes(router, [PREFIX + [i] for i in range(n + 1)]) == [0] * n + [1]
    assert router.load == [n, 1]


def test_cache_aware_prefers_the_longest_match_then_the_least_loaded():
    router = LoadBalancer.of("cache_aware", 2, block_size=4)
    n = first_overloaded(0)
    assert routes(router, [PREFIX] * n) == [0] * n
    assert router.route("half", PREFIX[:8]) == 1  # rank 0 is overloaded
    # rank 0 matches four blocks, rank 1 two: the longest match, while rank 0 is within the margin
    assert router.load == [n, 1] and router.route("full", PREFIX) == 0
    for i in range(10):
        router.finished(f"r{i}")
    # both match two blocks and rank 0 is within the margin: the less loaded of them
    assert router.load == [n - 9, 1] and router.route("two", PREFIX[:8] + [1]) == 1


def test_cache_aware_keeps_affinity_within_the_relative_threshold():
    router = LoadBalancer.of("cache_aware", 2, block_size=4)
    assert router.route("p", PREFIX) == 0
    assert routes(router, [[i] for i in range(199)], tag="short") == [1, 0] * 99 + [1]  # unmatched
    assert router.load == [100, 100]
    n = first_overloaded(100) - 100  # far past the absolute margin before the relative one is passed
    assert n > BALANCE_ABS_THRESHOLD + 1
    assert routes(router, [PREFIX + [i] for i in range(n + 1)]) == [0] * n + [1]


def test_the_record_is_bounded_and_evicts_the_least_recently_used_blocks():
    router = CacheAwareBalancer(1, block_size=2, max_blocks=5)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    routes(router, [a, b, a, c])  # a again: its blocks are the most recent but for c's
    assert [router.matched_blocks(0, router.block_hashes(p)) for p in (a, b, c)] == [2, 1, 2]
    router.route("d", [13, 14, 15, 16])  # b's first block, then a's tail
    # a prompt's tail goes before its head: what is left is still a prefix
    assert [router.matched_blocks(0, router.block_hashes(p)) for p in (a, b, c)] == [1, 0, 2]
    assert len(router.blocks[0]) == 5


NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def run_all(engine, prompts: list[list[int]], monkeypatch) -> tuple[list[int | None], list[set[int]], list[list[int]]]:
    """Submits every prompt at once; returns per prompt the rank the router chose, the ranks whose
    outputs carried its updates, and its tokens."""
    served: dict[str, set[int]] = {}
    absorb = engine.client._absorb

    def spy(msg):
        for u in getattr(msg, "updates", []):
            served.setdefault(u.request_id, set()).add(msg.rank)
        return absorb(msg)

    monkeypatch.setattr(engine.client, "_absorb", spy)
    rids = [engine.add_request(prompt_token_ids=ids, params=GREEDY) for ids in prompts]
    routed = [engine.router.rank_of(rid) for rid in rids]
    with pytest.raises(InvalidRequestError, match="already in use"):  # would count twice, maybe elsewhere
        engine.add_request(prompt_token_ids=prompts[0], params=GREEDY, request_id=rids[0])
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            done[out.request_id] = out.token_ids
    return routed, [served[rid] for rid in rids], [done[rid] for rid in rids]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, ranks", [("cache_aware", [0, 0, 1]), ("round_robin", [0, 1, 0])])
def test_a_deployment_routes_by_its_policy(tiny_v3, method, ranks, monkeypatch):
    shared = list(range(5, 29))  # six pages of 4 tokens
    prompts = [shared + [40], shared + [41, 42], [60, 61, 62, 63, 64]]
    with Engine(model_path=tiny_v3, num_threads=1, page_size=4) as single:
        expected = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    with make_engine(
        model_path=tiny_v3,
        mode="colocated",
        dp_size=2,
        page_size=4,
        comm_timeout=30,
        dispatch_dtype="fp32",
        load_balance_method=method,
    ) as engine:
        routed, served, tokens = run_all(engine, prompts, monkeypatch)
        assert engine.router.load == [0, 0]
    assert routed == ranks
    assert served == [{r} for r in ranks]
    assert tokens == expected
