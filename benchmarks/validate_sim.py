"""Validates `afd plan simulate` against this engine on CPU. Per mode (single; colocated dp2; AFD
with 1 attention + 1 FFN rank; PD: a single-mode prefill instance and a single-mode decode instance
behind the router, `afd serve --pd`) it

1. serves the model with `--record-steps`, replays a calibration slice of the trace with
   bench_serving and fits the step time (planner/step_calibration.py) to the recorded steps, with
   the fit's residual on those steps (PD: one fit per instance); the calibration slice is replayed
   `--cal-repeats` times (2: once before the validation runs, once after; dp2's second with a
   round-robin router, CAL_EXTRA), on a fresh server each time, and fitted on all of them;
2. serves it afresh `--repeats` times, replaying a different (validation) slice each time: the
   engine's figures are the runs' mean, their spread the largest distance of one run from it;
3. simulates the validation slice with the fitted step time, the server's KV pages, token budget,
   page size and router, and the front end measured on the calibration run (PD: also the KV link
   of KV_LINK), the step times of dp2 and of PD's decode instance drawn around the fit (DRAWN), as
   the mean of DRAWS simulations that draw the front end's gaps, and reports, per figure, the simulator's
   error against the engine's mean beside the engine's own spread.

Each fit weights its steps so that every kind of step (decode-only, short, medium and long prefill)
gets its busy time closest (`balanced_fit`); a step spans from the engine's round start to the next
(`--record-steps`' `ts`), as a simulated step does. The front end is measured on each mode's
calibration run (`measure_front_end`): when the API server handed each request to a rank
(`--record-steps`' PATH.frontend.jsonl) against the benchmark's schedule and sends. Its gaps
between queued requests are then scaled by the one of GAP_SCALES whose simulations of the
calibration slice prefill in as many steps as the engine did (how a burst is batched turns on
fractions of a millisecond), and the response time, which every TTFT carries, is the median over
the calibration requests of the engine's TTFT minus the simulated one, request by request.

    python -m benchmarks.validate_sim --modes single,dp2,afd,pd --repeats 3 --json PATH   # ~28 min
    python -m benchmarks.validate_sim --quick          # single mode, short slices, one run (~40 s)
    python -m benchmarks.validate_sim --table PATH     # the markdown table of a results file

The slices are seconds of the trace's own clock (300 s each by default), replayed `--rate-scale`
times as fast. The model is the tiny checkpoint with a 4096-token context (copied to --workdir);
prompts are scaled by --length-scale and outputs by --output-scale (a 512-token block becomes one
page of --page-size tokens). Requests whose prompt and output exceed the context are dropped from the
simulated slice and counted (the engine truncates them).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, afd_command

ROOT = Path(__file__).resolve().parent.parent

from afd_engine.planner.simulate import SLO, ClusterConfig, FrontEnd, InstanceConfig, KVLink, simulate  # noqa: E402
from afd_engine.planner.step_calibration import (  # noqa: E402
    GAP_CAP_S,
    FittedStepTime,
    StepCalibration,
    balanced_fit,
    kind_ratios,
    read_records,
    speed_matched,
    step_rows,
)
from afd_engine.planner.traces import Trace, load_mooncake  # noqa: E402

TRACE = ROOT / "benchmarks" / "datasets" / "mooncake_conversation_first30min.jsonl"
ASSET = ROOT / "afd_engine" / "assets" / "tiny-deepseek-v3-pydoc"
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
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
# A second calibration run, of the same slice, for a mode whose router may leave a rank idle through
# the whole calibration slice (every request of the trace shares its first block, and cache_aware
# follows it to one rank until that rank is 32 requests ahead): round robin keeps both ranks busy,
# so that the fit can price a lockstep step in which both work (its other_busy_ranks term). Its steps
# are fitted at the first run's speed (`speed_matched`): the round-robin run took 6-14% longer than
# the cache-aware run's fit priced its steps in three sets of runs (2% less and 1% more in the two
# after), and the validation runs route as the first run does.
CAL_EXTRA = {"dp2": ["--load-balance-method", "round_robin"]}
# PD's KV transfer on this machine (builtin backend, shared memory between the instances): bytes per
# second from bench_pd's transfer figures (1.6-1.7 GB/s, 1.2 MB per request in 0.7 ms:
# benchmarks/results/pd_dsv3-4k_2026-11-26.json), and a fixed 0.5 ms per transfer for the messages
# around it (assumed, not measured); the bytes per token are the model's.
KV_LINK_BPS, KV_LINK_LATENCY_S = 1.6e9, 0.5e-3
# Per mode, the instances whose steps' times are drawn around the fit (FittedStepTime's rng) in
# each of the DRAWS simulations. Under PD the two instances share this machine's cores, and a
# request's TPOT, which the decode instance's steps make, is mostly the run's chance: between two
# runs of the same slice its correlation is 0.1-0.3 (0.7-0.95 in the other modes, where the fitted
# times stand for every run; TTFTs correlate 0.7-0.95 in every mode, PD's included), so a run's
# TPOT tail is wider than that of a simulation whose steps all take the fitted time. dp2's bursts
# go to one rank (the cache-aware router follows a burst's first request), whose steps of several
# million padded pairs decide whether the next burst joins the step under way: at the fitted times
# every simulation takes the same side, where the engine's runs, whose steps spread 10-20% about the
# fit, take either (refitted on six sets of runs of 2026-11-29, drawing dp2's steps took its TTFT p90
# from +12.3% to +3.6% and from +20.8% to +8.7% on two sets and its TPOT p90 from +9.6% to +13.0% and
# from +8.9% to +15.5% on two others; 4 of the 6 sets then had dp2's four latencies within 10%,
# against 3; the figures' mean |error| 6.0% against 6.4%).
DRAWN = {"dp2": (True,), "pd": (False, True)}  # (the instance,) / (prefill instance, decode instance)
# Every mode's figures are the mean over DRAWS simulations (seeds 0, 1, ...), each with the front
# end's gaps drawn from the measured ones (FrontEnd), and the DRAWN instances' step times.
DRAWS = 8
# The front end's measured gaps between queued requests, times each of these, simulated on the
# calibration slice: the one whose simulations prefill in as many steps as the engine did is used
# (FrontEnd.scaled; how a burst is batched turns on fractions of a millisecond, and the engine took
# more of a burst into one step than the API server's hand-over times alone said).
GAP_SCALES = (0.25, 0.5, 0.75, 1.0, 1.5)
# the five figures compared: (key in the results file, bench_serving's key); latencies in ms
METRICS = (
    ("ttft_p50", "median_ttft_ms"),
    ("ttft_p90", "p90_ttft_ms"),
    ("tpot_p50", "median_tpot_ms"),
    ("tpot_p90", "p90_tpot_ms"),
    ("output_tokens_per_s", "output_throughput"),
)
BOUND_PCT = 10.0
README_BEGIN = "<!-- sim-validation-table: generated by `python -m benchmarks.validate_sim --table`; do not edit -->"
README_END = "<!-- end of sim-validation-table -->"


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


def serve(
    model: Path, mode: str, port: int, args: argparse.Namespace, log: Path, record: str | None, extra: list[str] = ()
) -> Server:
    """One `afd serve` in its own process group, healthy; SIGINT stops it (SIGKILL 30 s later);
    `extra`: more flags."""
    cmd = afd_command("serve", "--model-path", str(model), "--port", str(port), "--num-threads", "1")
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--page-size", str(args.page_size), "--kv-cache-memory-mb", str(args.kv_cache_memory_mb)]
    cmd += [*MODES[mode][0], *extra]
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


def replay_window(args: argparse.Namespace, start: float) -> tuple[float, float]:
    """(start, duration) of a slice on the replay's clock: trace seconds divided by the rate scale."""
    return start / args.rate_scale, args.duration / args.rate_scale


def bench(port: int, start: float, args: argparse.Namespace, out: Path) -> dict:
    """Replays the slice starting at `start` trace seconds; bench_serving's record."""
    out.unlink(missing_ok=True)
    at, duration = replay_window(args, start)
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--backend", "native", "--dataset-name", "trace", "--trace", str(args.trace)]
    cmd += ["--trace-rate-scale", str(args.rate_scale), "--trace-length-scale", str(args.length_scale)]
    cmd += ["--trace-output-scale", str(args.output_scale)]
    cmd += ["--trace-start", str(at), "--trace-duration", str(duration), "--random-vocab-size", str(VOCAB)]
    cmd += ["--disable-tqdm", "--output-file", str(out), "--output-details"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(out.read_text().splitlines()[-1])


def trace_slice(args: argparse.Namespace, start: float) -> tuple[Trace, int]:
    """The slice bench_serving replays, arrivals from its start; and how many requests were dropped
    because prompt + output exceed the context."""
    full = load_mooncake(args.trace, args.rate_scale, args.length_scale, output_scale=args.output_scale)
    at, duration = replay_window(args, start)
    picked = [r for r in full.requests if at <= r.arrival_s < at + duration]
    kept = [r for r in picked if r.input_len + r.output_len <= CONTEXT]
    reqs = [type(r)(r.arrival_s - at, r.input_len, r.output_len, r.blocks) for r in kept]
    return Trace(reqs, full.block_tokens, full.source, dict(full.meta)), len(picked) - len(kept)


def step_files(mode: str, rec: str, ranks: int) -> list[list[str]]:
    """The `--record-steps` files of a run, one group per instance (PD: prefill's, then decode's)."""
    if mode == "pd":
        return [[f"{rec}.p"], [f"{rec}.d"]]
    return [[rec] if mode == "single" else [f"{rec}.a{i}.jsonl" for i in range(ranks)]]


def instance_rows(files: list[list[str]]) -> list[tuple[list, list]]:
    """(loads, seconds) of the steps of each instance of a run (PD: prefill's, then decode's), each
    step marked where another instance was computing as it started (`step_rows`' peers)."""
    recs = [[read_records(f) for f in group] for group in files]
    return [step_rows(mine, peers=[o for j, o in enumerate(recs) if j != i]) for i, mine in enumerate(recs)]


def fit_instances(rows: list[tuple[list, list]], source: str) -> tuple[StepCalibration, ...]:
    """The step-time fit of each instance of a run (its `instance_rows`), each weighted on its own
    (`balanced_fit`)."""
    return tuple(balanced_fit(loads, seconds, source) for loads, seconds in rows)


def fit_calibration(mode: str, files: list[list[str]], source: str):
    """The step-time fit of a run: one, or (prefill's, decode's) for PD."""
    return per_instance(mode, fit_instances(instance_rows(files), source))


def per_instance(mode: str, items):
    """Per instance: all the items for PD (a tuple of fits is what the simulation takes), the one
    item otherwise."""
    return items if mode == "pd" else items[0]


def mean_abs_error(sim: dict, engine: dict) -> float:
    """Mean |error| in % over METRICS."""
    return sum(abs(sim[k] - engine[k]) / engine[k] for k, _ in METRICS) * 100.0 / len(METRICS)


def engine_figures(record: dict) -> dict:
    """The five figures of one bench_serving record."""
    return {k: float(record[src]) for k, src in METRICS}


def mean_and_spread(runs: list[dict]) -> tuple[dict, dict]:
    """Per figure: the runs' mean, and their spread (the largest |run - mean|, in % of the mean)."""
    mean = {k: statistics.fmean(r[k] for r in runs) for k, _ in METRICS}
    spread = {k: max(abs(r[k] - mean[k]) for r in runs) * 100.0 / mean[k] if mean[k] else 0.0 for k, _ in METRICS}
    return mean, spread


def signed_errors(sim: dict, engine: dict) -> dict:
    """(simulation - engine) / engine in %, per figure."""
    return {k: 100.0 * (sim[k] - engine[k]) / engine[k] if engine[k] else None for k, _ in METRICS}


def verdicts(errors: dict, spread: dict) -> dict:
    """Per figure: "within" (|error| <= BOUND_PCT), "within spread" (outside the bound, but the
    engine's own spread is larger than the error), or "outside"."""
    out = {}
    for k, _ in METRICS:
        e = errors[k]
        if e is not None and abs(e) <= BOUND_PCT:
            out[k] = "within"
        elif e is not None and spread[k] > abs(e):
            out[k] = "within spread"
        else:
            out[k] = "outside"
    return out


def kv_bytes_per_token(model: Path) -> float:
    """The KV cache bytes of one token of `model` in fp32 (what PD transfers)."""
    from afd_engine.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(model))
    return float(cfg.num_layers * cfg.kv_cache_dim * 4)


def simulations(
    trace: Trace,
    ranks: int,
    pages: int,
    cal,
    roles,
    args: argparse.Namespace,
    front_end: FrontEnd = FrontEnd(),
    drawn: tuple[bool, ...] = (),
    response_s: float = 0.0,
) -> list:
    """The DRAWS simulations of `trace` (SimResults; seeds 0, 1, ...), each with the front end's gaps
    drawn with its seed and, where `drawn` marks an instance, that instance's step times drawn
    around the fit. `cal` is one calibration, or (prefill's, decode's) for PD."""
    cals = cal if isinstance(cal, tuple) else (cal,)
    out = []
    for seed in range(DRAWS):
        rng = np.random.default_rng(seed)
        cfgs = [
            InstanceConfig(
                ranks=ranks,
                step_time=FittedStepTime(c, roles, rng if i < len(drawn) and drawn[i] else None),
                kv_pages=pages,
                gpus=ranks + (1 if "ffn" in roles else 0),
                page_tokens=args.page_size,
                max_batch_tokens=args.max_num_batched_tokens,
                max_running=256,
                policy="lpm",
            )
            for i, c in enumerate(cals)
        ]
        fe = front_end.drawn(seed)
        if len(cfgs) == 2:
            link = KVLink(kv_bytes_per_token(model_dir(args.workdir)), KV_LINK_BPS, KV_LINK_LATENCY_S)
            cluster = ClusterConfig("sim", cfgs[0], cfgs[1], link, "cache_aware", fe, response_s)
        else:
            cluster = ClusterConfig("sim", cfgs[0], None, None, "cache_aware", fe, response_s)
        out.append(simulate(trace, cluster, SLO(5.0, 0.05)))
    return out


def measure_front_end(run: dict, arrivals: list[float]) -> tuple[FrontEnd, dict]:
    """The front end of a run, from its front-end record (when the API server handed each request
    to a rank, on the ranks' clock) against the replay's schedule (`arrivals`, seconds after the
    benchmark's `start_monotonic`), requests paired in order. A request that arrived after the one
    before had been handed over found the front end idle: `first_s` is the median time from such a
    request's send (the bench record's `sent_at`, where the engine's TTFT starts; without it, its
    arrival) to its hand-over, plus the median time from a hand-over that woke an idle rank to that
    rank's round starting (its records' `ts`); the gaps between later hand-overs are the measured
    `lead` (behind such a request) and `after` ones. Also returns what was measured."""
    path = Path(run["front_end"])
    if not path.exists():
        raise RuntimeError(f"no front-end record {path}: serve with this engine's --record-steps (not --reuse)")
    start = run["bench"]["start_monotonic"]
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    handed = np.sort([r["t"] for r in recs if r["t"] >= start])
    if len(handed) != len(arrivals):
        raise RuntimeError(f"{path}: {len(handed)} requests handed over for the {len(arrivals)} of the slice")
    at = np.sort(np.asarray(arrivals, dtype=float)) + start
    idle = np.ones(len(at), dtype=bool)
    idle[1:] = at[1:] > handed[:-1]
    queued = np.flatnonzero(~idle)
    gaps = handed[queued] - handed[queued - 1]
    behind_first = idle[queued - 1]
    # from a hand-over to the round it woke: rounds after an idle gap, against the last hand-over before each
    wakes = []
    for group in run["files"][:1]:
        for f in group:
            steps = read_records(f)
            for prev, rec in zip(steps, steps[1:]):
                k = np.searchsorted(handed, rec["ts"]) - 1
                if np.isfinite(rec["ts"]) and k >= 0 and rec["ts"] - prev["t1"] >= GAP_CAP_S and handed[k] > prev["t1"]:
                    wakes.append(rec["ts"] - handed[k])
    hop = float(np.median(wakes)) if wakes else 0.0
    # from the client's send, where the engine's TTFT starts (else from the schedule)
    sent = np.sort(run["bench"].get("sent_at") or at)
    first = float(np.median(handed[idle] - sent[idle])) + hop
    fe = FrontEnd.measured(first, gaps[behind_first], gaps[~behind_first])
    return fe, {
        "first_ms": fe.first_s * 1e3,
        "wake_ms": hop * 1e3,
        "lead_ms": fe.lead_s * 1e3,
        "next_ms": fe.next_s * 1e3,
        "requests": len(handed),
        "found_idle": int(idle.sum()),
    }


def sim_figures(results: list) -> dict:
    """The figures of simulations: each the mean over them."""
    ds = [r.as_dict() for r in results]
    one = [
        {
            "ttft_p50": d["ttft_s"]["p50"] * 1e3,
            "ttft_p90": d["ttft_s"]["p90"] * 1e3,
            "tpot_p50": d["tpot_s"]["p50"] * 1e3,
            "tpot_p90": d["tpot_s"]["p90"] * 1e3,
            "output_tokens_per_s": d["output_tokens_per_s"],
            "steps": d["steps"],
            "prefill_steps": d["prefill_steps"],
            "preemptions": d["preemptions"],
            "prefix_hit_rate": d["prefix_hit_rate"],
        }
        for d in ds
    ]
    return {k: statistics.fmean(x[k] for x in one) for k in one[0]}


def _times(values: list) -> np.ndarray:
    """A bench record's per-request times (seconds), NaN where a failed request has none."""
    return np.array([t if t is not None and t > 0 else np.nan for t in values], dtype=float)


def ttft_gaps(bench: dict, results: list) -> np.ndarray:
    """Per request of the slice and simulation: the engine's TTFT minus the simulated one, in
    seconds; NaN where either has none (a failed request)."""
    engine = _times(bench["ttfts"])
    if any(len(r.ttft) != len(engine) for r in results):
        sim = len(results[0].ttft)
        raise RuntimeError(f"the engine served {len(engine)} requests of the slice, the simulation {sim}")
    return np.concatenate([np.where(np.isfinite(r.ttft), engine - r.ttft, np.nan) for r in results])


def tpot_run_correlation(runs: list[dict]) -> float | None:
    """The mean correlation, over pairs of the engine's runs of the same slice, of a request's TPOT
    (requests of more than two tokens finished in every run); None for a single run."""
    tpots = []
    for run in runs:
        b = run["bench"]
        out = np.array(b["output_lens"], dtype=float)
        tpots.append(np.where(out > 2, (_times(b["latencies"]) - _times(b["ttfts"])) / np.maximum(out - 1, 1), np.nan))
    if len(tpots) < 2 or len({len(t) for t in tpots}) > 1:
        return None
    ok = np.all(np.isfinite(tpots), axis=0)
    pairs = [(a, b) for i, a in enumerate(tpots) for b in tpots[i + 1 :]]
    return statistics.fmean(float(np.corrcoef(a[ok], b[ok])[0, 1]) for a, b in pairs) if ok.sum() > 2 else None


def step_residual(rows: list[tuple[list, list]], cal) -> dict:
    """How the fitted step time predicts the steps of a run (its `instance_rows`): the median
    relative error per step, and the busy seconds measured and predicted."""
    cals = cal if isinstance(cal, tuple) else (cal,)
    pred, secs = [], []
    for (loads, s), one in zip(rows, cals):
        pred += [one.seconds(ld) for ld in loads]
        secs += s
    rel = sorted(abs(a - b) / b for a, b in zip(pred, secs))
    return {
        "steps": len(secs),
        "median_abs_rel_error": rel[len(rel) // 2] if rel else None,
        "measured_busy_s": sum(secs),
        "predicted_busy_s": sum(pred),
    }


def served_run(
    mode: str, args: argparse.Namespace, model: Path, work: Path, name: str, start: float, extra: list[str] = ()
) -> dict:
    """One fresh server (with the flags `extra` too) replaying the slice at `start` with its steps
    recorded (reused with --reuse): the bench record, the KV pages per rank and the step files."""
    rec, log, out = str(work / f"{name}.steps"), work / f"serve_{name}.log", work / f"{name}_bench.jsonl"
    if not args.reuse:
        with serve(model, mode, args.port, args, log, rec, extra) as srv:
            ready_pages(srv)
            bench(args.port, start, args, out)
    return {
        "bench": json.loads(out.read_text().splitlines()[-1]),
        "pages": kv_pages(log.read_text()),
        "files": step_files(mode, rec, MODES[mode][1]),
        # the API server's hand-overs to the engine (PD: the prefill instance's)
        "front_end": f"{rec}.p.frontend.jsonl" if mode == "pd" else f"{rec}.frontend.jsonl",
    }


def engine_runs(mode: str, args: argparse.Namespace, model: Path) -> dict:
    """The engine's runs of a mode: the calibration slice `--cal-repeats` times, each on a fresh
    server, a mode in CAL_EXTRA's last time with those flags; the validation slice `--repeats`
    times between the first and the others (a drift of this machine's speed over the minutes of a
    mode then falls on both sides). Under --reuse a later calibration run not in --workdir is left out."""
    work = args.workdir / mode
    work.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    cal = served_run(mode, args, model, work, "cal", args.cal_start)
    extra = (
        [served_run(mode, args, model, work, "cal_extra", args.cal_start, CAL_EXTRA[mode])]
        if mode in CAL_EXTRA and args.cal_repeats > 1
        else []
    )
    runs = [served_run(mode, args, model, work, f"val{i}", args.val_start) for i in range(args.repeats)]
    names = [f"cal{i}" for i in range(1, args.cal_repeats - len(extra))]
    again = [
        served_run(mode, args, model, work, name, args.cal_start)
        for name in names
        if not args.reuse or (work / f"{name}_bench.jsonl").exists()
    ]
    return {
        "mode": mode,
        "cal": cal,
        "cal_again": again,
        "cal_extra": extra,
        "val": runs,
        "wall_s": time.monotonic() - t,
    }


def calibrate(served: dict, args: argparse.Namespace) -> dict:
    """The step-time fit of a mode's calibration runs (the steps of those with the mode's own flags
    together, an extra one's at their speed: `speed_matched`); the front end of the first
    (`measure_front_end`) with the gaps scaled by the one of GAP_SCALES whose simulations of the
    calibration slice prefill in as many steps as the engine did, on average over the runs with
    the mode's own flags (the simulations with no response time: that only adds to every TTFT, see
    `with_response`); and the response time, the median of those runs' requests' TTFT gaps to the
    simulations' (`ttft_gaps`, `response_time`)."""
    mode, cal_run = served["mode"], served["cal"]
    own = [cal_run, *served["cal_again"]]
    _, ranks, roles = MODES[mode]
    cal_trace, _ = trace_slice(args, args.cal_start)
    source = f"{mode}: trace seconds [{args.cal_start:g}, +{args.duration:g}) x{len(own)}"
    if served["cal_extra"]:
        source += ", then with " + " ".join(CAL_EXTRA[mode])
    own_rows = [instance_rows(run["files"]) for run in own]
    # each instance's steps of the runs with the mode's own flags, together
    rows = [
        ([ld for loads, _ in inst for ld in loads], [s for _, secs in inst for s in secs]) for inst in zip(*own_rows)
    ]
    # then those of an extra run (the same instances under another router), at their speed (`speed_matched`)
    per_run = [rows] + [instance_rows(run["files"]) for run in served["cal_extra"]]
    matched = [speed_matched(inst) for inst in zip(*per_run)]
    fit_rows = [(loads, secs) for loads, secs, _ in matched]
    fits = fit_instances(fit_rows, source)
    one, pages = per_instance(mode, fits), min(cal_run["pages"])
    measured_fe, measured = measure_front_end(cal_run, [r.arrival_s for r in cal_trace.requests])
    engine_steps = statistics.fmean(sum(1 for loads, _ in r for ld in loads if ld[3] > 0) for r in own_rows)
    drawn = DRAWN.get(mode, ())
    by_scale = {
        f: simulations(cal_trace, ranks, pages, one, roles, args, measured_fe.scaled(f), drawn) for f in GAP_SCALES
    }
    steps = {f: sim_figures(sims)["prefill_steps"] for f, sims in by_scale.items()}
    scale = closest_scale(steps, engine_steps)
    sims = by_scale[scale]
    return {
        "fits": fits,
        "rows": fit_rows,  # the steps fitted
        "run_speeds": per_instance(mode, [list(speeds) for *_, speeds in matched]),
        "engine": mean_and_spread([engine_figures(run["bench"]) for run in own])[0],
        "runs": {"own_flags": len(own), "extra": len(served["cal_extra"])},
        "engine_prefill_steps": engine_steps,
        "front_end": measured_fe.scaled(scale),
        "front_end_measured": measured | {"gap_scale": scale, "prefill_steps_by_gap_scale": steps},
        "simulation": sim_figures(sims),
        "response_s": response_time(np.concatenate([ttft_gaps(run["bench"], sims) for run in own])),
    }


def closest_scale(steps: dict[float, float], engine_steps: int) -> float:
    """The gap scale whose simulations prefilled in as many steps as the engine did (the smaller
    one where two are as close)."""
    return min(sorted(steps), key=lambda f: abs(steps[f] - engine_steps))


def with_response(sim: dict, response_s: float) -> dict:
    """A simulation's figures had every token reached the client `response_s` later: TTFTs shift
    by it, TPOT and throughput do not (planner/sim/results.py)."""
    return sim | {k: sim[k] + response_s * 1e3 for k in ("ttft_p50", "ttft_p90")}


def response_time(gaps: np.ndarray) -> float:
    """The response time every TTFT carries: the median of the calibration requests' TTFT gaps
    (engine minus simulated, request by request, failed requests left out; not below 0), which
    one run's latency tail does not move."""
    gaps = gaps[np.isfinite(gaps)]
    return max(0.0, float(np.median(gaps))) if len(gaps) else 0.0


def validate_mode(served: dict, calib: dict, args: argparse.Namespace) -> dict:
    """The simulation of a mode's validation slice with the front end and response time of its
    calibration (`calibrate`), against the engine's mean over the validation runs."""
    mode, runs = served["mode"], served["val"]
    flags, ranks, roles = MODES[mode]
    cal = per_instance(mode, calib["fits"])
    work = args.workdir / mode
    for suffix, one in zip(["_prefill", "_decode"] if mode == "pd" else [""], calib["fits"]):
        one.save(work / f"step_calibration{suffix}.json")
    figures = [engine_figures(r["bench"]) for r in runs]
    mean, spread = mean_and_spread(figures)
    trace, dropped = trace_slice(args, args.val_start)
    drawn = DRAWN.get(mode, ())
    pages, front_end, response_s = min(runs[0]["pages"]), calib["front_end"], calib["response_s"]
    sim = sim_figures(simulations(trace, ranks, pages, cal, roles, args, front_end, drawn, response_s))
    errors = signed_errors(sim, mean)
    val_rows = instance_rows(runs[0]["files"])
    return {
        "mode": mode,
        "serve_flags": flags,
        "kv_pages_per_rank": runs[0]["pages"],
        "step_model": {
            "fit": per_instance(mode, [x.as_dict() for x in calib["fits"]]),
            # predicted / measured busy seconds per kind of step, on the first validation run (on
            # the calibration runs each kind is scaled to 1: kind_scale)
            "kind_ratios_on_validation_steps": per_instance(
                mode, [kind_ratios(f, *r) for f, r in zip(calib["fits"], val_rows)]
            ),
            # each calibration run's speed against the first's (`speed_matched`; its seconds divided by it)
            "calibration_run_speeds": calib["run_speeds"],
            "residual_on_calibration_steps": step_residual(calib["rows"], cal),
            "residual_on_validation_steps": step_residual(val_rows, cal),
        },
        # measured on the calibration run (measure_front_end), and the response time
        "front_end": calib["front_end_measured"] | {"response_ms": response_s * 1e3},
        "calibration_slice_error_pct": mean_abs_error(with_response(calib["simulation"], response_s), calib["engine"]),
        "calibration_prefill_steps": {
            "engine": calib["engine_prefill_steps"],
            "simulation": calib["simulation"]["prefill_steps"],
        },
        "calibration_run": calib["engine"],  # the mean of the runs with the mode's own flags
        "calibration_runs": calib["runs"],
        "requests": runs[0]["bench"]["completed"],
        "failed": sum(r["bench"]["failed"] for r in runs),
        "dropped_over_context": dropped,
        "engine_cache_hit_rate": statistics.fmean(r["bench"].get("cache_hit_rate") or 0.0 for r in runs),
        "engine_runs": figures,
        "engine_mean": mean,
        "engine_spread_pct": spread,
        "engine_tpot_run_correlation": tpot_run_correlation(runs),
        # simulations whose figures were averaged (each drawing the front end's gaps), and the
        # instances whose step times they drew
        "draws": {"simulations": DRAWS, "step_times_of_instances": list(drawn)},
        "simulation": sim,
        "error_pct": errors,
        "verdict": verdicts(errors, spread),
        "wall_s": served["wall_s"],
    }


NAMES = {"single": "single", "dp2": "colocated dp2", "afd": "AFD 1A + 1F", "pd": "PD (prefill + decode)"}
HEADS = ("TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "output tok/s")


def table(data: dict) -> str:
    """The markdown table of a results file: per mode and figure, the simulator's error against the
    engine's mean and, in brackets, the engine's own spread; a figure outside ±BOUND_PCT is bold."""
    lines = [
        "| mode | " + " | ".join(HEADS) + " |",
        "|---|" + "---:|" * len(HEADS),
    ]
    for r in data["results"]:
        cells = []
        for k, _ in METRICS:
            e, s = r["error_pct"][k], r["engine_spread_pct"][k]
            text = f"{e:+.1f}% ({s:.1f}%)"
            cells.append(f"**{text}**" if abs(e) > BOUND_PCT else text)
        lines.append(f"| {NAMES.get(r['mode'], r['mode'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def results_order(path: Path) -> tuple[str, int]:
    """Where a results file sorts: by its date, then by the N of a `_runN` suffix (none: 1), so
    that run10 comes after run9."""
    m = re.fullmatch(r"sim_validation_(.+?)(?:_run(\d+))?\.json", path.name)
    return (m.group(1), int(m.group(2) or 1)) if m else (path.name, 0)


def newest_results() -> Path:
    """The newest `sim_validation_<date>[_runN].json` under benchmarks/results."""
    files = sorted(RESULTS.glob("sim_validation_[0-9]*.json"), key=results_order)
    if not files:
        raise FileNotFoundError(f"no sim_validation_<date>.json in {RESULTS}")
    return files[-1]


def readme_block(path: Path) -> str:
    """The block of benchmarks/README.md generated from the results file at `path`."""
    data = json.loads(path.read_text())
    return f"{README_BEGIN}\nFrom `benchmarks/results/{path.name}`:\n\n{table(data)}{README_END}"


def write_readme_table(path: Path, readme: Path = README) -> None:
    """Replaces the generated block of benchmarks/README.md with the table of `path`."""
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_block(path) + text[end:])


def print_table(results: list[dict]) -> None:
    names = [k for k, _ in METRICS]
    print(f"{'mode':<7} {'':<7} " + " ".join(f"{n:>19}" for n in names))
    for r in results:
        for what in ("engine_mean", "simulation"):
            print(f"{r['mode']:<7} {what[:7]:<7} " + " ".join(f"{r[what][n]:>19.1f}" for n in names))
        for what in ("error_pct", "engine_spread_pct"):
            print(f"{r['mode']:<7} {what[:7]:<7} " + " ".join(f"{r[what][n]:>+19.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="single,dp2,afd,pd", help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=3, help="engine runs of the validation slice (fresh servers)")
    p.add_argument(
        "--cal-repeats",
        type=int,
        default=2,
        help="engine runs of the calibration slice (fresh servers; dp2's last with round robin)",
    )
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--rate-scale", type=float, default=4.0, help="trace arrivals this many times as fast")
    p.add_argument("--length-scale", type=float, default=1 / 128, help="prompt lengths times this")
    p.add_argument("--output-scale", type=float, default=1 / 16, help="output lengths times this")
    p.add_argument("--cal-start", type=float, default=300.0, help="calibration slice start, trace seconds")
    p.add_argument("--val-start", type=float, default=900.0, help="validation slice start, trace seconds")
    p.add_argument("--duration", type=float, default=300.0, help="trace seconds in each slice")
    p.add_argument("--page-size", type=int, default=4, help="KV page tokens (the scaled trace block)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-mb", type=float, default=256.0)
    p.add_argument("--port", type=int, default=18230)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "afd-validate-sim")
    p.add_argument("--reuse", action="store_true", help="no serving: refit and resimulate the runs in --workdir")
    p.add_argument("--quick", action="store_true", help="single mode, 32 trace seconds per slice, 1 run (no spread)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument(
        "--table", nargs="?", const="", default=None, metavar="PATH", help="print the table of a results file"
    )
    p.add_argument("--write-readme", action="store_true", help="with --table: put the table into benchmarks/README.md")
    args = p.parse_args(argv)
    if args.table is not None:
        path = Path(args.table) if args.table else newest_results()
        if args.write_readme:
            write_readme_table(path)
        print(table(json.loads(path.read_text())), end="")
        return 0
    if args.quick:
        args.modes, args.duration, args.repeats, args.cal_repeats = "single", 32.0, 1, 1
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if args.repeats < 1 or args.cal_repeats < 1:
        p.error("--repeats and --cal-repeats must be at least 1")
    if abs(args.cal_start - args.val_start) < args.duration:
        p.error("the calibration and validation slices overlap")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.workdir)
    t_all = time.monotonic()
    served = []
    for mode in modes:
        served.append(engine_runs(mode, args, model))
        print(f"{mode}: engine runs done in {served[-1]['wall_s']:.0f} s", flush=True)
    calibrations = [calibrate(s, args) for s in served]
    results = [validate_mode(s, c, args) for s, c in zip(served, calibrations)]
    out = {
        "what": "afd plan simulate (step time fitted on a calibration slice) vs the engine's mean over repeated runs",
        "num_threads": 1,
        "trace": str(args.trace.resolve().relative_to(ROOT)) if args.trace.resolve().is_relative_to(ROOT) else "",
        "rate_scale": args.rate_scale,
        "length_scale": args.length_scale,
        "output_scale": args.output_scale,
        "calibration_slice_trace_s": [args.cal_start, args.cal_start + args.duration],
        "validation_slice_trace_s": [args.val_start, args.val_start + args.duration],
        "repeats": args.repeats,
        "refit_of_earlier_runs": args.reuse,  # --reuse: the engine's runs in --workdir, fitted and simulated anew
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "page_size": args.page_size,
        "context": CONTEXT,
        "units": {"ttft_*": "ms", "tpot_*": "ms", "output_tokens_per_s": "tokens/s"},
        "error_pct": "(simulation - engine mean) / engine mean, %",
        "engine_spread_pct": "the largest |run - engine mean| / engine mean over the repeats, %",
        "wall_s": time.monotonic() - t_all,
        "results": results,
    }
    print_table(results)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
