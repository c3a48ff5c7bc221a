"""How an attention rank tells its FFN ranks alive (fault tolerance): heartbeats of the current
process counted, a lost process's dropped whatever their ids, and the reason a rank counts lost."""

from __future__ import annotations

import time

from afd_engine.ranks.fault_tolerance import HEARTBEAT, heartbeat_key
from afd_engine.ranks.fault_tolerance_liveness import FfnLiveness
from comm.messages import Message
from comm.topology import Topology
from comm.transport.inproc import InProcessFabric

FFN = 2  # the FFN endpoint watched (attention endpoint 0, one attention rank: FFN rank 1)


def watcher(incarnation: int = 0) -> tuple[FfnLiveness, object]:
    """An attention rank's watch over FFN endpoint 2, and that endpoint's transport."""
    fabric = InProcessFabric()
    topo = Topology(num_senders=1, num_nodes=1, ranks_per_node=2, num_experts=2)
    r = FfnLiveness(fabric.endpoint(0), topo, comm_timeout=3.0, endpoints=[FFN])
    r.incarnations[FFN], r.space = incarnation, ""
    return r, fabric.endpoint(FFN)


def beat(ffn, n: int, incarnation: int) -> None:
    ffn.send(0, Message(HEARTBEAT, heartbeat_key(n), FFN, meta={"incarnation": incarnation}))


def test_a_lost_processs_heartbeats_are_dropped_and_the_replacements_counted():
    """Over ZeroMQ a lost process that comes back (or messages it sent late) can still deliver
    heartbeats after its replacement was admitted: they must not fail the key check."""
    r, ffn = watcher(incarnation=1)
    heard = r.heard[FFN]
    beat(ffn, 7, 0)
    beat(ffn, 8, 0)
    r.take_heartbeats(FFN, now=9.0)
    assert r.heard[FFN] == heard and FFN not in r.beating  # the lost process's say nothing of this one
    for n, incarnation in [(0, 1), (9, 0), (1, 1)]:
        beat(ffn, n, incarnation)
    r.take_heartbeats(FFN, now=10.0)
    assert r.expected[FFN] == 2 and r.heard[FFN] == 10.0 and FFN in r.beating
    beat(ffn, 5, 1)  # one of the current process's, after some were lost on the way: counted on from it
    r.take_heartbeats(FFN, now=11.0)
    assert r.expected[FFN] == 6 and r.heard[FFN] == 11.0


def test_a_silent_rank_is_lost_and_one_that_never_beat_is_named_as_started_without_the_flag():
    r, ffn = watcher()
    r.heard[FFN] = time.monotonic() - 10
    why = r.lost([FFN])
    assert list(why) == [1]
    assert why[1].startswith("no heartbeat for 10") and "started without --enable-ffn-fault-tolerance" in why[1]
    r.beating.add(FFN)
    assert "without" not in r.lost([FFN])[1]
    beat(ffn, 0, 0)
    assert r.lost([FFN]) == {}
