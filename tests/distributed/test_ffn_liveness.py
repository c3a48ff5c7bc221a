"""How an attention rank tells its FFN ranks alive (fault tolerance): heartbeats of the current
process counted, a lost process's dropped whatever their ids, and the reason a rank counts lost."""

from __future__ import annotations

import time
from types import SimpleNamespace

from afd_engine.distributed.attention_runner import PipelineRunner
from comm.messages import Message, MsgKey
from comm.protocol import HEARTBEAT_LAYER
from comm.transport.inproc import InProcessFabric

FFN = 2  # the FFN endpoint watched (attention endpoint 0, one attention rank: FFN rank 1)


def watcher(incarnation: int = 0) -> tuple[PipelineRunner, object]:
    """A runner with only what watching FFN endpoint 2 needs, and that endpoint's transport."""
    fabric = InProcessFabric()
    r = PipelineRunner.__new__(PipelineRunner)
    r.transport, ffn = fabric.endpoint(0), fabric.endpoint(FFN)
    r.spec = SimpleNamespace(
        args=SimpleNamespace(comm_timeout=3.0, ffn_recovery_timeout=60.0), topology=SimpleNamespace(num_senders=1)
    )
    r.ffn, r._joiners, r._admitted = [FFN], {}, 0.0
    r.incarnations, r._heartbeats, r._heard = {FFN: incarnation}, {FFN: 0}, {FFN: time.monotonic()}
    r._beating, r._pids, r._space, r._why = set(), {}, "", {}
    return r, ffn


def beat(ffn, n: int, incarnation: int) -> None:
    ffn.send(0, Message("heartbeat", MsgKey(n, HEARTBEAT_LAYER, 0), FFN, meta={"incarnation": incarnation}))


def test_a_lost_processs_heartbeats_are_dropped_and_the_replacements_counted():
    """Over ZeroMQ a lost process that comes back (or messages it sent late) can still deliver
    heartbeats after its replacement was admitted: they must not fail the key check."""
    r, ffn = watcher(incarnation=1)
    heard = r._heard[FFN]
    beat(ffn, 7, 0)
    beat(ffn, 8, 0)
    r._take_heartbeats(FFN, now=9.0)
    assert r._heard[FFN] == heard and FFN not in r._beating  # the lost process's say nothing of this one
    for n, incarnation in [(0, 1), (9, 0), (1, 1)]:
        beat(ffn, n, incarnation)
    r._take_heartbeats(FFN, now=10.0)
    assert r._heartbeats[FFN] == 2 and r._heard[FFN] == 10.0 and FFN in r._beating
    beat(ffn, 5, 1)  # one of the current process's, after some were lost on the way: counted on from it
    r._take_heartbeats(FFN, now=11.0)
    assert r._heartbeats[FFN] == 6 and r._heard[FFN] == 11.0


def test_a_silent_rank_is_lost_and_one_that_never_beat_is_named_as_started_without_the_flag():
    r, ffn = watcher()
    r._heard[FFN] = time.monotonic() - 10
    assert r._lost_ffn() == [1]
    assert r._why[1].startswith("no heartbeat for 10") and "started without --enable-ffn-fault-tolerance" in r._why[1]
    r._beating.add(FFN)
    r._lost_ffn()
    assert "without" not in r._why[1]
    beat(ffn, 0, 0)
    assert r._lost_ffn() == [] and r._why == {}
