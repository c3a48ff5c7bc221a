"""The expert placement on its own: every expert placed, equal slots per rank, groups kept on one
node, and skewed loads balanced to within 15% of the mean with one redundant copy per rank."""

from __future__ import annotations

import pytest
import torch

from afd_engine.eplb.placement import Placement, imbalance, place


def zipf_loads(num_experts: int, s: float, seed: int) -> torch.Tensor:
    """Token counts per expert with a Zipf-like skew, the hot experts at random positions."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(num_experts, generator=gen) + 1
    return (1e6 / ranks.to(torch.float64) ** s).round()


def identity_imbalance(load: torch.Tensor, num_ranks: int) -> float:
    """Before balancing: experts in order, num_experts / num_ranks per rank."""
    return imbalance(load.view(num_ranks, -1).sum(dim=1))


@pytest.mark.parametrize("s", [0.6, 1.0])
def test_dsv3_shape_balances_zipf_loads(s):
    # DeepSeek-V3-like: 256 experts in 8 groups, 2 nodes x 8 ranks, one redundant copy per rank
    load = zipf_loads(256, s, seed=3)
    p = place(load, num_redundant=16, num_nodes=2, ranks_per_node=8, num_groups=8)
    assert p.num_slots == 272 and p.slots_per_rank == 17
    replicas = p.replicas(256)
    assert all(replicas[e] for e in range(256))  # every expert somewhere
    node_of = [slot // (272 // 2) for slot in range(272)]
    for g in range(8):  # a group's copies all on one node
        assert len({node_of[s] for e in range(g * 32, (g + 1) * 32) for s in replicas[e]}) == 1
    before, after = identity_imbalance(load, 16), imbalance(p.rank_loads(load))
    assert after <= 1.15 < before, (before, after)
    hottest = int(load.argmax())
    assert len(replicas[hottest]) == max(len(r) for r in replicas) > 1


def test_one_hot_expert_gets_the_spare_copies():
    load = torch.ones(16)
    load[5] = 100.0
    p = place(load, num_redundant=4, num_nodes=1, ranks_per_node=4)
    assert len(p.replicas(16)[5]) == 5
    assert p.rank_loads(load).sum().item() == pytest.approx(load.sum().item())
    assert place(load, 4, 1, 4).slot_expert == p.slot_expert  # deterministic


def test_without_redundancy_it_still_packs_by_load():
    load = torch.tensor([8.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # experts 0 and 1 on one rank in order
    p = place(load, num_redundant=0, num_nodes=1, ranks_per_node=2)
    assert sorted(p.slot_expert) == list(range(8))
    assert p.rank_loads(load).tolist() == [11.0, 11.0]


def test_slots_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="do not divide over 16 ranks"):
        place(torch.ones(256), num_redundant=8, num_nodes=2, ranks_per_node=8)


def test_a_lost_rank_leaves_its_experts_to_their_copies_or_to_spare_slots():
    from afd_engine.eplb.placement import RecoveryImpossible, without_ranks

    # 4 ranks of 3 slots: experts 0-7, copies of 0-3 (rank 1 holds 5, 0, 2: 5 has no copy)
    p = Placement([4, 0, 2, 5, 0, 2, 6, 1, 3, 7, 1, 3], 3)
    after = without_ranks(p, {1}, 8)
    assert after.slot_expert[3:6] == [5, 0, 2]  # the dead rank's slots keep their entries
    live = [e for s, e in enumerate(after.slot_expert) if s // 3 != 1]
    assert sorted(set(live)) == list(range(8))  # every expert has a live slot
    assert [s for s in range(12) if after.slot_expert[s] != p.slot_expert[s]] == [11]  # one copy gave its slot
    assert after.slot_expert[11] == 5
    assert without_ranks(p, set(), 8) == p
    with pytest.raises(RecoveryImpossible, match="2 experts lost their only copy and the 6 live slots hold no spare"):
        without_ranks(p, {1, 3}, 8)


def test_routing_never_picks_a_dead_ranks_copy():
    from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap

    layout = ExpertLayout(num_experts=4, num_redundant=4, num_nodes=1, ranks_per_node=2)
    full = ExpertMap(layout, {1: Placement([0, 1, 2, 3, 0, 1, 2, 3], 4)})
    ids = torch.arange(4).repeat(10, 1)
    assert set(full.to_physical(1, ids).flatten().tolist()) == set(range(8))
    degraded = full.without_ranks({0}, version=3)
    assert (degraded.version, degraded.dead) == (3, frozenset({0}))
    assert set(degraded.to_physical(1, ids).flatten().tolist()) == {4, 5, 6, 7}
    assert degraded.rank_loads(torch.ones(1, 4)).tolist() == [0.0, 4.0]
    again = ExpertMap.from_description(layout, degraded.describe())
    assert again.dead == frozenset({0}) and torch.equal(again.to_physical(1, ids), degraded.to_physical(1, ids))
