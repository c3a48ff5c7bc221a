"""The pieces of expert load balancing on their own: routing through copies, the load window, the
shard a placement loads, and the switch that hands staged experts to the serving modules."""

from __future__ import annotations

import pytest
import torch

from afd_engine import Engine, SamplingParams
from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.placement import Placement, _pack, place
from afd_engine.eplb.recorder import ExpertLoadRecorder
from afd_engine.eplb.stager import ExpertStager
from afd_engine.model_config import ModelConfig
from afd_engine.models import load_expert_shard, load_model


def test_copies_share_an_experts_tokens_evenly_and_every_slot_holds_its_expert():
    layout = ExpertLayout(num_experts=8, num_redundant=4, num_nodes=1, ranks_per_node=4)
    load = torch.tensor([100.0, 1, 1, 1, 30, 1, 1, 1])
    emap = ExpertMap(layout, {3: layout.place(load)})
    copies = emap.placements[3].replicas(8)
    assert len(copies[0]) == 4 and len(copies[4]) == 2
    ids = torch.zeros(60, 4, dtype=torch.int64)
    ids[:, 1:] = torch.tensor([4, 2, 7])
    slots = emap.to_physical(3, ids, salt=1)
    slot_expert = torch.tensor(emap.placements[3].slot_expert)
    assert torch.equal(slot_expert[slots], ids)  # each pair goes to a copy of its own expert
    per_copy = torch.bincount(slots[:, 0], minlength=12)[copies[0]]
    assert per_copy.tolist() == [15, 15, 15, 15]  # 60 tokens over 4 copies
    assert sorted(torch.bincount(slots[:, 1], minlength=12)[copies[4]].tolist()) == [30, 30]
    assert torch.equal(emap.to_physical(3, ids, salt=1), slots)  # deterministic
    with pytest.raises(ValueError, match="expert 5 has no slot"):
        ExpertMap(layout, {3: Placement([0, 1, 2, 3, 4, 0, 6, 7, 0, 1, 2, 3], 3)})


def test_single_copies_route_to_their_slot_in_order_or_not():
    layout = ExpertLayout(num_experts=4, num_redundant=0, num_nodes=1, ranks_per_node=2)
    ids = torch.tensor([[0, 3], [2, 1]])
    emap = ExpertMap(layout, {1: Placement([0, 1, 2, 3], 2), 2: Placement([2, 0, 3, 1], 2)})
    assert torch.equal(emap.to_physical(1, ids), ids)
    assert torch.equal(emap.to_physical(2, ids), torch.tensor([[1, 2], [0, 3]]))  # slot of each expert


def test_initial_placement_is_in_order_without_copies_and_complete_with_them():
    plain = ExpertLayout(16, 0, 2, 2, num_groups=4)
    assert ExpertMap.initial(plain, [1, 2]).rank_slots(1) == {1: [4, 5, 6, 7], 2: [4, 5, 6, 7]}
    spare = ExpertMap.initial(ExpertLayout(16, 4, 2, 2, num_groups=4), [1])
    slots = spare.placements[1].slot_expert
    assert len(slots) == 20 and sorted(set(slots)) == list(range(16))
    for group in range(4):  # a group's experts (and copies) stay on one node (slots 0-9 or 10-19)
        nodes = {s // 10 for s, e in enumerate(slots) if e // 4 == group}
        assert len(nodes) == 1, (group, slots)
    again = ExpertMap.from_description(spare.layout, spare.describe())
    assert again.placements[1] == spare.placements[1] and again.version == spare.version


def test_a_rank_gets_two_copies_of_one_expert_only_when_nothing_else_fits():
    # lightest-bin packing alone would put both copies of expert 1 (items 1 and 2) on bin 1
    assert _pack([10.0, 3.0, 3.0, 1.0], num_bins=2, per_bin=2, keys=[0, 1, 1, 2]) == [[0, 2], [1, 3]]
    load = torch.tensor([1000.0] + [1.0] * 7)
    p = place(load, num_redundant=4, num_nodes=1, ranks_per_node=4)
    per_rank = [p.slot_expert[r * 3 : (r + 1) * 3] for r in range(4)]
    assert sorted(r.count(0) for r in per_rank) == [1, 1, 1, 2], per_rank  # five copies, four ranks


def test_load_window_slides_by_buckets():
    rec = ExpertLoadRecorder([1, 3], num_experts=4, window_steps=4, buckets=2)
    for step in range(6):
        rec.record(1, torch.tensor([[0, step % 4]]))
        rec.record(3, torch.tensor([[2, 3]]))
        rec.end_step()
    # bucket of steps 4-5 (full) and the empty one being filled: steps 0-3 have left the window
    assert rec.window().tolist() == [[3, 1, 0, 0], [0, 0, 2, 2]]  # steps 4 and 5 routed 0,0 and 0,1
    rec.record(1, torch.tensor([[3, 3]]))
    assert rec.window()[0].tolist() == [3, 1, 0, 2]
    assert rec.steps == 6


def test_a_shard_loads_each_slot_with_its_expert_and_a_switch_swaps_them_in(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    full = load_model(cfg, tiny_v3, torch.float32).routed_experts()
    layer = cfg.moe_layers[0]

    def shard(slots):
        return load_expert_shard(cfg, tiny_v3, torch.float32, slots)

    serving = shard({layer: list(range(6, 16))}).routed_experts()
    module = serving[layer]
    assert torch.equal(module.w13[2], full[layer].w13[8])

    stager = ExpertStager(shard, 1, serving)  # rank 1 of 2: slots 10..19 of a 20-slot placement
    layout = ExpertLayout(num_experts=16, num_redundant=4, num_nodes=1, ranks_per_node=2)
    mine = [10, 11, 12, 13, 14, 15, 7, 7, 5, 3]
    new = ExpertMap(layout, {layer: Placement(list(range(10)) + mine, 10)}, version=4)
    ready = []
    stager.stage(new, ready.append)
    stager.switch(4, timeout=30)
    assert ready == [4] and stager.ready(4) is False  # switched: nothing staged any more
    assert serving[layer] is module and module.slot_expert == mine
    for slot, expert in enumerate(mine):
        assert torch.equal(module.w13[slot], full[layer].w13[expert])
        assert torch.equal(module.w2[slot], full[layer].w2[expert])
    stager.close()


def test_a_single_engine_reports_its_expert_load(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1) as engine:
        engine.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_new_tokens=3))
        report = engine.expert_load()
    # 4 prompt tokens + 2 generated ones forwarded (the last is never fed back), top-4 per MoE layer
    assert [sum(layer) for layer in report["load"]] == [4 * 6] * 3
    assert report["expert_rank_load"] == [4 * 6 * 3] and report["imbalance"] == 1.0
    assert report["placement"]["version"] == 0 and report["steps"] == 3
