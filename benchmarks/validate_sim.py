"""Validates `afd plan simulate` against this engine on CPU: per mode (single, colocated dp2, AFD
1 attention + 1 FFN rank, PD: a single-mode prefill instance and a single-mode decode instance
behind the router, `afd serve --pd`) it

1. serves the model with `--record-steps`, replays a calibration slice of the trace with
   bench_serving and fits the step time (planner/step_calibration.py) to the recorded steps;
2. serves it afresh, replays a different (validation) slice, and simulates that slice with the
   fitted step time, the server's KV pages, token budget, page size and router (PD: a step time
   fitted per instance, and the KV link of KV_LINK);
3. compares TTFT p50/p90, TPOT p50/p90 and output tokens/s, engine against simulation.

    python -m benchmarks.validate_sim --json benchmarks/results/sim_validation_cpu_DATE.json
    python -m benchmarks.validate_sim --quick        # single mode, 20 s slices

The model is the tiny checkpoint with a 4096-token context (copied to --workdir); lengths are
scaled by 1/32 (a 512-token block becomes one 16-token page). Requests whose prompt and output
exceed the context are dropped from the simulated slice and counted (the engine truncates them).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, afd_command

ROOT = Path(__file__).resolve().parent.parent

from afd_engine.planner.simulate import SLO, ClusterConfig, InstanceConfig, KVLink, simulate  # noqa: E402
from afd_engine.planner.step_calibration import (  # noqa: E402
    FittedStepTime,
    StepCalibration,
    fit_records,
    read_records,
    step_rows,
)
from afd_engine.planner.traces import Trace, load_mooncake  # noqa: E402

TRACE = ROOT / "benchmarks" / "datasets" / "mooncake_conversation_first30min.jsonl"
ASSET = ROOT / "afd_engine" / "assets" / "tiny-deepseek-v3-pydoc"
CONTEXT = 4096
VOCAB = 2048
# mode -> (serve flags, simulated ranks, roles)
MODES = {
    "single": (["--mode", "single"], 1, ("gpu",)),
    "dp2": (["--mode", "colocated", "--dp-size", "2"], 2, ("gpu",)),
    "afd": (
        ["--mode", "afd", "--dp-size", "1", "--ffn-nodes", "1", "--ffn-ranks-per-node", "1"],
        1,
        ("attention", "ffn"),
    ),
    "pd": (["--pd", "--prefill-mode", "single", "--decode-mode", "single"], 1, ("gpu",)),
}
# PD's KV transfer on this machine (builtin backend, shared memory between the instances): bytes per
# second from bench_pd's transfer figures (1.6-1.7 GB/s, 1.2 MB per request in 0.7 ms:
# benchmarks/results/pd_dsv3-4k_2026-11-26.json), and a fixed 0.5 ms per transfer for the messages
# around it (assumed, not measured); the bytes per token are the model's.
KV_LINK_BPS, KV_LINK_LATENCY_S = 1.6e9, 0.5e-3
POWERS = (0.0, 0.25, 0.5, 1.0)  # fit weightings tried (rows weighted by seconds^-power)
METRICS = (
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p90_ms", "p90_ttft_ms"),
    ("tpot_p50_ms", "median_tpot_ms"),
    ("tpot_p90_ms", "p90_tpot_ms"),
    ("output_tok_s", "output_throughput"),
)


def model_dir(workdir: Path) -> Path:
    """The tiny checkpoint with max_position_embeddings = CONTEXT."""
    out = workdir / "emb4k"
    if not out.exists():
        shutil.copytree(ASSET, out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = CONTEXT
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def kv_pages(log: str) -> list[int]:
    """Each attention rank's KV pages, from the server's startup log."""
    return [int(x) for x in re.findall(r"rank \d+ ready: .*? (\d+) KV pages", log)]


def serve(model: Path, mode: str, port: int, args: argparse.Namespace, log: Path, record: str | None) -> Server:
    """One `afd serve` in its own process group, healthy; SIGINT stops it (SIGKILL 30 s later)."""
    cmd = afd_command("serve", "--model-path", str(model), "--port", str(port), "--num-threads", "1")
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--page-size", "16", "--kv-cache-memory-mb", str(args.kv_cache_memory_mb), *MODES[mode][0]]
    if record and mode == "pd":  # each instance records its own steps
        cmd += ["--prefill-args", f"--record-steps {record}.p", "--decode-args", f"--record-steps {record}.d"]
    elif record:
        cmd += ["--record-steps", record]
    return Server(cmd, port=port, log_path=log, stop_signal=signal.SIGINT)


def ready_pages(server: Server, timeout: float = 60.0) -> list[int]:
    """The KV pages of each attention rank, once the healthy server's log says it is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = server.log_path.read_text()
        if re.search(r"afd\.serve INFO ready", text):
            return kv_pages(text)
        time.sleep(0.5)
    raise RuntimeError(f"the server's log did not say it was ready within {timeout:g} s; see {server.log_path}")


def bench(port: int, start: float, duration: float, args: argparse.Namespace, out: Path) -> dict:
    """Replays [start, start + duration) s of the scaled trace; bench_serving's record."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--backend", "native", "--dataset-name", "trace", "--trace", str(args.trace)]
    cmd += ["--trace-rate-scale", str(args.rate_scale), "--trace-length-scale", str(args.length_scale)]
    cmd += ["--trace-start", str(start), "--trace-duration", str(duration), "--random-vocab-size", str(VOCAB)]
    cmd += ["--disable-tqdm", "--output-file", str(out), "--output-details"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(out.read_text().splitlines()[-1])


def trace_slice(args: argparse.Namespace, start: float, duration: float) -> tuple[Trace, int]:
    """The slice bench_serving replays, arrivals from its start; and how many requests were dropped
    because prompt + output exceed the context."""
    full = load_mooncake(args.trace, args.rate_scale, args.length_scale)
    picked = [r for r in full.requests if start <= r.arrival_s < start + duration]
    kept = [r for r in picked if r.input_len + r.output_len <= CONTEXT]
    reqs = [type(r)(r.arrival_s - start, r.input_len, r.output_len, r.blocks) for r in kept]
    return Trace(reqs, full.block_tokens, full.source, dict(full.meta)), len(picked) - len(kept)


def step_files(mode: str, rec: str, ranks: int) -> list[list[str]]:
    """The `--record-steps` files of a run, one group per instance (PD: prefill's, then decode's)."""
    if mode == "pd":
        return [[f"{rec}.p"], [f"{rec}.d"]]
    return [[rec] if mode == "single" else [f"{rec}.a{i}.jsonl" for i in range(ranks)]]


def fit_instances(files: list[list[str]], source: str, power: float) -> tuple[StepCalibration, ...]:
    """The step-time fit of each instance of a run (PD: prefill's, then decode's)."""
    return tuple(fit_records([group], source, power) for group in files)


def fit_calibration(mode: str, files: list[list[str]], source: str, power: float):
    """The step-time fit of a run: one, or (prefill's, decode's) for PD."""
    fits = fit_instances(files, source, power)
    return fits if mode == "pd" else fits[0]


def per_instance(mode: str, items: list):
    """What the JSON records per instance: a list for PD, the one item otherwise."""
    return items if mode == "pd" else items[0]


def mean_abs_error(sim: dict, engine: dict) -> float:
    """Mean |error| in % over METRICS."""
    return sum(abs(sim[k] - engine[k]) / engine[k] for k, _ in METRICS) * 100.0 / len(METRICS)


def kv_bytes_per_token(model: Path) -> float:
    """The KV cache bytes of one token of `model` in fp32 (what PD transfers)."""
    from afd_engine.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(model))
    return float(cfg.num_layers * cfg.kv_cache_dim * 4)


def sim_metrics(trace: Trace, ranks: int, pages, cal, roles, args: argparse.Namespace, log: Path | None = None) -> dict:
    """The simulation of `trace`; `cal` is one calibration, or (prefill's, decode's) for PD."""
    if pages is None:
        pages = min(kv_pages(log.read_text()))
    cals = cal if isinstance(cal, tuple) else (cal,)
    cfgs = [
        InstanceConfig(
            ranks=ranks,
            step_time=FittedStepTime(c, roles),
            kv_pages=pages,
            gpus=ranks + (1 if "ffn" in roles else 0),
            page_tokens=16,
            max_batch_tokens=args.max_num_batched_tokens,
            max_running=256,
            policy="lpm",
        )
        for c in cals
    ]
    if len(cfgs) == 2:
        link = KVLink(kv_bytes_per_token(model_dir(args.workdir)), KV_LINK_BPS, KV_LINK_LATENCY_S)
        cluster = ClusterConfig("sim", cfgs[0], decode=cfgs[1], kv_link=link, router="cache_aware")
    else:
        cluster = ClusterConfig("sim", cfgs[0], router="cache_aware")
    d = simulate(trace, cluster, SLO(5.0, 0.05)).as_dict()
    return {
        "ttft_p50_ms": d["ttft_s"]["p50"] * 1e3,
        "ttft_p90_ms": d["ttft_s"]["p90"] * 1e3,
        "tpot_p50_ms": d["tpot_s"]["p50"] * 1e3,
        "tpot_p90_ms": d["tpot_s"]["p90"] * 1e3,
        "output_tok_s": d["output_tokens_per_s"],
        "steps": d["steps"],
        "preemptions": d["preemptions"],
        "prefix_hit_rate": d["prefix_hit_rate"],
    }


def run_mode(mode: str, args: argparse.Namespace, model: Path, port: int) -> dict:
    work = args.workdir / mode
    work.mkdir(parents=True, exist_ok=True)
    flags, ranks, roles = MODES[mode]
    # 1. calibration slice, steps recorded
    rec = str(work / "cal.steps")
    if args.reuse:
        cal_bench = json.loads((work / "cal_bench.jsonl").read_text().splitlines()[-1])
    else:
        with serve(model, mode, port, args, work / "serve_cal.log", rec) as srv:
            ready_pages(srv)
            cal_bench = bench(port, args.cal_start, args.duration, args, work / "cal_bench.jsonl")
    files = step_files(mode, rec, ranks)
    cal_trace, _ = trace_slice(args, args.cal_start, args.duration)
    cal_engine = {k: float(cal_bench[src]) for k, src in METRICS}
    # the fit's weighting: the one whose simulation of the calibration slice is closest to the engine's
    candidates, fits = [], {}
    for power in POWERS:
        fits[power] = fit_instances(files, f"{mode}: trace slice [{args.cal_start:g}, +{args.duration:g}) s", power)
        sim = sim_metrics(cal_trace, ranks, None, fits[power], roles, args, work / "serve_cal.log")
        err = mean_abs_error(sim, cal_engine)
        coef = per_instance(mode, [x.as_dict()["coef"] for x in fits[power]])
        candidates.append({"weight_power": power, "coef": coef, "calibration_slice_error_pct": err})
    cal = fits[min(candidates, key=lambda c: c["calibration_slice_error_pct"])["weight_power"]]
    names = ["_prefill", "_decode"] if mode == "pd" else [""]
    for name, one in zip(names, cal):
        one.save(work / f"step_calibration{name}.json")
    # 2. validation slice on a fresh server
    vrec = str(work / "val.steps")
    if args.reuse:
        pages = kv_pages((work / "serve_val.log").read_text())
        val_bench = json.loads((work / "val_bench.jsonl").read_text().splitlines()[-1])
    else:
        with serve(model, mode, port, args, work / "serve_val.log", vrec) as srv:
            pages = ready_pages(srv)
            val_bench = bench(port, args.val_start, args.duration, args, work / "val_bench.jsonl")
    vfiles = step_files(mode, vrec, ranks)
    pred, secs = [], []
    for group, one in zip(vfiles, cal):
        loads, s = step_rows([read_records(f) for f in group])
        pred += [one.seconds(ld) for ld in loads]
        secs += s
    rel = sorted(abs(a - b) / b for a, b in zip(pred, secs))
    step_check = {
        "steps": len(secs),
        "median_abs_rel_error": rel[len(rel) // 2] if rel else None,
        "measured_busy_s": sum(secs),
        "predicted_busy_s": sum(pred),
    }
    trace, dropped = trace_slice(args, args.val_start, args.duration)
    sim = sim_metrics(trace, ranks, min(pages), cal, roles, args)
    engine = {k: float(val_bench[src]) for k, src in METRICS}
    for c in candidates:  # (for the record: what the other weightings give here; not used to choose)
        other = fits[c["weight_power"]]
        c["validation_slice_error_pct"] = mean_abs_error(
            sim_metrics(trace, ranks, min(pages), other, roles, args), engine
        )
    errors = {k: 100.0 * (sim[k] - engine[k]) / engine[k] if engine[k] else None for k, _ in METRICS}
    # the engine's own spread: the validation slice replayed again on a fresh server
    again = work / "val_bench_repeat.jsonl"
    if args.repeat and not args.reuse:
        with serve(model, mode, port, args, work / "serve_repeat.log", None) as srv:
            ready_pages(srv)
            bench(port, args.val_start, args.duration, args, again)
    repeat = None
    if again.exists() and (args.repeat or args.reuse):
        rb = json.loads(again.read_text().splitlines()[-1])
        r = {k: float(rb[src]) for k, src in METRICS}
        repeat = {"engine": r, "diff_pct": {k: 100.0 * (r[k] - engine[k]) / engine[k] for k, _ in METRICS}}
    return {
        "mode": mode,
        "serve_flags": flags,
        "kv_pages_per_rank": pages,
        "step_calibration": per_instance(mode, [x.as_dict() for x in cal]),
        "weightings": candidates,
        "step_model_on_validation_steps": step_check,
        "calibration_run": {k: cal_bench[src] for k, src in METRICS},
        "requests": val_bench["completed"],
        "failed": val_bench["failed"],
        "dropped_over_context": dropped,
        "engine_cache_hit_rate": val_bench.get("cache_hit_rate"),
        "engine": engine,
        "simulation": sim,
        "error_pct": errors,
        "engine_repeat": repeat,
        "within_10pct": {k: e is not None and abs(e) <= 10.0 for k, e in errors.items()},
    }


def print_table(results: list[dict]) -> None:
    names = [k for k, _ in METRICS]
    print(f"{'mode':<7} {'':<6} " + " ".join(f"{n:>12}" for n in names))
    for r in results:
        for what in ("engine", "simulation"):
            print(f"{r['mode']:<7} {what[:6]:<6} " + " ".join(f"{r[what][n]:>12.1f}" for n in names))
        print(f"{r['mode']:<7} {'err %':<6} " + " ".join(f"{r['error_pct'][n]:>+12.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="single,dp2,afd", help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--rate-scale", type=float, default=0.6, help="trace arrivals this many times as fast")
    p.add_argument("--length-scale", type=float, default=1 / 32)
    p.add_argument("--cal-start", type=float, default=300.0, help="calibration slice start, s (after scaling)")
    p.add_argument("--val-start", type=float, default=900.0, help="validation slice start, s (after scaling)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of each slice")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-mb", type=float, default=256.0)
    p.add_argument("--port", type=int, default=18230)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "afd-validate-sim")
    p.add_argument("--repeat", action="store_true", help="replay the validation slice twice (the engine's spread)")
    p.add_argument("--reuse", action="store_true", help="no serving: refit and resimulate the runs in --workdir")
    p.add_argument("--quick", action="store_true", help="single mode only, 20 s slices")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.modes, args.duration = "single", 20.0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if abs(args.cal_start - args.val_start) < args.duration:
        p.error("the calibration and validation slices overlap")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.workdir)
    results = []
    for mode in modes:
        t = time.monotonic()
        results.append(run_mode(mode, args, model, args.port))
        results[-1]["wall_s"] = time.monotonic() - t
        print_table(results[-1:])
    out = {
        "what": "afd plan simulate (fitted step time) vs the engine on CPU, same trace slice",
        "num_threads": 1,
        "trace": str(args.trace),
        "rate_scale": args.rate_scale,
        "length_scale": args.length_scale,
        "calibration_slice_s": [args.cal_start, args.cal_start + args.duration],
        "validation_slice_s": [args.val_start, args.val_start + args.duration],
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "page_size": 16,
        "context": CONTEXT,
        "results": results,
    }
    print_table(results)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
