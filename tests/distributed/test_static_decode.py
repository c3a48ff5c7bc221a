"""--static-decode: every decode step of every role runs the padded, persistent-buffer path that CUDA
graphs replay (afd_engine/ranks/static_decode.py), and every deployment stays token-exact with the
single engine (itself checked against transformers): AFD with several attention ranks, two FFN nodes,
three micro-batches and two-stage dispatch; colocated; placements switching every 3 steps; an FFN
rank killed under fault tolerance. On the lossy bf16 and fp8 wires the tokens are the same
deployment's without --static-decode.

Every static step first checks that the persistent tensors it runs on (the decode buffers, the
received-token buffers, the expert weights) are where they were at start (ranks/static_decode.
AddressGuard): a rebalance's switch and a recovery copy into the weights' storage instead of
rebinding it. A rank whose tensors moved fails its step, so a test that switches placements and
recovers with the same tokens has seen the addresses hold. The counter the ranks report proves the
static path ran.
"""

from __future__ import annotations

import signal

import pytest

from afd_engine import SamplingParams, make_engine
from tests.distributed.test_ffn_fault_tolerance import FT, ffn_pid, run_with_kill, settled_stats
from tests.distributed.test_ffn_fault_tolerance import GREEDY as FT_GREEDY
from tests.engine_helpers import run_staggered, staggered_reference

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 9, 17, 3, 12, 7, 21, 4]
REBALANCE = dict(enable_eplb=True, eplb_rebalance_num_iterations=3)
# the last two requests join at step 6 and decode 15 more tokens with nobody joining: at least 15
# steps without a prefill, each with at least one static (micro-)batch
DECODE_ONLY_STEPS = GREEDY.max_new_tokens - 1
AFD = dict(mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3, dispatch="two-stage")

DEPLOYMENTS = {
    "afd 2A 2x2 two-stage mb3, fp32 wire, rebalancing": dict(
        **AFD, dispatch_dtype="fp32", ep_num_redundant_experts=4, **REBALANCE
    ),
    "afd 2A 2x2 two-stage mb3, bf16 wire": dict(**AFD, dispatch_dtype="bf16"),
    "afd 2A 2x2 two-stage mb3, fp8 wire": dict(**AFD, dispatch_dtype="fp8"),
    "colocated dp2 mb2, rebalancing": dict(
        mode="colocated", dp_size=2, micro_batches=2, dispatch_dtype="fp32", ep_num_redundant_experts=2, **REBALANCE
    ),
}


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_static_decode_gives_the_single_engines_tokens(name, tiny_v3, reference):
    prompts, expected = reference
    flags = DEPLOYMENTS[name]
    if flags.get("dispatch_dtype") != "fp32":  # a lossy wire: the same deployment's eager tokens
        with make_engine(model_path=tiny_v3, num_threads=1, comm_timeout=30, **flags) as engine:
            expected = run_staggered(engine, prompts, GREEDY, every=2)
    with make_engine(model_path=tiny_v3, num_threads=1, comm_timeout=30, static_decode=True, **flags) as engine:
        for _ in range(3 if flags.get("enable_eplb") else 1):
            assert run_staggered(engine, prompts, GREEDY, every=2) == expected, name
            if not flags.get("enable_eplb") or engine.expert_load()["placement"]["version"] >= 1:
                break
        if flags.get("enable_eplb"):  # the static steps ran on switched placements too
            assert engine.expert_load()["placement"]["version"] >= 1
        stats = settled_stats(engine)
    assert stats.static_decode_batches >= DECODE_ONLY_STEPS, stats


@pytest.mark.timeout(300)
def test_static_decode_survives_a_killed_ffn_rank_with_its_addresses(tiny_v3):
    """The recovery hands the lost rank's experts to the survivors' slots by copying into them."""
    prompts, expected = staggered_reference(tiny_v3, LENGTHS, FT_GREEDY, seed=3)  # the kill helper's tokens
    flags = dict(dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, ep_num_redundant_experts=8, micro_batches=2)
    with make_engine(model_path=tiny_v3, static_decode=True, **{**FT, **flags}) as engine:
        outs = run_with_kill(engine, prompts, ffn_pid(1, 2), after_tokens=40, sig=signal.SIGKILL)
        assert outs == expected
        stats = settled_stats(engine)
        assert (stats.ffn_recoveries, stats.ffn_ranks_alive) == (1, 3)
        before = stats.static_decode_batches
        again = engine.generate(prompt_token_ids=prompts, sampling_params=FT_GREEDY)
        assert [o.token_ids for o in again] == expected
        assert settled_stats(engine).static_decode_batches > before > 0


def test_static_decode_of_the_single_engine_is_the_graph_path(tiny_v3, reference):
    prompts, expected = reference
    with make_engine(model_path=tiny_v3, num_threads=1, static_decode=True) as engine:
        assert run_staggered(engine, prompts, GREEDY, every=2) == expected
        assert engine.static_decode_batches() >= DECODE_ONLY_STEPS
        assert engine.runner.graphs.graphs == {}  # nothing captured off a GPU
