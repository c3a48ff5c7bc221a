"""AFD and colocated deployments, and replicas of the single engine (real OS processes, ZeroMQ
between them) compute what the single process engine and transformers compute: token for token,
with prefill and decode mixed, with and without overlapped scheduling."""

from __future__ import annotations

import pytest
import torch

from afd_engine import Engine, SamplingParams, make_engine
from tests.engine_helpers import random_prompts, run_staggered
from tests.hf_reference import assert_greedy_matches, hf_greedy

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (1, 3, 9, 17, 30, 45, 64, 100)

DEPLOYMENTS = {
    "single dp2 replicas": dict(mode="single", dp_size=2, load_balance_method="round_robin"),
    "colocated dp2 mb1 zmq": dict(mode="colocated", dp_size=2, micro_batches=1, transport="zmq"),
    "colocated dp2 mb2 overlap": dict(mode="colocated", dp_size=2, micro_batches=2, overlap_schedule="on"),
    "afd 1A 1x1 mb1 two-stage": dict(mode="afd", dp_size=1, micro_batches=1),
    "afd 2A 1x2 mb2 direct": dict(mode="afd", dp_size=2, ffn_ranks_per_node=2, micro_batches=2, dispatch="direct"),
    "afd 2A 2x1 mb3 two-stage overlap": dict(
        mode="afd", dp_size=2, ffn_nodes=2, micro_batches=3, overlap_schedule="on"
    ),
    "afd 2A 2x2 mb4 two-stage spin": dict(
        mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=4, comm_spin_us=300
    ),
    "afd 2A 2x2 mb3 direct zmq": dict(
        mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, dispatch="direct", transport="zmq"
    ),
}


def prompts(vocab: int) -> list[list[int]]:
    return random_prompts(vocab, PROMPT_LENS, seed=7, low=5)


def staggered(engine, batch, params=GREEDY) -> list[list[int]]:
    """Two requests join every other step."""
    return run_staggered(engine, batch, params, every=2)


@pytest.fixture(scope="module")
def reference(tiny_v3):
    """The prompts, the single-process engine's tokens, and transformers' (tokens, top-2 gaps)."""
    with Engine(model_path=tiny_v3, num_threads=1) as single:
        batch = prompts(single.config.vocab_size)
        ours = [o.token_ids for o in single.generate(prompt_token_ids=batch, sampling_params=GREEDY)]
    return batch, ours, [hf_greedy(tiny_v3, ids, NEW) for ids in batch]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_deployment_matches_single_engine_and_transformers(name, tiny_v3, reference):
    batch, single, hf = reference
    with make_engine(model_path=tiny_v3, comm_timeout=30, dispatch_dtype="fp32", **DEPLOYMENTS[name]) as engine:
        outs = staggered(engine, batch)
    assert outs == single, name
    for ids, out, (ref, gaps) in zip(batch, outs, hf):
        assert_greedy_matches(out, ref, gaps, f"{name} prompt len {len(ids)}")


@pytest.mark.timeout(120)
def test_a_colocated_rank_without_requests_serves_its_experts_and_sends_nothing_else(tiny_v3, reference):
    """One request on colocated dp2: the other rank has no tokens in any step. It sends no dispatch
    messages and nobody waits for any from it (a wait would time out after comm_timeout); the busy
    rank computes its own experts' share in place (tokens wrong without it)."""
    batch, single, _ = reference
    with make_engine(model_path=tiny_v3, mode="colocated", dp_size=2, comm_timeout=10, dispatch_dtype="fp32") as engine:
        outs = engine.generate(prompt_token_ids=batch[4:5], sampling_params=GREEDY)
    assert outs[0].token_ids == single[4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ffn", [dict(ffn_nodes=1), dict(ffn_nodes=1, ffn_ranks_per_node=2)])
def test_afd_empty_micro_batches_send_nothing(ffn, tiny_v3, reference):
    """One request on 2 attention ranks with 3 micro-batches: the idle rank's micro-batches and two
    of the busy rank's are empty. Their dispatch messages are not sent and the FFN ranks (told by
    the step descriptors) wait for none; a micro-batch nobody fills is served without a message
    (a wait for one would time out after comm_timeout)."""
    batch, single, _ = reference
    flags = dict(mode="afd", dp_size=2, micro_batches=3, comm_timeout=10, dispatch_dtype="fp32", **ffn)
    with make_engine(model_path=tiny_v3, **flags) as engine:
        outs = engine.generate(prompt_token_ids=batch[4:5], sampling_params=GREEDY)
    assert outs[0].token_ids == single[4]


# Harder runs: other model configurations, prompts up to 200 tokens, prefill in small chunks, a KV
# pool too small for the batch (preemption and recompute), and micro-batch counts 5 to 8.
STRESS_LENS = (1, 9, 57, 130, 200)
STRESS = {
    "v2-lite afd 2A 2x1 mb5 chunked small-pool overlap": (
        "v2-lite",
        dict(
            overlap_schedule="on",
            mode="afd",
            dp_size=2,
            ffn_nodes=2,
            micro_batches=5,
            max_num_batched_tokens=24,
            max_total_tokens=320,
            page_size=8,
        ),
    ),
    "v2-group-limited afd 1A 1x2 mb8 chunked": (
        "v2-group-limited",
        dict(mode="afd", dp_size=1, ffn_ranks_per_node=2, micro_batches=8, max_num_batched_tokens=40),
    ),
    "v3-dense2 colocated dp2 mb2 small-pool": (
        "v3-dense2-rope-params",
        dict(mode="colocated", dp_size=2, micro_batches=2, max_total_tokens=300, page_size=4),
    ),
    "v3 afd 2A 1x2 mb6 direct chunked": (
        "v3-yarn-qlora",
        dict(
            mode="afd", dp_size=2, ffn_ranks_per_node=2, micro_batches=6, dispatch="direct", max_num_batched_tokens=33
        ),
    ),
    "qwen3-gqa4 afd 2A 2x1 mb3 two-stage": ("qwen3-gqa4", dict(mode="afd", dp_size=2, ffn_nodes=2, micro_batches=3)),
    "qwen3-mha-sparse2 colocated dp2 mb2": ("qwen3-mha-sparse2", dict(mode="colocated", dp_size=2, micro_batches=2)),
    "qwen3-tied afd 1A 1x2 mb4 direct chunked": (
        "qwen3-tied",
        dict(
            mode="afd", dp_size=1, ffn_ranks_per_node=2, micro_batches=4, dispatch="direct", max_num_batched_tokens=30
        ),
    ),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(STRESS))
def test_harder_deployments_match_transformers(name, tiny_model_factory):
    config, flags = STRESS[name]
    path = tiny_model_factory(config)
    with Engine(model_path=path, num_threads=1) as single:
        batch = random_prompts(single.config.vocab_size, STRESS_LENS, seed=11, low=5)
    with make_engine(model_path=path, comm_timeout=60, dispatch_dtype="fp32", **flags) as engine:
        outs = staggered(engine, batch)
    for ids, out in zip(batch, outs):
        assert_greedy_matches(out, *hf_greedy(path, ids, NEW), f"{name} prompt len {len(ids)}")


@pytest.mark.timeout(300)
def test_fp8_dispatch_logprobs_within_tolerance(tiny_v3, reference):
    batch = reference[0]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    with Engine(model_path=tiny_v3, num_threads=1) as single:
        ref = single.generate(prompt_token_ids=batch, sampling_params=params)
    with make_engine(model_path=tiny_v3, mode="afd", dp_size=2, ffn_nodes=2, dispatch_dtype="fp8") as engine:
        outs = engine.generate(prompt_token_ids=batch, sampling_params=params)
    for r, o in zip(ref, outs):
        diff = torch.tensor(o.logprobs[0].top_logprobs) - torch.tensor(r.logprobs[0].top_logprobs)
        assert diff.abs().max() < 0.05, f"fp8 top-5 logprobs differ by {diff.abs().max():.3f}"


def test_invalid_topologies_are_refused_at_start(tiny_v3):
    from afd_engine.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"16 routed experts, which do not divide over 3 FFN ranks; choose "
        r"--ffn-nodes x --ffn-ranks-per-node that divides 16",
    ):
        make_engine(model_path=tiny_v3, mode="afd", ffn_nodes=3)
    with pytest.raises(ConfigError, match=r"--micro-batches=9: must be in \[1, 8\]"):
        make_engine(model_path=tiny_v3, mode="afd", micro_batches=9)
    with pytest.raises(ConfigError, match="two-stage needs --mode afd"):
        make_engine(model_path=tiny_v3, mode="colocated", dp_size=2, dispatch="two-stage")


def test_sglang_style_checks_name_the_fix(tiny_v3):
    from afd_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--ep-size=8 but --ffn-nodes x --ffn-ranks-per-node gives 4 FFN ranks"):
        make_engine(model_path=tiny_v3, mode="afd", ffn_nodes=2, ffn_ranks_per_node=2, ep_size=8)
