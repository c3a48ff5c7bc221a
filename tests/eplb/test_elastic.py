"""Elastic expert storage on its own: a recovery that spare copies cannot cover grows the survivors
within their caps (evenly, the same slots in every layer), routes and dispatches through the grown
slots, and plans copies from live peers of the same node only."""

from __future__ import annotations

import pytest
import torch

from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.peer_copy import Transfer, plan_transfers
from afd_engine.eplb.placement import Placement, RecoveryImpossible
from comm.topology import Topology

PLAIN = ExpertLayout(num_experts=16, num_redundant=0, num_nodes=1, ranks_per_node=4)
CAPS = dict.fromkeys(range(4), 8)


def test_the_lost_ranks_experts_go_to_new_slots_spread_over_the_survivors():
    full = ExpertMap.initial(PLAIN, [1, 2])
    after = full.without_ranks({3}, version=1, caps=CAPS)
    assert after.sizes == (6, 5, 5, 4) and after.num_slots == 20  # one slot at a time to the smallest
    for layer in (1, 2):
        assert after.rank_slots(0)[layer] == [0, 1, 2, 3, 12, 15]  # its own, then lost experts in turn
        assert after.rank_slots(1)[layer] == [4, 5, 6, 7, 13]
        assert after.rank_slots(2)[layer] == [8, 9, 10, 11, 14]
        assert after.rank_slots(3)[layer] == [12, 13, 14, 15]  # the dead rank keeps its entries
    ids = torch.arange(16).repeat(3, 1)
    live = set(after.to_physical(1, ids).flatten().tolist())
    assert live == set(range(16)) and after.rank_loads(torch.ones(2, 16)).tolist() == [12.0, 10.0, 10.0, 0.0]
    again = ExpertMap.from_description(PLAIN, after.describe())
    assert again.sizes == after.sizes and torch.equal(again.to_physical(2, ids), after.to_physical(2, ids))
    assert full.describe()["sizes"] is None and after.describe()["sizes"] == [6, 5, 5, 4]
    # a second loss grows the grown ranks again: 16 experts on their 11 slots need 5 more
    twice = after.without_ranks({2}, version=2, caps=CAPS)
    assert (twice.sizes, twice.dead) == ((8, 8, 5, 4), frozenset({2, 3}))
    assert sorted(twice.rank_slots(0)[1] + twice.rank_slots(1)[1]) == list(range(16))
    assert twice.rank_slots(0)[1][:6] == after.rank_slots(0)[1]  # what a rank held keeps its slot


def test_spare_copies_give_up_their_slots_before_any_rank_grows():
    layout = ExpertLayout(num_experts=8, num_redundant=4, num_nodes=1, ranks_per_node=4)
    # 4 ranks of 3 slots: experts 0-7, copies of 0-3; rank 1 holds 5, rank 3 holds 7 (no copies)
    current = ExpertMap(layout, {1: Placement([4, 0, 2, 5, 0, 2, 6, 1, 3, 7, 1, 3], 3)})
    caps = dict.fromkeys(range(4), 6)
    assert current.without_ranks({1}, version=1, caps=caps).sizes == (3, 3, 3, 3)  # a copy's slot does
    after = current.without_ranks({1, 3}, version=1, caps=caps)
    # the survivors' 6 slots hold 6 experts: 5 and 7 get a new slot each, on ranks 0 and 2
    assert after.sizes == (4, 3, 4, 3)
    assert after.placements[1].slot_expert == [4, 0, 2, 5, 5, 0, 2, 6, 1, 3, 7, 7, 1, 3]


def test_growth_beyond_the_caps_is_refused_naming_the_flag():
    full = ExpertMap.initial(PLAIN, [1])
    with pytest.raises(RecoveryImpossible, match=r"MoE layer 1 without expert ranks \[2, 3\]: 8 experts lost their "):
        full.without_ranks({2, 3}, version=1, caps=dict.fromkeys(range(4), 7))
    try:
        full.without_ranks({2, 3}, version=1, caps={0: 7})  # rank 1 told no cap: it does not grow
    except RecoveryImpossible as exc:
        assert str(exc).endswith(
            "the survivors may grow by 3 slots within their --ffn-expert-memory-mb caps (rank 0: 7, rank 1: 4 "
            "slots at most)"
        )
    assert full.without_ranks({2, 3}, version=1, caps=CAPS).sizes == (8, 8, 4, 4)


def test_dispatch_addresses_the_grown_slots():
    topo = Topology(num_senders=1, num_nodes=1, ranks_per_node=3, num_experts=14, rank_sizes=(6, 5, 3))
    assert topo.ffn_rank_of.tolist() == [0] * 6 + [1] * 5 + [2] * 3
    assert topo.local_index(1).tolist() == [-1] * 6 + [0, 1, 2, 3, 4] + [-1] * 3
    assert topo.experts_of(2) == [11, 12, 13]
    with pytest.raises(Exception, match=r"rank_sizes \[6, 5\] must give each of the 3 ranks its slots, 14 in all"):
        Topology(num_senders=1, num_nodes=1, ranks_per_node=3, num_experts=14, rank_sizes=(6, 5))


def test_copies_come_from_live_ranks_of_the_receivers_node_only():
    layout = ExpertLayout(num_experts=8, num_redundant=0, num_nodes=2, ranks_per_node=2)
    # rank 1 was lost, and rank 0 grew to hold its experts 2 and 3 too
    grown = Placement([0, 1, 2, 3, 2, 3, 4, 5, 6, 7], 2, (4, 2, 2, 2))
    current = ExpertMap(layout, {1: grown}, dead=frozenset({1}))
    # rank 1 comes back (a replacement: it holds nothing) for its experts 2, 3; ranks 0 and 2 swap 1 and 4
    new = ExpertMap(layout, {1: Placement([0, 4, 2, 3, 1, 5, 6, 7], 2)}, version=2)
    plan = plan_transfers(current, new, ranks_per_node=2)
    # rank 1's experts 2, 3 come from rank 0, which holds them; nothing crosses between the nodes
    # (ranks 0 and 2 read 4 and 1 from the checkpoint)
    assert plan == [Transfer(1, 2, 0, 1), Transfer(1, 3, 0, 1)]
