"""The rebalancing agreement on its own: two attention ranks plan at the same round, install the
placement only once both computed it, and switch at the same step only once every expert rank
acknowledged it; an unchanged placement is never installed."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.rebalancer import Rebalancer
from comm.messages import CommTimeout, Message

LAYOUT = ExpertLayout(num_experts=8, num_redundant=2, num_nodes=1, ranks_per_node=2)
FFN = [10, 11]


class Window:
    def __init__(self, load) -> None:
        self.load = torch.tensor([load], dtype=torch.int64)

    def window(self) -> torch.Tensor:
        return self.load


class Acks:
    """A transport whose eplb_ready messages arrive when the test says so."""

    def __init__(self) -> None:
        self.sent: set[tuple[int, int]] = set()  # (ffn endpoint, version)

    def recv(self, src, kind, key, timeout):
        assert kind == "eplb_ready" and timeout == 0.0
        if (src, key.step) not in self.sent:
            raise CommTimeout("not yet")
        # FFN endpoint 10 copied two experts from its peer, 11 read one from the checkpoint
        loaded = {"peer": 2, "checkpoint": 0} if src == 10 else {"peer": 0, "checkpoint": 1}
        return Message(kind, key, src, meta={"loaded": loaded})


def round_(ranks, step: int) -> list[dict]:
    outs = [r.sync_out(step) for r in ranks]
    metas, loads = [m for m, _ in outs], [t for _, ts in outs for t in ts]
    for r in ranks:
        r.sync_in(step, metas, loads)
    return metas


def test_two_ranks_plan_install_and_switch_together():
    acks = [Acks(), Acks()]  # what each attention rank has received
    start = ExpertMap.initial(LAYOUT, [1])
    hot = [100, 1, 1, 1, 1, 1, 1, 60]
    ranks = [Rebalancer(start, Window(hot), 4, acks[0], FFN), Rebalancer(start, Window([0] * 8), 4, acks[1], FFN)]
    assert not any(m["eplb_plan"] for m in round_(ranks, 3))  # not yet 4 steps
    assert all(m["eplb_plan"] for m in round_(ranks, 4))
    computed = ranks[0]._planning.result(timeout=10)
    ranks[1]._planning = Future()  # rank 1 is still computing
    round_(ranks, 4)
    assert ranks[0].pending is None and ranks[1].pending is None  # neither installs alone
    ranks[1]._planning.set_result(computed)
    round_(ranks, 4)  # both report the placement computed: it is installed on both
    assert [r.pending.version for r in ranks] == [1, 1]
    assert [r.begin_step(1.0) for r in ranks] == [{"eplb_plan": ranks[0].pending.describe()}] * 2
    acks[0].sent |= {(10, 1), (11, 1)}
    acks[1].sent.add((10, 1))
    round_(ranks, 5)
    assert not any(r.switching for r in ranks)  # rank 1 has not heard from FFN endpoint 11 yet
    acks[1].sent.add((11, 1))
    round_(ranks, 5)  # now every rank has every ack: the switch is agreed
    assert all(r.switching for r in ranks)
    assert [r.begin_step(1.0) for r in ranks] == [{"eplb_switch": 1}] * 2
    assert [r.loaded for r in ranks] == [{"peer": 2, "checkpoint": 1}] * 2  # what the FFN ranks said they loaded
    assert ranks[0].map.version == ranks[1].map.version == 1 and ranks[0].pending is None
    copies = ranks[0].map.placements[1].replicas(8)
    assert len(copies[0]) == 2 and len(copies[7]) == 2  # the two hot experts got the spare slots
    for r in ranks:
        r.close()


def test_an_unchanged_placement_is_not_installed():
    load = [9, 1, 1, 1, 1, 1, 1, 1]
    current = ExpertMap(LAYOUT, {1: LAYOUT.place(torch.tensor(load, dtype=torch.float64))}, version=3)
    rank = Rebalancer(current, Window(load), 2, Acks(), FFN)
    round_([rank], 2)
    rank._planning.result(timeout=10)
    round_([rank], 2)
    assert rank.pending is None and rank.map.version == 3 and rank.begin_step(1.0) == {}
    assert rank.last_plan_step == 2 and not round_([rank], 3)[0]["eplb_plan"]  # next plan at step 4
    rank.close()
