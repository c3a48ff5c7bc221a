"""How requests reach the simulated instances (planner/sim/front_end.py)."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.planner.sim.front_end import FrontEnd, equal_bins
from afd_engine.planner.simulate import SLO, ClusterConfig, InstanceConfig, LinearStepTime, simulate
from afd_engine.planner.traces import Trace, TraceRequest


def test_a_request_finding_the_front_end_idle_then_the_queue_behind_it():
    fe = FrontEnd(first_s=0.007, lead_s=0.002, next_s=0.0005)
    # a burst of four at 0; one alone at 1 s; two at 2 s, the second 1 ms after the first
    got = fe.deliveries([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 2.001])
    assert got == pytest.approx([0.007, 0.009, 0.0095, 0.010, 1.007, 2.007, 2.009])
    # one time per request: each after its arrival or after the one before, whichever is later
    assert FrontEnd.per_request(0.001).deliveries([0.0, 0.0, 0.0005, 0.01]) == pytest.approx(
        [0.001, 0.002, 0.003, 0.011]
    )
    assert FrontEnd().deliveries([0.0, 0.0, 0.5]) == [0.0, 0.0, 0.5]


def test_measured_gaps_are_drawn_with_a_seed():
    lead, after = [0.001, 0.002, 0.003, 0.010], [0.0002, 0.0003, 0.0004]
    fe = FrontEnd.measured(0.005, lead, after)
    assert (fe.lead_s, fe.next_s) == (pytest.approx(0.0025), 0.0003)  # the medians
    assert fe.lead_bins == (0.001, 0.002, 0.003, 0.010) and fe.next_bins == (0.0002, 0.0003, 0.0004)
    burst = [0.0] * 40
    medians = fe.deliveries(burst)
    assert medians[:3] == pytest.approx([0.005, 0.0075, 0.0078])
    drawn = fe.drawn(3).deliveries(burst)
    assert drawn == fe.drawn(3).deliveries(burst) and drawn != fe.drawn(4).deliveries(burst)
    gaps = [b - a for a, b in zip(drawn, drawn[1:])]
    assert drawn[0] == 0.005 and min(abs(gaps[0] - g) for g in lead) < 1e-12
    assert {round(g, 7) for g in gaps[1:]} <= set(after) and len({round(g, 7) for g in gaps[1:]}) > 1
    assert fe.drawn(None).deliveries(burst) == medians
    # scaled: the gaps between queued requests, not the first request's time
    half = fe.scaled(0.5)
    assert half.deliveries(burst)[:3] == pytest.approx([0.005, 0.00625, 0.0064])
    assert half.lead_bins == pytest.approx((0.0005, 0.001, 0.0015, 0.005))
    # equal bins: the means of equal slices of the sorted values
    assert equal_bins([4.0, 1.0, 2.0, 3.0], 2) == (1.5, 3.5) and equal_bins([2.0, 1.0], 5) == (1.0, 2.0)
    with pytest.raises(ConfigError, match="the front end's times must be >= 0"):
        FrontEnd.per_request(-0.001).validate("x")


def test_the_simulation_delivers_a_burst_through_the_front_end():
    """A burst of three whose first request starts a step alone (1 ms + 1 ms a token): the second
    is delivered 5 ms after the first, after that step, the third 1 ms later, during the next."""
    trace = Trace([TraceRequest(0.0, 3, out, ()) for out in (1, 2, 2)], 16, "t")
    cfg = InstanceConfig(
        ranks=1,
        step_time=LinearStepTime(0.001, 0.001),
        kv_pages=100,
        page_tokens=16,
        max_batch_tokens=64,
        max_running=8,
    )
    fe = FrontEnd(first_s=0.0, lead_s=0.005, next_s=0.001)
    res = simulate(trace, ClusterConfig("t", cfg, front_end=fe), SLO(9, 9))
    # step 1 [0, 4 ms): request 0's prompt (its one token). Request 1 reaches the instance at 5 ms:
    # step 2 [5, 9 ms) holds its prompt; request 2 (6 ms) waits for step 3 [9, 14 ms), with request
    # 1's decode
    assert res.ttft.tolist() == pytest.approx([0.004, 0.009, 0.014])
    # at once, the three share the first step (9 tokens, 10 ms)
    together = simulate(trace, ClusterConfig("t", cfg), SLO(9, 9))
    assert together.ttft.tolist() == pytest.approx([0.010] * 3)
