"""`simulate`: one run of a deployment on a trace, and what it measured against an SLO."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from afd_engine.errors import ConfigError
from afd_engine.planner.sim.cluster import ClusterConfig
from afd_engine.planner.sim.drafting_rank import DraftingRank
from afd_engine.planner.sim.loop import Simulation
from afd_engine.planner.sim.request import INF
from afd_engine.planner.traces import Trace


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


def _pcts(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class SimResult:
    """Per-request times (seconds; inf where a request never got there) and the summary."""

    name: str
    gpus: int
    arrival: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray  # nan for single-token answers
    e2e: np.ndarray
    outcome: list[str]
    preemptions: np.ndarray
    summary: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "gpus": self.gpus, **self.summary}


def simulate(trace: Trace, cluster: ClusterConfig, slo: SLO) -> SimResult:
    """Runs `cluster` on `trace` and measures every request against `slo`."""
    if not trace.requests:
        raise ConfigError("the trace has no requests")
    wall = time.perf_counter()
    sim = Simulation(trace, cluster)
    sim.run()
    wall = time.perf_counter() - wall
    reqs = sim.reqs
    arrival = np.array([r.arrival for r in reqs])
    # what a client sees: every token reaches it `response_s` after the step that made it ended
    first = np.array([r.first for r in reqs]) + cluster.response_s
    finish = np.array([r.finish if r.outcome == "ok" else INF for r in reqs]) + cluster.response_s
    outs = np.array([r.output_len for r in reqs])
    ok = np.array([r.outcome == "ok" for r in reqs])
    ttft = np.where(ok, first - arrival, INF)
    e2e = np.where(ok, finish - arrival, INF)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outs > 1, (finish - first) / np.maximum(outs - 1, 1), np.nan)
    tpot = np.where(ok, tpot, np.where(outs > 1, INF, np.nan))
    meet_ttft = ttft <= slo.ttft_s
    meet_tpot = np.where(np.isnan(tpot), True, tpot <= slo.tpot_s)
    good = meet_ttft & meet_tpot
    end = max([g.last_end for g in sim.groups] + [float(np.max(np.where(ok, finish, -INF), initial=0.0))])
    span = max(end, float(arrival.max())) - float(arrival.min())  # first arrival to last step
    # goodput is over the window requests arrived in (the offered load's): rate x attainment
    window = float(arrival.max() - arrival.min()) or span
    n = len(reqs)
    gpus = cluster.gpus
    util: dict[str, float] = {}
    for cfg, role in ((cluster.serving, "prefill" if cluster.decode else ""), (cluster.decode, "decode")):
        if cfg is None:
            continue
        groups = [g for g in sim.groups if g.cfg is cfg]
        prefix = f"{role}." if role else ""
        util[f"{prefix}stepping"] = sum(g.stepping_s for g in groups) / len(groups) / span if span > 0 else 0.0
        for k, name in enumerate(cfg.step_time.roles):
            busy = sum(g.role_busy[k] for g in groups) / len(groups)
            util[f"{prefix}{name}"] = busy / span if span > 0 else 0.0
    ranks = [r for g in sim.groups for r in g.ranks]
    prompt = sum(r.prompt_tokens for r in ranks)
    finite = np.isfinite
    summary = {
        "requests": n,
        "completed": int(ok.sum()),
        "rejected": sum(r.outcome == "rejected" for r in reqs),
        "truncated": sum(r.outcome == "truncated" for r in reqs),
        "unfinished": sum(r.outcome == "unfinished" for r in reqs),
        "request_rate_rps": trace.rate,
        "span_s": span,
        "ttft_s": _pcts(ttft[finite(ttft)]),
        "tpot_s": _pcts(tpot[finite(tpot)]),
        "e2e_s": _pcts(e2e[finite(e2e)]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "attainment": float(good.mean()),
        "ttft_attainment": float(meet_ttft.mean()),
        "tpot_attainment": float((meet_tpot & ok).mean()),
        "goodput_rps": float(good.sum()) / window if window > 0 else 0.0,
        "goodput_rps_per_gpu": float(good.sum()) / window / gpus if window > 0 else 0.0,
        "output_tokens_per_s": float(outs[ok].sum()) / span if span > 0 else 0.0,
        "utilisation": util,
        "preemptions": sum(r.preemptions for r in ranks),
        "prefix_hit_rate": sum(r.hit_tokens for r in ranks) / prompt if prompt else 0.0,
        "evicted_pages": sum(r.evicted for r in ranks),
        "steps": sum(g.steps for g in sim.groups),
        "prefill_steps": sum(g.prefill_steps for g in sim.groups),
        "wall_s": wall,
    }
    drafting = [r for r in ranks if isinstance(r, DraftingRank)]
    if drafting:  # what the draws gave (a request's last verify keeps only what its output needs)
        verifies = sum(r.verifies for r in drafting)
        kept = sum(r.spec_tokens for r in drafting)
        summary["speculative"] = {"verifies": verifies, "tokens_per_verify": kept / verifies if verifies else None}
    return SimResult(
        cluster.name,
        gpus,
        arrival,
        ttft,
        tpot,
        e2e,
        [r.outcome for r in reqs],
        np.array([r.preempts for r in reqs]),
        summary,
    )
