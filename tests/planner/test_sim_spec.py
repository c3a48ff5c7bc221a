"""`afd plan simulate` with speculative decoding (the MTP module), and DeepSeek-V3.2's sparse
attention in the simulated step: times worked out by hand, the planner's own formulas, and every
step's sums counted again from scratch."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from afd_engine.cli import main
from afd_engine.errors import ConfigError
from afd_engine.planner.deploy import Deployment, estimate
from afd_engine.planner.hardware import HARDWARE, get_hardware
from afd_engine.planner.model_spec import MODELS, get_model
from afd_engine.planner.sim.drafting_rank import DraftingRank
from afd_engine.planner.sim.loop import Simulation
from afd_engine.planner.sim.request import DECODE
from afd_engine.planner.sim.speculative import SpecDecoding, draft_time, geometric_probs
from afd_engine.planner.simulate import (
    SLO,
    BuildOptions,
    ClusterConfig,
    InstanceConfig,
    KVLink,
    LinearStepTime,
    StageStepTime,
    build_cluster,
    parse_spec,
    simulate,
)
from afd_engine.planner.stages import StageModel
from afd_engine.planner.traces import from_records, load_mooncake, poisson
from tests.planner.test_simulate import MOONCAKE

A, B = 0.010, 0.001  # a step: 10 ms + 1 ms per token of the busiest rank
H800 = HARDWARE["H800"]
ALL_OF_TWO = SpecDecoding((0.0, 0.0, 1.0), draft_fraction=0.0)  # 2 drafts, both always kept


def exact(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def instance(**kw) -> InstanceConfig:
    base = dict(ranks=1, step_time=LinearStepTime(A, B), kv_pages=10**6, page_tokens=4, policy="fcfs")
    return InstanceConfig(**{**base, **kw})


def run(records, cfg: InstanceConfig, slo: SLO = SLO(10.0, 10.0)):
    return simulate(from_records(records, 512), ClusterConfig("test", cfg), slo)


# off: the simulator as it was ----------------------------------------------------------------------


def _pinned_runs() -> dict:
    trace = load_mooncake(str(MOONCAKE), rate_scale=4.0, length_scale=0.125, limit=300)
    out = {}
    for name, text in (
        ("deepseek-v3", "colocated:gpus=16,pages=200"),
        ("deepseek-v3.2", "pd:prefill=[colocated:gpus=16],decode=[afd:a=4,f=16,pages=250]"),
    ):
        b = BuildOptions(model=get_model(name), hw=get_hardware, attn_dtype="bf16", router="shortest_queue")
        cluster = build_cluster(parse_spec(text), b)
        assert cluster.serving.speculative is None and (cluster.decode or cluster.serving).speculative is None
        r = simulate(trace, cluster, SLO(2.0, 0.03)).summary
        assert "speculative" not in r
        t, p, e = r["ttft_s"], r["tpot_s"], r["e2e_s"]
        out[name] = [r["steps"], r["preemptions"], r["completed"], t["p90"], p["p50"], p["p99"], e["mean"]]
    return out


def test_without_speculation_the_simulator_gives_what_it_gave_before_it_had_it():
    # figures of the simulator before speculative decoding was added, on runs with preemptions,
    # truncations, prefix hits, PD transfers and sparse attention (the PD run's TTFT and TPOT
    # since a first token goes out with the second, as the engine's decode side sends it)
    got = _pinned_runs()
    want = {
        "deepseek-v3": [609, 1, 259, 9.7979041586755, 0.09690841236021683, 0.26260342960609634, 7.614732348506141],
        "deepseek-v3.2": [
            2138,
            7,
            267,
            16.17970369520364,
            0.02202751927711117,
            0.034106245456967214,
            9.813783654191266,
        ],
    }
    for name, row in want.items():
        assert got[name][:3] == row[:3]
        assert got[name][3:] == [exact(x) for x in row[3:]]


# the accepted-length distribution ------------------------------------------------------------------


def test_a_mean_accepted_length_becomes_a_truncated_geometric_distribution():
    probs = geometric_probs(2.0, 2)  # 1 + a + a^2 = 2: a = (sqrt(5) - 1) / 2
    a = (math.sqrt(5) - 1) / 2
    assert probs == pytest.approx((1 - a, a * (1 - a), a * a), rel=1e-12)
    for mean, k in ((2.0, 2), (2.0, 3), (1.3, 1), (3.5, 4)):
        spec = SpecDecoding(geometric_probs(mean, k), 0.0)
        assert spec.drafts == k and sum(spec.probs) == pytest.approx(1.0, abs=1e-12)
        assert spec.mean_accepted_length == pytest.approx(mean, rel=1e-12)
        ps = spec.probs[:-1]  # each draft kept with the same chance given the ones before it
        assert all(ps[i + 1] / ps[i] == pytest.approx(ps[1] / ps[0], rel=1e-9) for i in range(len(ps) - 1))
    assert geometric_probs(3.0, 2) == (0.0, 0.0, 1.0) and geometric_probs(1.0, 2) == pytest.approx((1.0, 0.0, 0.0))
    with pytest.raises(ConfigError, match="a mean accepted length of 3.5 must be between 1 and drafts \\+ 1 \\(3\\)"):
        geometric_probs(3.5, 2)


@pytest.mark.parametrize("probs", [geometric_probs(2.0, 2), (0.3, 0.4, 0.3), (0.1, 0.2, 0.3, 0.4)])
def test_draws_have_the_distributions_mean_and_repeat_with_the_seed(probs):
    spec = SpecDecoding(probs, 0.0, seed=7)
    draws = spec.draws(200_000)
    assert set(np.unique(draws)) <= set(range(1, spec.drafts + 2))
    assert draws.mean() == pytest.approx(spec.mean_accepted_length, abs=0.01)
    counts = np.bincount(draws - 1, minlength=len(probs)) / len(draws)
    assert counts == pytest.approx(probs, abs=0.005)
    assert np.array_equal(draws, spec.draws(200_000))
    assert not np.array_equal(draws, SpecDecoding(probs, 0.0, seed=8).draws(200_000))


def test_a_simulation_keeps_the_mean_accepted_length_per_verify():
    # long outputs: the truncated last verify of each request barely shows
    trace = from_records([(0.01 * i, 50, 600) for i in range(40)])
    cfg = instance(speculative=SpecDecoding(geometric_probs(2.0, 2), 0.0, seed=3))
    got = simulate(trace, ClusterConfig("t", cfg), SLO(10, 10)).summary["speculative"]
    assert got["tokens_per_verify"] * got["verifies"] == pytest.approx(40 * 599, rel=1e-12)  # every decoded token
    assert got["tokens_per_verify"] == pytest.approx(2.0, abs=0.03)
    assert got["verifies"] == pytest.approx(40 * 599 / 2.0, rel=0.02)


# what a verify step costs and yields ---------------------------------------------------------------


def test_always_keeping_both_drafts_triples_the_tokens_of_a_decode_step():
    # 10 prompt tokens in one step, then 12 more tokens: one a step without speculation, three a
    # verify (3 rows) with two drafts always kept
    plain = run([(1.0, 10, 13)], instance())
    spec = run([(1.0, 10, 13)], instance(speculative=ALL_OF_TWO))
    assert plain.summary["steps"] == 1 + 12 and spec.summary["steps"] == 1 + 4
    assert plain.tpot[0] == exact(A + B)
    assert spec.tpot[0] == exact(4 * (A + 3 * B) / 12)
    assert spec.ttft[0] == exact(A + 10 * B) == plain.ttft[0]
    assert spec.summary["speculative"] == {"verifies": 4, "tokens_per_verify": 3.0}
    # 8 requests decoding together: 3 x 8 tokens per step; the output rate per decode step triples
    recs = [(0.0, 10, 25)] * 8
    plain, spec = run(recs, instance()), run(recs, instance(speculative=ALL_OF_TWO))
    assert plain.summary["steps"] == 1 + 24 and spec.summary["steps"] == 1 + 8
    assert (24 / (plain.summary["steps"] - 1)) * 3 == 24 / (spec.summary["steps"] - 1)
    assert spec.tpot[0] == exact(8 * (A + 24 * B) / 24)


def test_draft_passes_cost_their_share_of_a_step():
    # a step model without draft_pass: the module's first pass costs f of the step over the same
    # rows (the prefill step too: it writes the module's KV of the prompt), each chained pass f of
    # a step of one row per drafting request
    f = 0.1
    spec = SpecDecoding((0.0, 0.0, 1.0), draft_fraction=f)
    r = run([(1.0, 10, 13)], instance(speculative=spec))
    assert r.ttft[0] == exact((A + 10 * B) * (1 + f))
    assert r.tpot[0] == exact(4 * ((A + 3 * B) * (1 + f) + f * (A + B)) / 12)


def test_a_drafting_request_holds_room_for_its_drafts():
    # one-token pages, 8 prompt and 12 more tokens: before each verify a request holds its cached
    # positions and 4 more (its newest token, 2 drafts, the chained pass's position), never past
    # its output: 12, 15, 18, 20 pages for its 4 verifies. Without speculation it needs a page a step.
    rec = [(0.0, 8, 13)]

    def steps(pages: int, speculative=ALL_OF_TWO) -> tuple[int, str]:
        r = run(rec, instance(page_tokens=1, kv_pages=pages, speculative=speculative))
        return r.summary["steps"], r.outcome[0]

    assert steps(20) == (1 + 4, "ok")
    assert steps(12) == (1 + 1, "truncated")  # the second verify needs 15 pages
    assert steps(11) == (1, "truncated")  # the first verify needs 12
    assert steps(11, None) == (1 + 3, "truncated")  # 9, 10, 11 pages; the 12th is not there


def test_on_the_stage_model_a_uniform_verify_step_is_the_planners():
    # verify rows and the module's passes (one MoE layer and the head each) as deploy.estimate counts them
    ctx, seqs, k = 4096, 32, 2
    for model in ("deepseek-v3", "deepseek-v3.2"):
        sm = StageModel(MODELS[model], H800, H800, ctx, "bf16")
        est = estimate(sm, Deployment("afd", 48, 16, 2, seqs, mtp_steps=k, accept_length=2.0))
        step = StageStepTime(sm, "afd", 48, 16, 2, max_tokens=256)
        rows = (k + 1) * seqs
        verify = [(rows, rows, rows * ctx, 0.0) + ((rows * min(ctx, 2048), 0.0) if sm.model.attention.sparse else ())]
        chain = [(seqs, seqs, seqs * ctx, 0.0) + ((seqs * min(ctx, 2048), 0.0) if sm.model.attention.sparse else ())]
        spec = SpecDecoding(geometric_probs(2.0, k), 1 / 61)
        t, busy = step.step(verify * 48)
        extra, extra_busy = draft_time(step, spec, verify * 48, chain * 48, (t, busy))
        assert (t + extra) * 1e3 == pytest.approx(est.step_ms, rel=1e-9)
        assert extra > 0 and len(extra_busy) == 2


# every step's sums against a count from scratch ----------------------------------------------------


def _checked_decode_rows(checks: list):
    """DraftingRank._decode_rows, its decoders' KV lengths, attended positions and pages checked
    against each request's own laid-out decode."""
    plain = DraftingRank._decode_rows

    def decode_rows(self, s):
        rows = plain(self, s)
        decs = [r for r in self.running.values() if r.state == DECODE]
        lengths = [r.t0 + int(r.gains[s - r.s0]) for r in decs]
        assert rows == (self.k + 1) * len(decs) and self.ctx == sum(lengths)
        if self.K:
            assert self.attended == sum(min(x, self.K) for x in lengths)
            assert self.n_below == sum(x < self.K for x in lengths)
        # pages: cached blocks, prefilling requests' private tokens, and each decoder's private
        # positions, newest token, drafts and chained position (never past its output)
        held = 0
        for r in self.running.values():
            if r.state == DECODE:
                rem = r.output_len - r.g0
                held += -(-(r.u0 + min(int(r.gains[s - r.s0]) + 2 * self.k, rem)) // self.P)
            else:
                held += -(-r.priv // self.P)
        if self.role != "decode":  # (a PD decode rank also holds pages reserved for transfers)
            assert self.used == len(self.cache) * self.bp + held
        checks.append((sum(x < self.K for x in lengths), sum(x >= self.K for x in lengths)))
        return rows

    return decode_rows


@pytest.mark.parametrize("layout", ["colocated", "pd"])
@pytest.mark.parametrize("topk", [0, 256])
def test_drafting_ranks_track_lengths_attended_positions_and_pages(layout, topk, monkeypatch):
    """Decoders gain 1-3 tokens a step, cross top-k, are preempted (a small pool), finish, come
    back after a preemption from their own cached blocks or (PD) join after a KV transfer: every
    step's sums equal a count from scratch, and at the end every page not cached is free and every
    pending increment is spent."""
    checks: list[tuple[int, int]] = []
    monkeypatch.setattr(DraftingRank, "_decode_rows", _checked_decode_rows(checks))
    trace = poisson(10, 10, seed=1, lengths="sharegpt")  # outputs of hundreds of tokens
    spec = SpecDecoding((0.3, 0.3, 0.4), 0.0, seed=1)
    base = dict(step_time=LinearStepTime(0.01, 1e-4), page_tokens=4, max_batch_tokens=512, attention_topk=topk)
    small = InstanceConfig(ranks=2, kv_pages=300, max_running=64, speculative=spec, **base)
    if layout == "colocated":
        cluster = ClusterConfig("spec", small)
    else:
        prefill = InstanceConfig(ranks=1, kv_pages=4000, max_running=64, **base)
        cluster = ClusterConfig("spec-pd", prefill, small, KVLink(1000.0, 1e9, 1e-5))
    sim = Simulation(trace, cluster)
    sim.run()
    assert sum(r.preempts for r in sim.reqs) > 50 and sum(r.outcome == "ok" for r in sim.reqs) > 0.75 * len(sim.reqs)
    assert len(checks) > 500 and max(b + a for b, a in checks) > 5
    assert not topk or sum(below > 0 and above > 0 for below, above in checks) > 100
    for g in sim.groups:
        for rank in g.ranks:
            assert rank.used == len(rank.cache) * rank.bp == rank.evictable
            if isinstance(rank, DraftingRank):
                assert rank.n_dec == rank.ctx == rank.attended == rank.n_below == 0
                assert not (rank.d_ctx.any() or rank.d_att.any() or rank.d_below.any())


# V3.2's sparse attention in a simulated step -------------------------------------------------------


def test_simulated_v32_decode_pays_the_indexer_past_top_k_not_mla():
    # one request of 2 output tokens on a colocated EP16 instance: TPOT is its one decode step,
    # whose attention reads the whole prompt. Past index_topk V3.2's step grows with the indexer's
    # cost per position over all 61 layers; V3's with MLA's, nine times that or more.
    def tpot(model: str, prompt: int) -> float:
        b = BuildOptions(model=get_model(model), hw=get_hardware, attn_dtype="bf16")
        cluster = build_cluster(parse_spec("colocated:gpus=16"), b)
        assert cluster.serving.attention_topk == (2048 if model == "deepseek-v3.2" else 0)
        return simulate(from_records([(0.0, prompt, 2)]), cluster, SLO(100, 100)).tpot[0]

    sm = StageModel(MODELS["deepseek-v3.2"], H800, H800, 4096, "bf16")
    grow = 61 * (40000 - 20000) * 1e-6
    v32 = tpot("deepseek-v3.2", 40000) - tpot("deepseek-v3.2", 20000)
    v3 = tpot("deepseek-v3", 40000) - tpot("deepseek-v3", 20000)
    assert v32 == pytest.approx(grow * sm.indexed_position_us(), rel=1e-6)
    assert v3 == pytest.approx(grow * sm.attended_position_us(), rel=1e-6) and v32 < v3 / 9
    # below top-k both grow with MLA (V3.2 with the indexer on top)
    below = tpot("deepseek-v3.2", 2000) - tpot("deepseek-v3.2", 1000)
    per = sm.indexed_position_us() + sm.attended_position_us()
    assert below == pytest.approx(61 * 1000 * 1e-6 * per, rel=1e-6)


# the command line ----------------------------------------------------------------------------------

SIM = ["plan", "simulate", "--poisson", "2", "--duration", "3", "--lengths", "fixed:200,20", "--json", "-"]
PD = "pd:prefill=[colocated:gpus=16],decode=[colocated:gpus=16]"


def _cli(capsys, *args) -> dict:
    assert main([*SIM, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_flags_set_the_distribution_and_report_it(capsys):
    off = _cli(capsys, "--deployment", PD)
    assert "speculative" not in off and "speculative" not in off["deployments"][0]
    on = _cli(capsys, "--deployment", PD, "--spec-drafts", "2", "--spec-accepted-length", "2.0")
    sp = on["speculative"]
    assert sp["drafts"] == 2 and sp["mean_accepted_length"] == pytest.approx(2.0)
    assert sp["accepted_drafts_probs"] == pytest.approx(list(geometric_probs(2.0, 2)))
    assert sp["draft_cost"] == "one MoE layer and the head per draft pass (stage model)"
    assert on["deployments"][0]["speculative"]["verifies"] > 0
    assert on["deployments"][0]["tpot_s"]["p50"] < off["deployments"][0]["tpot_s"]["p50"]
    hist = _cli(capsys, "--deployment", PD, "--spec-accepted-histogram", "0.2,0.3,0.1,0.4")
    assert hist["speculative"]["drafts"] == 3 and hist["speculative"]["mean_accepted_length"] == pytest.approx(2.7)
    # bench_spec's file: the mean of its accepted lengths at that many steps, over concurrencies
    path = "benchmarks/results/spec_single_2026-11-28.json"
    bench = _cli(capsys, "--deployment", PD, "--spec-drafts", "2", "--spec-from", path)
    rows = [r["accepted_length"] for r in json.load(open(path))["results"] if r["steps"] == 2]
    assert bench["speculative"]["mean_accepted_length"] == pytest.approx(sum(rows) / len(rows))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--spec-accepted-length", "2"], "--spec-accepted-length and --spec-from need --spec-drafts K"),
        (["--spec-drafts", "2"], "--spec-drafts needs the acceptance"),
        (["--spec-drafts", "2", "--spec-accepted-length", "2", "--spec-accepted-histogram", "0.5,0.5"], "give one of"),
        (["--spec-accepted-histogram", "0.5,0.6"], "numbers >= 0 that sum to 1"),
        (["--spec-drafts", "1", "--spec-accepted-histogram", "0.2,0.3,0.5"], "has 3 entries .* --spec-drafts is 1"),
        (["--spec-drafts", "2", "--spec-accepted-length", "3.2"], "between 1 and drafts \\+ 1 \\(3\\)"),
        (["--spec-drafts", "9", "--spec-from", "benchmarks/results/spec_single_2026-11-28.json"], "at 9 steps"),
        (["--spec-drafts", "15", "--spec-accepted-length", "2"], "256 running requests x 16 verify rows"),
    ],
)
def test_cli_refuses_bad_speculation_flags_in_one_line(capsys, args, message):
    assert main([*SIM, "--deployment", "colocated:gpus=16", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("afd plan simulate: error: ") and "\n" not in err
    assert re.search(message, err), err
