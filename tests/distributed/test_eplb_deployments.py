"""Redundant experts and live rebalancing keep every deployment token-exact: requests join while
others decode, placements switch every few steps in the middle of generation, and the greedy
tokens stay those of the single engine (itself checked against transformers)."""

from __future__ import annotations

import json

import pytest
import torch

from afd_engine import SamplingParams, make_engine
from afd_engine.eplb.expert_map import ExpertLayout
from tests.engine_helpers import run_staggered, staggered_reference

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 9, 17, 3, 12, 7, 21, 4]
REBALANCE = dict(enable_eplb=True, eplb_rebalance_num_iterations=3)
ROUNDS = 4  # of requests at most, until placements have switched mid-generation

DEPLOYMENTS = {
    "afd 2A 2x2 two-stage mb3, 4 redundant": dict(
        mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, ep_num_redundant_experts=4, **REBALANCE
    ),
    "afd 1A 1x2 direct mb2, 2 redundant": dict(
        mode="afd",
        dp_size=1,
        ffn_ranks_per_node=2,
        micro_batches=2,
        dispatch="direct",
        ep_num_redundant_experts=2,
        **REBALANCE,
    ),
    "colocated dp2 mb2, 2 redundant": dict(
        mode="colocated", dp_size=2, micro_batches=2, ep_num_redundant_experts=2, **REBALANCE
    ),
    "afd 1A 2x1 two-stage, 2 redundant, static from a load report": dict(
        mode="afd", dp_size=1, ffn_nodes=2, ep_num_redundant_experts=2, init_expert_location=True
    ),
}
# a saved report (the JSON of GET /expert_load) with hot experts 3 and 12 in every MoE layer
REPORT = {"moe_layers": [1, 2, 3], "load": [[50 if e in (3, 12) else 1 + e for e in range(16)]] * 3}


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=11)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_redundant_experts_and_rebalances_keep_tokens_exact(name, tiny_v3, reference, tmp_path):
    prompts, expected = reference
    flags = dict(DEPLOYMENTS[name])
    if flags.get("init_expert_location"):
        flags["init_expert_location"] = str(tmp_path / "load.json")
        (tmp_path / "load.json").write_text(json.dumps(REPORT))
    with make_engine(model_path=tiny_v3, num_threads=1, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        # Staging runs beside the steps on a low-priority thread, so on a busy machine a whole round
        # of requests can finish before the first switch: run rounds, each token-exact, until a
        # placement has been switched in.
        for _ in range(ROUNDS if flags.get("enable_eplb") else 1):
            outs = run_staggered(engine, prompts, GREEDY, every=2)
            assert outs == expected, name
            report = engine.expert_load()
            if report["placement"]["version"] >= 1:
                break
    placement = report["placement"]
    redundant = flags["ep_num_redundant_experts"]
    for slots in placement["slot_expert"].values():
        assert sorted(set(slots)) == list(range(16)) and len(slots) == 16 + redundant  # every expert, + copies
    if flags.get("enable_eplb"):
        # a placement every 3 steps, switched once staged (how many depends on staging time; on an
        # idle machine 4-5 switches happen while the first round decodes)
        assert placement["version"] >= 1, placement["version"]
    else:
        assert placement["version"] == 0
        layout = ExpertLayout(16, redundant, flags["ffn_nodes"], 1, num_groups=4)
        for i, layer in enumerate(REPORT["moe_layers"]):  # the report's placement: 3 and 12 copied
            slots = layout.place(torch.tensor(REPORT["load"][i], dtype=torch.float64)).slot_expert
            assert placement["slot_expert"][str(layer)] == slots
            assert slots.count(3) == slots.count(12) == 2
