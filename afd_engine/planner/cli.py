"""`afd plan`: the performance model from the command line (human tables, or --json for scripts)."""

from __future__ import annotations

import argparse
import json
import sys

from afd_engine.arg_errors import ArgumentParser
from afd_engine.errors import AFDError, ConfigError
from afd_engine.planner.calibration import Calibration, calibrate
from afd_engine.planner.deploy import Estimate
from afd_engine.planner.expert_load import load_expert_imbalance
from afd_engine.planner.hardware import get_hardware, load_hardware_file
from afd_engine.planner.model_spec import INDEX_DTYPES, MODELS, get_model
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.search import SearchSpace, search
from afd_engine.planner.sparsity import min_sparsity
from afd_engine.planner.stages import StageModel


def _hw(ns, name: str):
    extra = load_hardware_file(ns.hw_file) if ns.hw_file else None
    return get_hardware(name, extra)


def _comm(ns) -> dict:
    hw = _hw(ns, ns.hw)
    symmetric = ns.attn_gpus is None
    mode = ns.dispatch or ("direct" if symmetric else "two-stage")
    if symmetric and mode == "two-stage":
        raise ConfigError("--dispatch two-stage needs --attn-gpus (AFD: attention GPUs sending to --ep-size F GPUs)")
    case = CommCase(
        tokens=ns.tokens,
        hidden=ns.hidden,
        topk=ns.topk,
        experts=ns.experts,
        senders=ns.ep_size if symmetric else ns.attn_gpus,
        receivers=ns.ep_size,
        mode=mode,
        dispatch_dtype=ns.dispatch_dtype,
        combine_dtype=ns.combine_dtype,
        symmetric=symmetric,
    )
    if ns.topk > ns.experts or ns.ep_size > ns.experts or ns.ep_size < 1:
        raise ConfigError("need 1 <= --topk <= --experts and 1 <= --ep-size <= --experts")
    out = comm_time(case, hw).as_dict()
    return {**out, "layout": "colocated EP (symmetric)" if symmetric else "AFD (attention -> F)", "mode": mode}


def _expert_imbalance(ns) -> tuple[float, str]:
    """The factor and where it came from (argparse keeps the two flags exclusive)."""
    if ns.expert_load:
        value, key = load_expert_imbalance(ns.expert_load)
        return value, f"{ns.expert_load}: {key}"
    if ns.expert_imbalance is not None:
        return ns.expert_imbalance, "--expert-imbalance"
    return StageModel.expert_imbalance, "default: balanced routing"


def _stage_model(ns, model, expert_imbalance: float) -> StageModel:
    attn_hw = _hw(ns, ns.attn_hw)
    ffn_hw = _hw(ns, ns.ffn_hw) if ns.ffn_hw else attn_hw
    calib = Calibration.load(ns.calibration) if ns.calibration else None
    attn_dtype = ns.attn_dtype or model.default_attn_dtype
    return StageModel(
        model,
        attn_hw,
        ffn_hw,
        ns.context,
        attn_dtype,
        calib,
        ns.weight_dtype,
        expert_imbalance=expert_imbalance,
        index_dtype=ns.index_cache_dtype,
    )


def _space(ns, mode: str) -> SearchSpace:
    def ints(v):
        return tuple(v) if v else None

    return SearchSpace(
        attn_gpus=ints(ns.attn_gpus),
        ffn_gpus=ints(ns.ffn_gpus) if mode == "afd" else None,
        micro_batches=ints(ns.micro_batches),
        total_gpus=ns.gpus,
        dispatch=ns.dispatch,
        shared_expert=("attention", "ffn") if ns.shared_expert == "any" else (ns.shared_expert,),
        mtp_steps=ns.mtp_steps,
        accept_length=_accept_length(ns),
    )


# speculative decoding's accepted length (tokens per request and step) as published for DeepSeek-V3's
# MTP module: vLLM, 81-82% acceptance at one draft token; SGLang, 2.18 with three draft tokens
# (two chained steps and the target's token)
PUBLISHED_ACCEPT_LENGTH = {0: 1.0, 1: 1.81, 2: 2.18}


def _accept_length(ns) -> float:
    if ns.mtp_accept_length is not None:
        return ns.mtp_accept_length
    if ns.mtp_steps not in PUBLISHED_ACCEPT_LENGTH:
        raise ConfigError(
            f"--mtp-steps {ns.mtp_steps} has no published accepted length; give --mtp-accept-length "
            "(benchmarks/bench_spec.py measures one)"
        )
    return PUBLISHED_ACCEPT_LENGTH[ns.mtp_steps]


def _best(sm: StageModel, ns, mode: str) -> list[Estimate]:
    found = search(sm, mode, ns.tpot_slo_ms, _space(ns, mode))
    if not found:
        raise ConfigError(
            f"no {mode} deployment of {sm.model.name} meets TPOT <= {ns.tpot_slo_ms} ms at context "
            f"{sm.context} on {sm.attn_hw.name} within memory; raise --tpot-slo-ms, shorten "
            "--context or allow more GPUs"
        )
    return found


def _deploy(ns) -> dict:
    model = get_model(ns.model)
    imbalance, imbalance_source = _expert_imbalance(ns)
    sm = _stage_model(ns, model, imbalance)
    modes = ("afd", "colocated") if ns.mode == "both" else (ns.mode,)
    out = {}
    for mode in modes:
        found = _best(sm, ns, mode)
        out[mode] = {**found[0].as_dict(), "alternatives": [e.as_dict() for e in found[1 : ns.top]]}
    if ns.plot:
        from afd_engine.planner.plot import plot_frontier

        plot_frontier(sm, {m: _space(ns, m) for m in modes}, ns.plot, ns.tpot_slo_ms)
    stages = (
        f"measured ({ns.calibration}: {sm.calibration.source or 'no source given'})"
        if sm.calibration
        else f"roofline ({sm.attn_hw.name} efficiency factors)"
    )
    info = {
        "model": model.name,
        "context": ns.context,
        "attn_dtype": sm.attn_dtype,
        "index_cache_dtype": sm.index_dtype if model.attention.sparse else None,
        "stage_times": stages,
        "expert_imbalance": sm.expert_imbalance,
        "expert_imbalance_source": imbalance_source,
    }
    if len(modes) == 1:
        return {**out[modes[0]], **info}
    ratio = out["afd"]["tokens_per_gpu_s"] / out["colocated"]["tokens_per_gpu_s"]
    return {**out, **info, "afd_over_colocated_per_gpu": ratio}


def _model(ns) -> dict:
    from afd_engine.planner.footprint import footprint

    hw = _hw(ns, ns.hw)
    if ns.ffn_gpus < 1:
        raise ConfigError(f"--ffn-gpus must be >= 1 (got {ns.ffn_gpus})")
    if any(c < 1 for c in ns.contexts):
        raise ConfigError(f"--contexts must be >= 1 (got {ns.contexts})")
    rows = []
    for name in ns.model:
        m = get_model(name)
        attn_dtype = ns.attn_dtype or m.default_attn_dtype
        rows.append(
            footprint(m, hw, ns.ffn_gpus, attn_dtype, ns.weight_dtype, ns.index_cache_dtype, tuple(ns.contexts))
        )
    return {"hw": hw.name, "mem_gb": hw.mem_gb, "models": rows}


def _sparsity(ns) -> dict:
    return min_sparsity(_hw(ns, ns.hw), ns.hidden, ns.layers, ns.tpot_ms, ns.stages).as_dict()


def _reference(ns) -> dict:
    from afd_engine.planner.reference import checks

    rows = [c.as_dict() for c in checks()]
    return {"checks": rows, "all_ok": all(r["ok"] for r in rows)}


def _calibrate(ns) -> dict:
    calib = calibrate(ns.timeline, source=ns.source or "", skip_steps=ns.skip_steps)
    with open(ns.out, "w") as f:
        f.write(calib.to_json() + "\n")
    return json.loads(calib.to_json())


MODEL_HELP = f"a catalog name ({', '.join(MODELS)}), a checkpoint directory or a config.json"
INDEX_HELP = (
    "DeepSeek-V3.2: precision of the indexer's keys in the KV cache and of its scores: fp8 (e4m3 and an "
    "fp32 scale per token, as the reference runs on GPUs; the engine's --index-cache-dtype fp8) or bf16"
)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="afd plan", description="performance model of AFD and colocated deployments")
    sub = p.add_subparsers(dest="what", required=True)

    def common(sp):
        sp.add_argument("--json", action="store_true", help="print JSON only")
        sp.add_argument("--hw-file", default=None, help="YAML with more hardware (see planner README)")

    c = sub.add_parser("comm", help="dispatch and combine time of one micro-batch")
    c.add_argument("--hw", default="H800")
    c.add_argument("--ep-size", type=int, required=True, help="GPUs holding the routed experts")
    c.add_argument(
        "--attn-gpus",
        type=int,
        default=None,
        help="AFD: attention GPUs sending (default: colocated EP, every EP rank sends)",
    )
    c.add_argument("--tokens", type=int, default=128, help="tokens per sending GPU")
    c.add_argument("--hidden", type=int, default=7168)
    c.add_argument("--topk", type=int, default=8)
    c.add_argument("--experts", type=int, default=256)
    c.add_argument(
        "--dispatch",
        choices=("direct", "two-stage"),
        default=None,
        help="default: two-stage for AFD, direct for colocated",
    )
    c.add_argument("--dispatch-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    c.add_argument("--combine-dtype", default="bf16", choices=("bf16", "fp32"))
    common(c)

    d = sub.add_parser("deploy", help="best deployments under a TPOT SLO")
    d.add_argument("--model", default="deepseek-v3", help=MODEL_HELP)
    d.add_argument("--mode", choices=("afd", "colocated", "both"), default="both")
    d.add_argument("--attn-hw", default="H800", help="hardware of attention GPUs (colocated: of all GPUs)")
    d.add_argument("--ffn-hw", default=None, help="hardware of FFN GPUs (default: --attn-hw)")
    d.add_argument("--context", type=int, default=4096, help="average cached tokens per sequence")
    d.add_argument("--tpot-slo-ms", type=float, default=50.0)
    d.add_argument("--gpus", type=int, default=None, help="exactly this many GPUs in all")
    d.add_argument(
        "--attn-dtype",
        choices=("fp8", "bf16"),
        default=None,
        help="attention core and KV cache precision (default: the model's usual one)",
    )
    d.add_argument(
        "--weight-dtype",
        choices=("fp8", "bf16"),
        default="fp8",
        help="weights of projections, experts and dense FFNs (fp8: 8-bit)",
    )
    d.add_argument("--index-cache-dtype", choices=tuple(INDEX_DTYPES), default="fp8", help=INDEX_HELP)
    d.add_argument(
        "--attn-gpus",
        type=int,
        nargs="+",
        default=None,
        help="attention GPU candidates; colocated: GPU counts (default: 1-16 nodes; colocated 8-256)",
    )
    d.add_argument("--ffn-gpus", type=int, nargs="+", default=None, help="AFD FFN GPU candidates (default: 1-16 nodes)")
    d.add_argument("--micro-batches", type=int, nargs="+", default=None, help="candidates (AFD 1-4, colocated 1-2)")
    d.add_argument("--dispatch", choices=("direct", "two-stage"), default="two-stage")
    d.add_argument(
        "--shared-expert", choices=("attention", "ffn", "any"), default="any", help="AFD: where the shared expert runs"
    )
    d.add_argument("--calibration", default=None, help="measured stage times from `afd plan calibrate`")
    skew = d.add_mutually_exclusive_group()
    skew.add_argument(
        "--expert-imbalance",
        type=float,
        metavar="FLOAT",
        default=None,
        help="max over mean token load of the expert ranks, >= 1.0; scales the busiest rank's "
        "routed-expert work and the traffic into it (default: 1.0, balanced routing)",
    )
    skew.add_argument(
        "--expert-load",
        default=None,
        metavar="FILE",
        help="read --expert-imbalance from JSON: 'imbalance_after' (benchmarks/bench_eplb.py --json), "
        "else 'imbalance' (afd expert-load)",
    )
    d.add_argument(
        "--mtp-steps",
        type=int,
        default=0,
        help="speculative decoding with the MTP module: drafts per request and step (0: off)",
    )
    d.add_argument(
        "--mtp-accept-length",
        type=float,
        default=None,
        help="tokens kept per request and step (accepted drafts + 1; default: the published figure for "
        "--mtp-steps 1 or 2)",
    )
    d.add_argument("--top", type=int, default=5, help="alternatives to list")
    d.add_argument("--plot", default=None, help="write the throughput-vs-TPOT frontier to this PNG")
    common(d)

    o = sub.add_parser("model", help="parameters, KV bytes per token and weights per GPU role of models")
    o.add_argument("--model", nargs="+", default=["deepseek-v3"], help=MODEL_HELP + " (several: one row each)")
    o.add_argument("--hw", default="H800")
    o.add_argument("--ffn-gpus", type=int, default=16, help="GPUs holding the routed experts")
    o.add_argument("--attn-dtype", choices=("fp8", "bf16"), default=None, help="KV cache (default: the model's usual)")
    o.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8")
    o.add_argument("--index-cache-dtype", choices=tuple(INDEX_DTYPES), default="fp8", help=INDEX_HELP)
    o.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also the decode attention core's time per token and layer at these average contexts",
    )
    common(o)

    s = sub.add_parser("sparsity", help="Step-3's minimum MoE sparsity a platform can feed")
    s.add_argument("--hw", default="H800")
    s.add_argument("--hidden", type=int, default=7168)
    s.add_argument("--layers", type=int, default=61)
    s.add_argument("--tpot-ms", type=float, default=50.0)
    s.add_argument("--stages", type=int, default=3)
    common(s)

    r = sub.add_parser("reference", help="the published figures next to what the model computes")
    common(r)

    k = sub.add_parser("calibrate", help="fit stage times from a --record-timeline run of this engine")
    k.add_argument("--timeline", required=True, help="the PREFIX given to --record-timeline")
    k.add_argument("--out", required=True, help="calibration JSON to write")
    k.add_argument("--source", default=None, help="what was measured (model, hardware, context)")
    k.add_argument("--skip-steps", type=int, default=1, help="warm-up steps to leave out")
    common(k)
    _simulate_parser(sub)
    return p


def _simulate_parser(sub) -> None:
    from afd_engine.planner.sim.spec import SPEC_HELP

    v = sub.add_parser(
        "simulate",
        help="discrete-event simulation of deployments serving a request trace",
        description="Simulates each --deployment serving a trace (continuous batching, prefix cache, "
        "preemption, PD transfer) and reports TTFT, TPOT, SLO attainment and goodput.",
        epilog=SPEC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("--trace", default=None, metavar="FILE", help="Mooncake-format JSONL trace")
    v.add_argument("--poisson", type=float, default=None, metavar="RATE", help="synthetic Poisson arrivals, req/s")
    v.add_argument("--duration", type=float, default=None, metavar="S", help="--poisson: seconds of arrivals")
    v.add_argument("--lengths", default="sharegpt", help="--poisson: fixed:IN,OUT or sharegpt (log-normal)")
    v.add_argument("--seed", type=int, default=0, help="--poisson: random seed")
    v.add_argument("--limit", type=int, default=None, metavar="N", help="--trace: only its first N requests")
    v.add_argument(
        "--deployment", action="append", required=True, metavar="SPEC", help="repeat to compare (SPEC below)"
    )
    v.add_argument("--model", default="deepseek-v3", help=MODEL_HELP)
    v.add_argument("--attn-dtype", choices=("fp8", "bf16"), default=None, help="default: the model's usual one")
    v.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8")
    v.add_argument("--index-cache-dtype", choices=tuple(INDEX_DTYPES), default="fp8", help=INDEX_HELP)
    v.add_argument("--rate-scale", type=float, default=1.0, help="arrival times divided by this")
    v.add_argument("--length-scale", type=float, default=1.0, help="prompt and output lengths multiplied by this")
    v.add_argument("--ttft-slo", type=float, default=5000.0, metavar="MS", help="time to first token SLO")
    v.add_argument("--tpot-slo", type=float, default=50.0, metavar="MS", help="time per output token SLO")
    v.add_argument("--calibration", default=None, help="measured stage times from `afd plan calibrate`")
    v.add_argument(
        "--step-calibration",
        default=None,
        metavar="FILE",
        help="step time fitted to this engine's --record-steps runs (JSON of planner/step_calibration.py)",
    )
    v.add_argument("--expert-imbalance", type=float, default=1.0, metavar="FLOAT", help="EPLB max/mean load, >= 1")
    v.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step per rank")
    v.add_argument("--max-running-requests", type=int, default=256, help="running requests per rank")
    v.add_argument("--schedule-policy", choices=("lpm", "fcfs"), default="lpm")
    v.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    v.add_argument("--kv-pages", type=int, default=None, help="KV pages per rank (default: memory left by weights)")
    v.add_argument("--no-prefix-cache", action="store_true", help="never reuse cached prefixes")
    v.add_argument(
        "--router",
        choices=("cache_aware", "shortest_queue", "round_robin"),
        default="cache_aware",
        help="which rank takes a request, as the engine's --load-balance-method",
    )
    v.add_argument(
        "--spec-drafts",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding with the MTP module: drafts per verify (with one of the acceptance flags below)",
    )
    v.add_argument(
        "--spec-accepted-length",
        type=float,
        default=None,
        metavar="MEAN",
        help="mean tokens kept per verify (accepted drafts + 1), as a truncated geometric distribution",
    )
    v.add_argument(
        "--spec-accepted-histogram",
        default=None,
        metavar="P0,P1,...",
        help="chances of accepting 0, 1, ... K drafts (K from its length)",
    )
    v.add_argument(
        "--spec-from",
        default=None,
        metavar="FILE",
        help="the mean accepted length benchmarks/bench_spec.py --json measured at --spec-drafts steps",
    )
    v.add_argument("--spec-seed", type=int, default=0, metavar="N", help="seed of the accepted-length draws")
    v.add_argument("--rates", default=None, metavar="X,Y,Z", help="rate scales of a sweep (x --rate-scale)")
    v.add_argument("--plot", default=None, metavar="PNG", help="SLO attainment vs request rate (sweeps --rates)")
    v.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write JSON here ('-': stdout)")
    v.add_argument("--hw-file", default=None, help="YAML with more hardware (see planner README)")
    v.set_defaults(json=False)


def _simulate(ns) -> dict:
    from afd_engine.planner.sim.command import run_cli

    return run_cli(ns)


def _print_human(what: str, out: dict) -> None:
    if what == "simulate":
        from afd_engine.planner.sim.command import print_report

        print_report(out)
        return
    if what == "model":
        from afd_engine.planner.footprint import print_footprints

        print_footprints(out["models"], out["hw"], out["mem_gb"])
        return
    if what == "reference":
        print(f"{'figure':<50} {'source':<16} {'published':>10} {'model':>10}  {'role':<9}  ok")
        for r in out["checks"]:
            print(
                f"{r['figure']:<50} {r['source']:<16} {r['published']:>10.4g} {r['model']:>10.4g}  "
                f"{r['role']:<9}  {'yes' if r['ok'] else 'NO'}"
            )
        return
    if what != "deploy":
        for key, value in out.items():
            print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
        return
    bests = [out[m] for m in ("afd", "colocated") if m in out] or [out]
    print(
        f"{'':<2}{'mode':<10} {'GPUs A+F':>9} {'mb':>3} {'shared':>9} {'seqs/GPU':>8} {'TPOT ms':>8} "
        f"{'tok/GPU/s':>10} {'bound':>10}"
    )
    for best in bests:
        for i, e in enumerate([best] + best.get("alternatives", [])):
            d = e["deployment"]
            shared = d["shared_expert"] if d["mode"] == "afd" else "-"
            print(
                f"{'*' if i == 0 else '':<2}{d['mode']:<10} {d['attn_gpus']:>4}+{d['ffn_gpus']:<4} "
                f"{d['micro_batches']:>3} {shared:>9} {d['seqs_per_gpu']:>8} {e['tpot_ms']:>8.1f} "
                f"{e['tokens_per_gpu_s']:>10.0f} {e['bound']:>10}"
            )
    print("* best of its mode; seqs/GPU: running sequences per attention GPU")
    index = f", indexer keys {out['index_cache_dtype']}" if out.get("index_cache_dtype") else ""
    print(
        f"{out['model']}, context {out['context']}, attention/KV {out['attn_dtype']}{index}, "
        f"stage times: {out['stage_times']}"
    )
    print(f"expert-rank imbalance (max / mean load): {out['expert_imbalance']:.2f} ({out['expert_imbalance_source']})")
    if "afd_over_colocated_per_gpu" in out:
        print(f"AFD / colocated tokens per GPU per second: {out['afd_over_colocated_per_gpu']:.3f}")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = {
            "comm": _comm,
            "deploy": _deploy,
            "model": _model,
            "sparsity": _sparsity,
            "calibrate": _calibrate,
            "reference": _reference,
            "simulate": _simulate,
        }[ns.what](ns)
    except AFDError as exc:
        print(f"afd plan {ns.what}: error: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(out, indent=2))
    else:
        _print_human(ns.what, out)
    return 0
