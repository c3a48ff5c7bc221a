"""`afd plan simulate`: the command's run (every deployment on the workload, a rate sweep, JSON and
a plot) and its human report."""

from __future__ import annotations

import argparse
import math
import time

from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration
from afd_engine.planner.plot import plot_attainment
from afd_engine.planner.sim.cluster import ClusterConfig, InstanceConfig
from afd_engine.planner.sim.results import SLO, simulate
from afd_engine.planner.sim.spec import BuildOptions, build_cluster, parse_spec
from afd_engine.planner.sim.speculative import from_flags
from afd_engine.planner.step_calibration import StepCalibration
from afd_engine.planner.traces import Trace

DEFAULT_SWEEP = (0.25, 0.5, 1.0, 2.0)


def parse_rates(text: str) -> list[float]:
    """`--rates 0.5,1,2` -> [0.5, 1.0, 2.0] (positive numbers)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise ConfigError(f"--rates {text!r}: give positive numbers separated by commas, e.g. 0.5,1,2")
    return sorted(set(rates))


def _load_trace(ns: argparse.Namespace, rate_scale: float) -> Trace:
    from afd_engine.planner.traces import load_mooncake, poisson

    if ns.trace:
        return load_mooncake(ns.trace, rate_scale, ns.length_scale, ns.limit)
    if ns.duration is None:
        raise ConfigError("--poisson RATE needs --duration SECONDS")
    return poisson(ns.poisson * rate_scale, ns.duration, ns.seed, ns.lengths, ns.length_scale)


def run_cli(ns: argparse.Namespace) -> dict:
    """`afd plan simulate`: every --deployment on the trace, at --rate-scale and, for --rates or
    --plot, at each rate of the sweep; JSON to --json PATH (or stdout with '-'), PNG to --plot."""
    from afd_engine.planner.hardware import get_hardware, load_hardware_file
    from afd_engine.planner.model_spec import get_model
    from afd_engine.planner.traces import check_scale

    if ns.trace and ns.poisson is not None:
        raise ConfigError("give either --trace FILE or --poisson RATE, not both")
    if not ns.trace and ns.poisson is None:
        raise ConfigError("give a workload: --trace FILE (Mooncake JSONL) or --poisson RATE --duration SECONDS")
    check_scale(ns.rate_scale, "--rate-scale")
    if ns.limit is not None and ns.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {ns.limit})")
    if ns.ttft_slo <= 0 or ns.tpot_slo <= 0:
        raise ConfigError("--ttft-slo and --tpot-slo must be > 0 (milliseconds)")
    specs = [parse_spec(s) for s in ns.deployment]
    model = get_model(ns.model)
    speculative = from_flags(
        ns.spec_drafts,
        ns.spec_accepted_length,
        ns.spec_accepted_histogram,
        ns.spec_from,
        ns.spec_seed,
        1 / model.layers,  # a draft pass: one layer of the model's (speculative.py)
    )
    extra = load_hardware_file(ns.hw_file) if ns.hw_file else None
    build = BuildOptions(
        model=model,
        hw=lambda name: get_hardware(name, extra),
        attn_dtype=ns.attn_dtype or model.default_attn_dtype,
        weight_dtype=ns.weight_dtype,
        calibration=Calibration.load(ns.calibration) if ns.calibration else None,
        step_calibration=StepCalibration.load(ns.step_calibration) if ns.step_calibration else None,
        expert_imbalance=ns.expert_imbalance,
        index_dtype=ns.index_cache_dtype,
        page_tokens=ns.page_size,
        max_batch_tokens=ns.max_num_batched_tokens,
        max_running=ns.max_running_requests,
        policy=ns.schedule_policy,
        kv_pages=ns.kv_pages,
        prefix_cache=not ns.no_prefix_cache,
        router=ns.router,
        speculative=speculative,
    )
    clusters = [build_cluster(s, build) for s in specs]
    slo = SLO(ns.ttft_slo / 1e3, ns.tpot_slo / 1e3)
    trace = _load_trace(ns, ns.rate_scale)
    wall = time.perf_counter()
    results = [simulate(trace, c, slo) for c in clusters]
    out: dict = {
        "model": model.name,
        "stage_times": (
            f"fitted to this engine's steps ({ns.step_calibration})"
            if build.step_calibration
            else f"measured ({ns.calibration}: {build.calibration.source or 'no source given'})"
            if build.calibration
            else "roofline (planner efficiency factors)"
        ),
        "router": build.router,
        "trace": trace.summary(),
        "deployments": [{**r.as_dict(), **_describe(c)} for r, c in zip(results, clusters)],
    }
    if speculative is not None:
        out["speculative"] = _describe_spec(speculative, clusters)
    if ns.rates or ns.plot:
        scales = parse_rates(ns.rates) if ns.rates else list(DEFAULT_SWEEP)
        sweep: dict[str, list[dict]] = {c.name: [] for c in clusters}
        for scale in scales:
            t = _load_trace(ns, ns.rate_scale * scale)
            for c in clusters:
                d = simulate(t, c, slo).as_dict()
                sweep[c.name].append(
                    {
                        "rate_scale": ns.rate_scale * scale,
                        "request_rate_rps": t.rate,
                        **{k: d[k] for k in ("attainment", "goodput_rps", "goodput_rps_per_gpu", "wall_s")},
                        "ttft_p90_s": d["ttft_s"]["p90"],
                        "tpot_p90_s": d["tpot_s"]["p90"],
                    }
                )
        out["sweep"] = sweep
        if ns.plot:
            plot_attainment(sweep, {c.name: c.gpus for c in clusters}, slo, ns.plot, f"{model.name}, {trace.source}")
            out["plot"] = ns.plot
    out["wall_s"] = time.perf_counter() - wall
    if ns.json_path == "-":
        ns.json = True  # (the caller prints JSON only)
    elif ns.json_path:
        import json

        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        out["json"] = ns.json_path
    return out


def _describe_spec(spec, clusters: list[ClusterConfig]) -> dict:
    """The speculative decoding simulated, and what a draft pass costs."""
    priced = all(hasattr((c.decode or c.serving).step_time, "draft_pass") for c in clusters)
    cost = (
        "one MoE layer and the head per draft pass (stage model)"
        if priced
        else f"{spec.draft_fraction:.4g} of a step per draft pass (one of the model's layers)"
    )
    return {**spec.as_dict(), "draft_cost": cost}


def _describe(c: ClusterConfig) -> dict:
    """The instances behind a result, for the report."""

    def one(cfg: InstanceConfig) -> dict:
        return {
            "instances": cfg.replicas,
            "attention_ranks": cfg.ranks,
            "gpus_per_instance": cfg.gpus or cfg.ranks,
            "kv_pages_per_rank": cfg.kv_pages,
            "kv_tokens_per_rank": cfg.kv_pages * cfg.page_tokens,
            "max_batch_tokens": cfg.max_batch_tokens,
            "max_running": cfg.max_running,
            "policy": cfg.policy,
        }

    if c.decode is None:
        return {"layout": one(c.serving)}
    link = c.kv_link
    return {
        "layout": {"prefill": one(c.serving), "decode": one(c.decode)},
        "kv_link": {"gb_per_s": link.bandwidth_bps / 1e9, "latency_us": link.latency_s * 1e6},
    }


def print_report(out: dict) -> None:
    """The human table of `afd plan simulate`."""
    tr = out["trace"]
    print(
        f"{out['model']}; trace {tr['source']}: {tr['requests']} requests over {tr['span_s']:.0f} s "
        f"({tr['rate_rps']:.2f}/s), mean prompt {tr['mean_input']:.0f}, mean output {tr['mean_output']:.0f} tokens"
    )
    print(f"stage times: {out['stage_times']}; router: {out['router']}")
    d0 = out["deployments"][0]
    slo = d0["slo"]
    print(f"SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= {slo['tpot_s'] * 1e3:g} ms")
    if "speculative" in out:
        sp = out["speculative"]
        probs = ", ".join(f"{p:.3f}" for p in sp["accepted_drafts_probs"])
        print(
            f"speculative decoding: {sp['drafts']} drafts per verify, P(accept 0..{sp['drafts']}) = {probs} "
            f"(mean accepted length {sp['mean_accepted_length']:.3f}; {sp['source']}); {sp['draft_cost']}"
        )
    print(
        f"{'deployment':<44} {'GPUs':>4} {'TTFT p50/p90/p99 s':>20} {'TPOT p50/p90/p99 ms':>20} "
        f"{'E2E p50/p99 s':>14} {'SLO%':>5} {'good/s':>7} {'good/s/GPU':>10} {'wall s':>6}"
    )

    def trio(p: dict, k: float, keys=("p50", "p90", "p99")) -> str:
        return "/".join("-" if p[x] is None else f"{p[x] * k:.{0 if p[x] * k >= 100 else 1}f}" for x in keys)

    for d in out["deployments"]:
        print(
            f"{d['name'][:44]:<44} {d['gpus']:>4} {trio(d['ttft_s'], 1):>20} {trio(d['tpot_s'], 1e3):>20} "
            f"{trio(d['e2e_s'], 1, ('p50', 'p99')):>14} {100 * d['attainment']:>5.1f} {d['goodput_rps']:>7.3f} "
            f"{d['goodput_rps_per_gpu']:>10.4f} {d['wall_s']:>6.1f}"
        )
    for d in out["deployments"]:
        util = ", ".join(f"{k} {100 * v:.0f}%" for k, v in d["utilisation"].items())
        notes = [f"{d[k]} {k}" for k in ("rejected", "truncated", "unfinished") if d[k]]
        sp = d.get("speculative")
        if sp and sp["tokens_per_verify"] is not None:
            notes.append(f"{sp['tokens_per_verify']:.3f} tokens kept per verify")
        print(
            f"  {d['name']}: busy {util}; prefix hits {100 * d['prefix_hit_rate']:.0f}% of prompt tokens; "
            f"{d['preemptions']} preemptions; {d['steps']} steps" + (f"; {', '.join(notes)}" if notes else "")
        )
    for name, points in out.get("sweep", {}).items():
        row = ", ".join(f"{p['request_rate_rps']:.2f}/s: {100 * p['attainment']:.0f}%" for p in points)
        print(f"  sweep {name}: SLO attainment {row}")
    if "plot" in out:
        print(f"plot: {out['plot']}")
    if "json" in out:
        print(f"json: {out['json']}")
    print(f"simulation wall time: {out['wall_s']:.1f} s")
