"""DeepSeek-V3.2 (sparse attention), GLM-4.5 and MiniMax-M2 in every deployment: colocated dp2, AFD
2A + 2x2 (three micro-batches, two-stage dispatch) and PD with the builtin transfer. Requests join
while others decode, prompts prefill in chunks, and later rounds hit a warm prefix cache; every
token equals the single engine's, whose tokens equal transformers'."""

from __future__ import annotations

import functools

import pytest

from afd_engine import Engine, SamplingParams, make_engine
from tests.disagg.pd_helpers import COMMON, PDPair, idle_pages
from tests.engine_helpers import prefix_sharing_rounds, run_staggered, staggered_reference
from tests.hf_reference import assert_greedy_matches, hf_greedy

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 40, 17, 70, 33, 9, 150]
CHUNKED = dict(max_num_batched_tokens=32)  # the 40- to 150-token prompts prefill in pieces
FAMILIES = ("v32-sparse", "glm45", "minimax-m2")
DEPLOYMENTS = {
    "colocated dp2 mb2": dict(mode="colocated", dp_size=2, micro_batches=2),
    "afd 2A 2x2 mb3 two-stage": dict(
        mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3, dispatch="two-stage"
    ),
}


@functools.cache
def references(path: str):
    """The single engine's staggered tokens and prefix-sharing rounds, both held to transformers'."""
    staggered = staggered_reference(path, LENGTHS, GREEDY, seed=11, low=5)
    with Engine(model_path=path, dtype="float32", num_threads=1, **CHUNKED) as single:
        vocab = single.config.vocab_size
        rounds = prefix_sharing_rounds(single, vocab, GREEDY)
    for ids, out, _ in rounds:
        assert_greedy_matches(out, *hf_greedy(path, ids, GREEDY.max_new_tokens), f"prompt of {len(ids)} tokens")
    return staggered, vocab, rounds


def check(engine, path: str, what: str) -> None:
    (prompts, want), vocab, rounds = references(path)
    assert run_staggered(engine, prompts, GREEDY, every=2) == want, what
    got = prefix_sharing_rounds(engine, vocab, GREEDY)
    assert [(ids, out) for ids, out, _ in got] == [(ids, out) for ids, out, _ in rounds], what
    assert sum(cached for _, _, cached in got) > 0, f"{what}: no request was served from the prefix cache"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_deployments_give_the_single_engines_tokens(family, deployment, tiny_model_factory):
    path = tiny_model_factory(family)
    flags = {**DEPLOYMENTS[deployment], **CHUNKED}
    with make_engine(model_path=path, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        check(engine, path, f"{family} {deployment}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_decode_disaggregation_gives_the_single_engines_tokens(family, tiny_model_factory):
    """The sparse model's index keys travel in the same cache rows as its latents: the decode side
    selects from what the prefill side wrote."""
    path = tiny_model_factory(family)
    common = {**COMMON, "model_path": path, "disaggregation_transfer_backend": "builtin"}
    pd = PDPair(Engine(**common, disaggregation_mode="prefill"), Engine(**common, disaggregation_mode="decode"))
    try:
        check(pd, path, f"{family} PD")
        assert pd.decode.disagg.transfer_bytes == pd.prefill.disagg.transfer_bytes > 0
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        pd.close()
