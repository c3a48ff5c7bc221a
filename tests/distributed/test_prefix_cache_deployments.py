"""Prefix-cache hits in colocated and AFD deployments: the same tokens as transformers, with a KV
pool small enough on each attention rank to force eviction and preemption."""

from __future__ import annotations

import pytest

from afd_engine import Engine, SamplingParams, make_engine
from tests.engine_helpers import prefix_sharing_rounds
from tests.hf_reference import assert_greedy_matches, hf_greedy

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SMALL_POOL = dict(page_size=8, max_total_tokens=88)  # 11 pages per attention rank

DEPLOYMENTS = {
    "colocated dp2 mb2": dict(mode="colocated", dp_size=2, micro_batches=2),
    "afd 1A 1x1 mb1 two-stage": dict(mode="afd", dp_size=1, micro_batches=1),
    "afd 2A 2x1 mb3 two-stage chunked": dict(mode="afd", dp_size=2, ffn_nodes=2, max_num_batched_tokens=20),
}


@pytest.fixture(scope="module")
def single(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1, **SMALL_POOL) as engine:
        vocab = engine.config.vocab_size
        results = prefix_sharing_rounds(engine, vocab, GREEDY)
    for ids, out, _ in results:
        assert_greedy_matches(out, *hf_greedy(tiny_v3, ids, GREEDY.max_new_tokens), f"prompt of {len(ids)} tokens")
    return vocab, results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_cache_hits_in_deployments_give_the_single_engines_tokens(name, tiny_v3, single):
    flags = {**SMALL_POOL, **DEPLOYMENTS[name]}
    with make_engine(model_path=tiny_v3, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        results = prefix_sharing_rounds(engine, single[0], GREEDY)
    assert [(ids, out) for ids, out, _ in results] == [(ids, out) for ids, out, _ in single[1]], name
    assert sum(cached for _, _, cached in results) > 0, "no request was served from the prefix cache"
