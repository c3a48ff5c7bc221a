"""`afd plan simulate`: the discrete-event simulator against times worked out by hand.

Most tests use `LinearStepTime(a, b)`: a step takes a + b * tokens (of the busiest rank), so every
expected time below is a short sum written out next to the assertion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_engine.cli import main
from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration, LinearFit
from afd_engine.planner.deploy import Deployment, estimate
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.model_spec import MODELS
from afd_engine.planner.simulate import (
    SLO,
    ClusterConfig,
    FrontEnd,
    InstanceConfig,
    KVLink,
    LinearStepTime,
    StageStepTime,
    parse_spec,
    simulate,
)
from afd_engine.planner.stages import StageModel
from afd_engine.planner.step_calibration import TERMS, FittedStepTime, StepCalibration
from afd_engine.planner.traces import from_records, load_mooncake, poisson

A, B = 0.010, 0.001  # a step: 10 ms + 1 ms per token
# the Mooncake trace the repository ships (benchmarks/datasets/README.md), found from this file
MOONCAKE = Path(__file__).resolve().parents[2] / "benchmarks" / "datasets" / "mooncake_conversation_first30min.jsonl"


def exact(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def instance(**kw) -> InstanceConfig:
    base = dict(ranks=1, step_time=LinearStepTime(A, B), kv_pages=10**6, page_tokens=4, policy="fcfs")
    kw.setdefault("max_running", min(256, kw.get("max_batch_tokens", 2048)))
    return InstanceConfig(**{**base, **kw})


def run(records, cfg: InstanceConfig, block_tokens: int = 512, slo: SLO = SLO(10.0, 10.0)):
    return simulate(from_records(records, block_tokens), ClusterConfig("test", cfg), slo)


# (a) one request alone -----------------------------------------------------------------------------


def test_one_request_alone_chunked_prefill_then_decodes():
    # 10 prompt tokens under a budget of 4: chunks of 4, 4, 2; the last chunk samples token 1,
    # then 4 decode steps of one token each give tokens 2..5.
    r = run([(1.0, 10, 5)], instance(max_batch_tokens=4))
    ttft = (A + 4 * B) + (A + 4 * B) + (A + 2 * B)
    tpot = A + B
    assert r.ttft[0] == exact(ttft)
    assert r.tpot[0] == exact(tpot)
    assert r.e2e[0] == exact(ttft + 4 * tpot)
    s = r.summary
    assert s["ttft_s"]["p50"] == exact(ttft) and s["ttft_s"]["p99"] == exact(ttft)
    assert s["steps"] == 3 + 4 and s["preemptions"] == 0 and s["completed"] == 1
    assert s["utilisation"]["stepping"] == exact(1.0)  # busy from its arrival to its end
    # without a budget: one 10-token step (20 ms), then 11 ms per token
    unchunked = from_records([(1.0, 10, 5)])
    assert simulate(unchunked, ClusterConfig("t", instance()), SLO(0.0205, 0.0115)).summary["attainment"] == 1.0
    assert simulate(unchunked, ClusterConfig("t", instance()), SLO(0.0195, 1)).summary["attainment"] == 0.0


def test_ranks_of_an_instance_step_together_replicas_do_not():
    # A 100-token prompt on one rank (110 ms), and 1 ms later a 1-token prompt on another. Two
    # ranks of one instance step in lockstep: the second waits for the step under way, then takes
    # one of its own (11 ms). Two single-rank replicas are independent: it starts at once.
    recs = [(0.0, 100, 1), (0.001, 1, 1)]
    lockstep = run(recs, instance(ranks=2))
    assert lockstep.ttft[1] == exact((A + 100 * B) + (A + B) - 0.001)
    assert run(recs, instance(replicas=2)).ttft[1] == exact(A + B)


def test_a_single_token_answer_has_no_tpot_and_meets_any_tpot_slo():
    r = run([(0.0, 3, 1)], instance(), slo=SLO(1.0, 1e-9))
    assert r.ttft[0] == exact(A + 3 * B) and r.e2e[0] == exact(A + 3 * B)
    assert r.summary["attainment"] == 1.0 and r.summary["tpot_s"]["p50"] is None


def test_the_front_end_spreads_a_burst_and_the_response_path_delays_every_token():
    # Three 10-token prompts arrive together. With no front end they share one step (40 ms). With
    # 5 ms per request the first reaches the engine at 5 ms and steps alone (20 ms, to 25 ms); the
    # other two arrived meanwhile (10, 15 ms) and share the next step with the first one's decode
    # (21 tokens: 31 ms, to 56 ms); the first one's last token comes from the step after (3 decodes,
    # 13 ms, to 69 ms). Every token reaches the client 7 ms after its step: TTFT and e2e grow by
    # 7 ms, TPOT does not.
    recs = [(0.0, 10, 3)] * 3
    together = run(recs, instance())
    assert [together.ttft[i] for i in range(3)] == [exact(A + 30 * B)] * 3
    cfg = instance()
    front = FrontEnd.per_request(0.005)
    spread = simulate(from_records(recs, 512), ClusterConfig("t", cfg, front_end=front, response_s=0.007), SLO(9, 9))
    assert [spread.ttft[i] for i in range(3)] == [exact(0.032), exact(0.063), exact(0.063)]
    assert spread.e2e[0] == exact(0.069 + 0.007) and spread.tpot[0] == exact((0.069 - 0.025) / 2)
    for bad in ({"front_end": FrontEnd.per_request(-1.0)}, {"response_s": float("nan")}):
        with pytest.raises(ConfigError, match="must be >= 0"):
            simulate(from_records(recs, 512), ClusterConfig("t", cfg, **bad), SLO(9, 9))


# (b) prefix cache ----------------------------------------------------------------------------------


def test_shared_prefix_skips_cached_blocks():
    # 4-token blocks. The first request caches its two full prompt blocks (ids 1, 2); the third
    # block (id 3) is partial and never cached. A later prompt with blocks 1, 2 prefills only its
    # last 2 tokens; one sharing block 1 only prefills 6; an 8-token prompt made of blocks 1, 2
    # takes just one of them, since its last token must be computed to sample from.
    recs = [(0.0, 10, 2, (1, 2, 3)), (1.0, 10, 2, (1, 2, 7)), (2.0, 10, 2, (1, 9, 8)), (3.0, 8, 2, (1, 2))]
    r = run(recs, instance(), block_tokens=4)
    assert list(r.ttft) == [exact(A + 10 * B), exact(A + 2 * B), exact(A + 6 * B), exact(A + 4 * B)]
    assert r.summary["prefix_hit_rate"] == exact((8 + 4 + 4) / 38)


def test_cache_aware_router_prefers_the_rank_holding_the_prefix():
    # Two single-rank instances, both idle when the third request comes: on a tie of loads the
    # lowest index would win, but rank 1 holds its prefix (blocks 5, 6), so it goes there and hits.
    recs = [(0.0, 10, 1, (1, 2, 3)), (0.0, 10, 1, (5, 6, 7)), (1.0, 10, 1, (5, 6, 9))]
    r = run(recs, instance(replicas=2), block_tokens=4)
    assert r.ttft[2] == exact(A + 2 * B)
    recs[2] = (1.0, 10, 1, (4, 6, 9))  # no prefix anywhere: least loaded, lowest index, full prefill
    assert run(recs, instance(replicas=2), block_tokens=4).ttft[2] == exact(A + 10 * B)


def test_a_burst_sharing_a_first_block_follows_its_first_request():
    # Three prompts sharing block 5 arrive together at two idle instances. The router records a
    # prompt's blocks when it routes it (as the engine's does), so the second and third match the
    # first's block 5 on instance 0 and join it there, in one step of 30 tokens, before anything is
    # cached; routing by what the caches held would have sent the second to the idle instance 1.
    recs = [(0.0, 10, 1, (5, 6, 1)), (0.0, 10, 1, (5, 7, 2)), (0.0, 10, 1, (5, 8, 3))]
    r = run(recs, instance(replicas=2), block_tokens=4)
    assert list(r.ttft) == [exact(A + 30 * B)] * 3
    assert r.summary["prefix_hit_rate"] == 0.0


def test_the_routers_record_matches_the_engines():
    """The simulator's cache_aware router and the engine's (control/load_balance.py) pick the same
    rank for the same stream of prompts and finishes, with their records bounded alike."""
    import random

    from afd_engine.control.load_balance import CacheAwareBalancer
    from afd_engine.planner.sim.request import Request
    from afd_engine.planner.sim.router import Domain

    rng = random.Random(7)
    bs, ranks = 4, 3
    engine, sim = CacheAwareBalancer(ranks, bs, max_blocks=24), Domain("cache_aware", max_blocks=24)
    for _ in range(ranks):
        sim.add(object())
    live, picked = [], []
    for i in range(400):
        # prompts grow from a few shared roots: block n holds 4 tokens equal to path[n]; its key,
        # like a trace's block id, names the whole prefix up to it
        path = [rng.randrange(4)] + [rng.randrange(6) for _ in range(rng.randrange(8))]
        keys = tuple(tuple(path[: n + 1]) for n in range(len(path)))
        tokens = [t for t in path for _ in range(bs)] + [99, 99]  # a partial block: not recorded
        req = Request(i, 0.0, len(tokens), 1, keys)
        want = engine.route(str(i), tokens)
        got = sim.ranks.index(sim.route(req, len(keys)))
        picked.append(want)
        assert got == want, i
        live.append((str(i), got))
        while live and rng.random() < 0.45:  # some finish, in any order
            rid, rank = live.pop(rng.randrange(len(live)))
            engine.finished(rid)
            sim.load[rank] -= 1
    assert len(set(picked)) == ranks and sum(map(len, sim.sent)) <= 24 * ranks


def test_lpm_admits_the_longest_cached_prefix_first():
    # One request runs at a time. While the first decodes, a request without any cached prefix and
    # one sharing the first's two blocks wait; lpm takes the cached one first, fcfs the older one.
    recs = [(0.0, 10, 3, (1, 2, 3)), (0.001, 10, 1, (4, 5, 6)), (0.002, 10, 1, (1, 2, 7))]
    first_done = (A + 10 * B) + 2 * (A + B)  # the first request's prefill and two decodes
    lpm = run(recs, instance(max_running=1, policy="lpm"), block_tokens=4)
    assert lpm.e2e[2] == exact(first_done + (A + 2 * B) - 0.002)
    assert lpm.e2e[1] == exact(first_done + (A + 2 * B) + (A + 10 * B) - 0.001)
    fcfs = run(recs, instance(max_running=1, policy="fcfs"), block_tokens=4)
    assert fcfs.e2e[1] == exact(first_done + (A + 10 * B) - 0.001)
    assert fcfs.e2e[2] == exact(first_done + (A + 10 * B) + (A + 2 * B) - 0.002)


# (c) preemption ------------------------------------------------------------------------------------


def test_kv_full_preempts_the_newest_request_which_is_redone():
    # One-token pages, 14 of them; two requests of 4 prompt and 10 output tokens arrive together.
    # Step 0 prefills both (8 pages in use); steps 1-3 decode both (10, 12, 14 pages). In step 4
    # the older request needs a 15th page: the newest one is preempted with 7 tokens of KV
    # (4 prompt + 3 decoded) and 4 tokens sampled. It cannot come back (8 tokens to redo need 9
    # pages, only 6 are free and one is kept per running request) until the first finishes in
    # step 9 (4 + 9 = 13 tokens of KV). Step 10 re-prefills its 8 tokens and samples token 5;
    # steps 11-15 decode tokens 6-10.
    cfg = instance(kv_pages=14, page_tokens=1, max_batch_tokens=64, max_running=64)
    r = run([(0.0, 4, 10), (0.0, 4, 10)], cfg)
    t0 = A + 8 * B
    first_done = t0 + 3 * (A + 2 * B) + 6 * (A + B)
    second_done = first_done + (A + 8 * B) + 5 * (A + B)
    assert list(r.ttft) == [exact(t0), exact(t0)]
    assert list(r.e2e) == [exact(first_done), exact(second_done)]
    assert r.tpot[1] == exact((second_done - t0) / 9)
    assert list(r.preemptions) == [0, 1] and r.summary["preemptions"] == 1
    assert r.summary["completed"] == 2 and r.summary["truncated"] == 0


def test_a_prompt_larger_than_the_pool_is_rejected():
    r = run([(0.0, 20, 2), (0.0, 5, 2)], instance(kv_pages=5, page_tokens=4))  # 20 tokens + 1 > 20 slots
    assert r.outcome == ["rejected", "ok"] and r.summary["rejected"] == 1
    assert r.ttft[1] == exact(A + 5 * B)  # the other one is served as if alone


# (d) PD disaggregation -----------------------------------------------------------------------------

LINK = KVLink(bytes_per_token=1000.0, bandwidth_bps=1e6, latency_s=0.002)  # 1 ms per token + 2 ms
DA, DB = 0.005, 0.0005  # decode instance: 5 ms + 0.5 ms per token


def pd(prefill_budget: int = 2048) -> ClusterConfig:
    return ClusterConfig(
        "pd",
        instance(max_batch_tokens=prefill_budget),
        instance(step_time=LinearStepTime(DA, DB)),
        LINK,
    )


def test_pd_ttft_includes_the_kv_transfer():
    # Prefill: one 10-token step; its KV (10 tokens, 10 kB) crosses the link in 10 ms, and with the
    # link's 2 ms latency the first token reaches the decode instance, which makes tokens 2 and 3;
    # as the engine's decode side, it sends the first token out with the second.
    trace = from_records([(0.0, 10, 3, (1, 2, 3)), (1.0, 10, 2, (1, 2, 7))], block_tokens=4)
    r = simulate(trace, pd(), SLO(10, 10))
    kv = (A + 10 * B) + 10 * 1000 / 1e6 + 0.002
    assert r.ttft[0] == exact(kv + DA + DB)
    assert r.tpot[0] == exact((DA + DB) / 2)
    assert r.e2e[0] == exact(kv + 2 * (DA + DB))
    # The second shares blocks 1, 2 (8 tokens) with the first on both sides: 2 tokens prefilled,
    # 2 tokens of KV sent.
    assert r.ttft[1] == exact((A + 2 * B) + 2 * 1000 / 1e6 + 0.002 + DA + DB)
    assert r.gpus == 2


def test_pd_first_token_goes_out_with_the_second():
    # Request 0 decodes alone from 32 ms (20 ms prefill, 10 ms of KV, 2 ms latency), one 5.5 ms
    # step after another. Request 1's KV lands at 132 ms, inside the step that started at
    # 32 + 18 x 5.5 = 131 ms; it joins the next (136.5 ms, 6 ms with two tokens), and as the
    # engine's decode side (which hands a first token on with that step's outputs) its first token
    # goes out with its second, when that step ends; its third comes one step later.
    trace = from_records([(0.0, 10, 100, (1, 2)), (0.1, 10, 3, (5, 6))], block_tokens=4)
    r = simulate(trace, pd(), SLO(10, 10))
    assert r.ttft[0] == exact(0.032 + DA + DB)
    assert r.ttft[1] == exact(0.032 + 19 * (DA + DB) + (DA + 2 * DB) - 0.1)
    assert r.tpot[1] == exact((DA + 2 * DB) / 2)


def pd_fitted_decode(term: str, seconds: float) -> tuple[float, float]:
    """Request 0's end to end time, with request 1 (arriving at 100 ms) and alone, under PD with a
    decode instance fitted at 5 ms a step plus `seconds` for `term`. Request 0 decodes from 32 ms."""
    coef = [0.0] * len(TERMS)
    coef[0], coef[TERMS.index(term)] = 0.005, seconds
    decode = instance(step_time=FittedStepTime(StepCalibration(tuple(coef))))
    cluster = ClusterConfig("pd", instance(), decode, LINK)
    trace = from_records([(0.0, 10, 100, (1, 2)), (0.1, 12, 2, (5, 6, 7))], block_tokens=4)
    alone = simulate(from_records([(0.0, 10, 100, (1, 2))], block_tokens=4), cluster, SLO(10, 10))
    return simulate(trace, cluster, SLO(10, 10)).e2e[0], alone.e2e[0]


@pytest.mark.parametrize("term", ["peer_busy", "peer_tokens"])
def test_a_fitted_step_pays_for_another_instance_computing_as_it_starts(term):
    # 4 ms more when another instance is in a step as it starts (instances sharing CPUs,
    # step_calibration's peer_busy), or 4 ms more per token of the step then (peer_tokens; request
    # 0 decodes one a step): request 1's 22 ms prefill step runs over [100, 122) ms, so request 0's
    # decode steps that start at 102, 111 and 120 ms take 9 ms; its other 96 steps 5 ms.
    both, alone = pd_fitted_decode(term, 0.004)
    assert both == exact(0.032 + 96 * 0.005 + 3 * 0.009)
    assert alone == exact(0.032 + 99 * 0.005)


def one_fitted_instance(term: str, seconds: float, records: list):
    """The simulation of `records` (4-token blocks) on one instance fitted at 5 ms a step, 10 ms
    more for a prefill step and `seconds` more for `term`."""
    coef = [0.0] * len(TERMS)
    coef[0], coef[TERMS.index("prefill_step")], coef[TERMS.index(term)] = 0.005, 0.010, seconds
    cluster = ClusterConfig("one", instance(step_time=FittedStepTime(StepCalibration(tuple(coef)))))
    return simulate(from_records(records, block_tokens=4), cluster, SLO(10, 10))


def test_a_fitted_step_right_after_a_prefill_step_pays_for_its_first_tokens():
    # 5 ms a step, 10 ms more for a prefill step, 3 ms more for a step that starts as a prefill
    # step ends (step_calibration's after_prefill). Request 0 prefills over [0, 15) ms and decodes
    # in 8 then 5 ms; request 1 only prefills (one token, [1000, 1015) ms); request 2's prefill step
    # starts after an idle second, so it costs no more than request 0's; its decode step 8 ms.
    r = one_fitted_instance("after_prefill", 0.003, [(0.0, 10, 3), (1.0, 10, 1), (2.0, 10, 2)])
    assert r.ttft[0] == exact(0.015) and r.tpot[0] == exact((0.008 + 0.005) / 2)
    assert r.ttft[2] == exact(0.015) and r.tpot[2] == exact(0.008)


def test_a_fitted_step_pays_for_each_request_that_left_before_it():
    # 5 ms a step, 10 ms more for a prefill step, 2 ms more for each request that left the instance
    # since its previous step (step_calibration's requests_left). Both requests prefill in one step
    # over [0, 15) ms; request 0 finishes with the first decode step (5 ms), so request 1's second
    # costs 7 ms, its last two 5 ms; request 2 comes after both left: its prefill step pays for the
    # one that left last (request 1), its decode step for none.
    r = one_fitted_instance("requests_left", 0.002, [(0.0, 10, 2), (0.0, 10, 5), (1.0, 10, 2)])
    assert r.ttft[0] == exact(0.015) and r.tpot[0] == exact(0.005)
    assert r.ttft[1] == exact(0.015) and r.tpot[1] == exact((0.005 + 0.007 + 0.005 + 0.005) / 4)
    assert r.ttft[2] == exact(0.017) and r.tpot[2] == exact(0.005)


def test_a_fitted_pd_decode_step_pays_for_the_requests_that_join_it():
    # 3 ms more for a decode step whose round takes in requests from the prefill instance
    # (step_calibration's joined): request 0's own first decode step and the one request 1 joins
    # cost 8 ms, its 97 others 5 ms.
    both, alone = pd_fitted_decode("joined", 0.003)
    assert both == exact(0.032 + 99 * 0.005 + 2 * 0.003)
    assert alone == exact(0.032 + 99 * 0.005 + 0.003)


def test_pd_streams_each_chunks_kv_as_it_is_computed():
    # Chunks of 4, 4, 2 tokens end at t1, t2, t3; each one's KV goes out at once (4, 4, 2 ms on an
    # idle link), so only the last chunk's 2 ms and the latency come after the prompt is done.
    r = simulate(from_records([(0.0, 10, 2)]), pd(prefill_budget=4), SLO(10, 10))
    t3 = 2 * (A + 4 * B) + (A + 2 * B)
    assert r.ttft[0] == exact(t3 + 2 * 1000 / 1e6 + 0.002 + DA + DB)  # out with the second token


def test_kv_link_from_the_network_model():
    h800 = HARDWARE["H800"]
    link = KVLink.between(h800, h800, 70272)  # DeepSeek-V3 bf16 MLA: 61 layers x 576 x 2 bytes
    assert link.bandwidth_bps == exact(400 / 8 * 0.8 * 1e9)  # one 400 Gb/s NIC per GPU at 80%
    assert link.latency_s == exact(20e-6)
    assert link.seconds(1000) == exact(70272 * 1000 / 40e9)


# (e) more GPUs -------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


def good_requests(trace, replicas: int, budget: int, slo: SLO, a: float, b: float, pages: int, policy: str) -> int:
    cfg = instance(
        replicas=replicas,
        step_time=LinearStepTime(a, b),
        max_batch_tokens=budget,
        kv_pages=pages,
        page_tokens=16,
        policy=policy,
    )
    return round(simulate(trace, ClusterConfig("x", cfg), slo).summary["attainment"] * len(trace))


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
    st.floats(0.5, 8),  # requests per second per replica of the smaller deployment
    st.sampled_from(["sharegpt", "fixed:200,50", "fixed:2000,20", "fixed:50,200"]),
    st.integers(0, 2**32 - 1),
    st.integers(1, 3),
    st.sampled_from([256, 2048]),
    st.floats(0.05, 2.0),
    st.floats(1.05, 5.0),
    st.floats(0.002, 0.02),
    st.floats(0.0, 0.0005),
    st.sampled_from([10**6, 600, 300]),  # 16-token pages: 300 hold the longest ShareGPT-like request
    st.sampled_from(["fcfs", "lpm"]),
)
def test_doubling_the_gpus_at_a_fixed_rate_keeps_goodput(
    rate, lengths, seed, n, budget, ttft, tpot_over_a, a, b, pages, policy
):
    # Independent single-rank replicas (each a + b * tokens per step) scale linearly. At a fixed
    # Poisson rate, twice the replicas never meet the SLO for fewer than 99% as many requests as
    # before: goodput is over the same arrival window, so it stays within 1% too. Strictly "never
    # lower" does not hold: the router (like the engine's) counts requests, not their work, and
    # breaks ties by index, so a request can land where a step boundary delays it (next test).
    trace = poisson(rate * n, 60.0 / n, seed=seed, lengths=lengths)
    hypothesis.assume(len(trace) >= 40)
    slo = SLO(ttft, tpot_over_a * a)
    base = good_requests(trace, n, budget, slo, a, b, pages, policy)
    assert good_requests(trace, 2 * n, budget, slo, a, b, pages, policy) >= base - 0.01 * len(trace)


def test_one_more_replica_can_lose_one_request_on_a_tie():
    # 150-token prompts, budget 64 (chunks 64, 64, 22: 180 ms alone), TTFT SLO 300 ms. With 5
    # replicas the first 5 requests get a rank each; at 0.217 and 0.254 every rank still holds one
    # unfinished request, so both ties go to rank 0. The one from 0.217 is admitted when rank 0's
    # first request ends (0.218) and prefills 64, 64 tokens (to 0.366); at 0.366 its last 22 and
    # the newest request's first 42 tokens share a step (to 0.440), then the newest one's 64
    # (to 0.514) and its last 44 (to 0.568): TTFT 0.568 - 0.254 = 0.314 > 0.3. With 4 replicas
    # these two land on different ranks and all 8 meet it.
    arrivals = [0.038, 0.094, 0.096, 0.096, 0.126, 0.217, 0.254, 0.296]
    records = [(t, 150, 1) for t in arrivals]
    slo = SLO(0.3, 1.0)

    def result(n):
        return simulate(from_records(records), ClusterConfig("x", instance(replicas=n, max_batch_tokens=64)), slo)

    four, five = result(4), result(5)
    assert four.summary["attainment"] == 1.0
    assert five.ttft[6] == exact(0.568 - 0.254)
    assert five.summary["attainment"] == 7 / 8


# the planner's stage model as the step time ---------------------------------------------------------


@pytest.mark.parametrize(
    "mode,ranks,ffn,mb,shared",
    [("colocated", 32, 0, 1, "attention"), ("colocated", 16, 0, 2, "attention"), ("afd", 24, 16, 3, "ffn")],
)
@pytest.mark.parametrize("calibrated", [False, True])
def test_uniform_decode_step_equals_the_planners_tpot(mode, ranks, ffn, mb, shared, calibrated):
    h800 = HARDWARE["H800"]
    calib = Calibration(LinearFit(80, 0.9, 10), LinearFit(60, 0.4, 10)) if calibrated else None
    sm = StageModel(MODELS["deepseek-v3"], h800, h800, 3000, "bf16", calib, expert_imbalance=1.2)
    seqs = 96
    est = estimate(sm, Deployment(mode, ranks, ffn, mb, seqs, shared_expert=shared))
    step = StageStepTime(sm, mode, ranks, ffn, mb, shared_expert=shared, max_tokens=256)
    seconds, busy = step.step([(seqs, seqs, seqs * 3000.0, 0.0)] * ranks)
    assert seconds * 1e3 == pytest.approx(est.tpot_ms, rel=1e-9)
    assert len(busy) == (2 if mode == "afd" else 1) and all(0 < x < seconds for x in busy)


def test_prefill_chunk_costs_more_with_a_longer_prefix():
    h800 = HARDWARE["H800"]
    sm = StageModel(MODELS["deepseek-v3"], h800, h800, 4096, "bf16")
    step = StageStepTime(sm, "colocated", 16, 0, 1, max_tokens=2048)
    short = step.step([(2048, 1, 0.0, 2048 * 2049 / 2)])[0]
    long = step.step([(2048, 1, 0.0, 2048 * 30000 + 2048 * 2049 / 2)])[0]
    # the extra query-key pairs at the compute roofline, over 61 layers
    pairs = 2048 * 30000 * 2 * 128 * (128 + 64 + 128)
    assert long - short == pytest.approx(61 * pairs / (989e12 * 0.45), rel=1e-6)


# (f) traces and the command line -------------------------------------------------------------------


def test_mooncake_trace_scaling(tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 3, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 3000, "input_length": 1, "output_length": 1, "hash_ids": [2]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = load_mooncake(f, rate_scale=2.0, length_scale=0.5)
    assert [r.arrival_s for r in t.requests] == [0.0, 0.25, 1.0]  # (ms from the first) / 1000 / 2
    assert [(r.input_len, r.output_len) for r in t.requests] == [(500, 3), (2, 2), (1, 1)]  # half up, >= 1
    longer = load_mooncake(f, rate_scale=2.0, length_scale=0.5, output_scale=2.0)  # outputs scaled apart
    assert [(r.input_len, r.output_len) for r in longer.requests] == [(500, 10), (2, 6), (1, 2)]
    assert longer.meta["output_scale"] == 2.0 and "output_scale" not in t.meta
    assert t.requests[0].blocks == (0, 1) and t.block_tokens == 256
    tiny = load_mooncake(f, length_scale=0.1)  # 0.3 and 0.1 tokens still make one
    assert [(r.input_len, r.output_len) for r in tiny.requests] == [(100, 1), (1, 1), (1, 1)]
    assert t.rate == exact(2 / 1.0)
    assert [r.arrival_s for r in t.scaled(4.0).requests] == [0.0, 0.0625, 0.25]
    full = load_mooncake(MOONCAKE, rate_scale=2.0)
    assert len(full) == 5719 and full.span_s == exact(1797.0 / 2)
    for bad, msg in [
        ('{"timestamp": 0}', "expected JSON"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "must be >= 1"),
    ]:
        f.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=msg):
            load_mooncake(f)
    with pytest.raises(ConfigError, match="rate-scale"):
        load_mooncake(MOONCAKE, rate_scale=0)
    with pytest.raises(ConfigError, match="no such file"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_poisson_trace():
    t = poisson(20.0, 50.0, seed=3, lengths="fixed:100,7")
    assert 800 < len(t) < 1200 and all(r.input_len == 100 and r.output_len == 7 for r in t.requests)
    assert all(0 <= r.arrival_s < 50 for r in t.requests)
    ids = [b for r in t.requests for b in r.blocks]
    assert len(ids) == len(set(ids))  # no shared prefixes
    g = poisson(20.0, 50.0, seed=3, lengths="sharegpt")
    mean_in = sum(r.input_len for r in g.requests) / len(g)
    assert 100 < mean_in < 220
    with pytest.raises(ConfigError, match="fixed:IN,OUT"):
        poisson(1.0, 1.0, lengths="fixed:10")


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("colocated:gpu=8", "unknown key 'gpu'"),
        ("colocated", "give KEY=VALUE"),
        ("tp:gpus=8", "must be colocated, afd or pd"),
        ("afd:a=8", "missing f"),
        ("afd:a=8,f=x", "f='x' must be an integer"),
        ("afd:a=8,f=8,a=4", "given twice"),
        ("afd:a=8,f=8,shared=both", "attention or ffn"),
        ("pd:prefill=colocated:gpus=16,decode=[afd:a=8,f=8]", "bracketed SPEC"),
        ("pd:prefill=[colocated:gpus=16,decode=[afd:a=8,f=8]", "without its ']'"),
        ("pd:prefill=[pd:prefill=[colocated:gpus=16]],decode=[afd:a=8,f=8]", "cannot be nested"),
        ("colocated:gpus=4", "weights need"),
        ("afd:a=8,f=2", "experts need"),
        ("colocated:gpus=16,running=4096", "max running requests"),
    ],
)
def test_cli_rejects_a_bad_spec(capsys, spec, msg):
    code = main(["plan", "simulate", "--poisson", "1", "--duration", "5", "--deployment", spec])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and err.startswith("afd plan simulate: error:")


def test_cli_rejects_a_bad_workload(capsys):
    for args, msg in [
        ([], "give a workload"),
        (["--poisson", "1"], "needs --duration"),
        (["--poisson", "1", "--duration", "5", "--trace", str(MOONCAKE)], "not both"),
        (["--poisson", "1", "--duration", "5", "--rates", "1,x"], "--rates"),
    ]:
        assert main(["plan", "simulate", "--deployment", "colocated:gpus=16", *args]) == 2
        assert msg in capsys.readouterr().err


def test_parse_spec_pd():
    s = parse_spec("pd:prefill=[colocated:gpus=16,replicas=2],decode=[afd:a=32,f=16,mb=3]")
    assert s.kind == "pd" and s.prefill.opts == {"gpus": 16, "replicas": 2}
    assert s.decode.opts == {"a": 32, "f": 16, "mb": 3} and s.gpus == 32 + 48


def test_cli_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    args = ["plan", "simulate", "--trace", str(MOONCAKE), "--limit", "40", "--rate-scale", "4"]
    pd_spec = "pd:prefill=[colocated:gpus=16],decode=[afd:a=8,f=16]"
    args += ["--deployment", "colocated:gpus=16", "--deployment", pd_spec]
    args += ["--rates", "0.5,1", "--plot", str(png), "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "simulation wall time" in text and "colocated:gpus=16" in text
    data = json.loads(out.read_text())
    col, dis = data["deployments"]
    assert col["gpus"] == 16 and dis["gpus"] == 40 and col["completed"] == 40
    assert set(col["utilisation"]) == {"stepping", "gpu"}
    assert {"decode.attention", "decode.ffn", "prefill.gpu"} <= set(dis["utilisation"])
    assert [p["rate_scale"] for p in data["sweep"]["colocated:gpus=16"]] == [2.0, 4.0]
    assert png.stat().st_size > 10_000
    spec = "afd:a=8,f=16"
    assert main(["plan", "simulate", "--poisson", "2", "--duration", "5", "--deployment", spec, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["deployments"][0]["name"] == spec
