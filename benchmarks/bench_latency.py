#!/usr/bin/env python3
"""TPOT at concurrency 1: the single-process engine against AFD (1 attention + 1 FFN rank) and
colocated (2 ranks) deployments on this machine, over the shared-memory and ZeroMQ transports.

At concurrency 1 a deployment has nothing to batch: what it adds to single mode's step is pure
overhead (the agreement round, a descriptor, per layer a dispatch and a combine message per
micro-batch, Python per message). This measures that overhead as a ratio to single mode, in one
run, with every server started by `afd serve` and driven by the serving load generator
(bench_serving, streaming completions, one request at a time). "pinned" runs add --pin-cores,
"no spin" runs --comm-spin-us 0 (a waiting rank sleeps at once; by default, with a core per rank,
it looks for up to 2 ms first while a quarter of its recent waits were that short), "normal
priority" --comm-spin-priority normal (by default a rank looks at Linux's idle priority).

Single mode runs twice, with 1 and with 2 torch threads (a deployment's ranks get 1 each). The
speed of a shared machine drifts by tens of percent within minutes, so every server is started
first and the measurement goes in `--repeats` rounds: in each round every server gets a load of
`--prompts` requests in turn (the order rotating from round to round), and the round's ratio of a
deployment is its TPOT p50 over the faster single run's in that same round. Reported per
deployment: the median TPOT p50 over the rounds, the median of its per-round ratios and a 95%
bootstrap interval of that median (2,000 resamplings of the rounds, seeded). By default a round
is one request per server (40 rounds): on this project's 2-core machine single mode's TPOT moved
over 2.1-4.1 ms between rounds of 4 requests, and an 8-round and a 12-round run of 4 requests
put AFD 1A+1F at 1.51x and 1.72x; rounds of one request keep the servers' turns seconds apart,
not tens.

    python -m benchmarks.bench_latency [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys

from benchmarks.bench_afd_vs_colocated import measure_point, start_server
from benchmarks.lib.results import write_json

SINGLE = ("single 1 thread", "single 2 threads")
DEPLOYMENTS = {  # name -> afd serve flags (--num-threads 1 is start_server's; the single runs override it)
    "single 1 thread": "--mode single",
    "single 2 threads": "--mode single --num-threads 2",
    "afd 1A+1F mb3 shm": "--mode afd --dp-size 1 --micro-batches 3 --transport shm",
    "afd 1A+1F mb1 shm": "--mode afd --dp-size 1 --micro-batches 1 --transport shm",
    "afd 1A+1F mb3 zmq": "--mode afd --dp-size 1 --micro-batches 3 --transport zmq",
    "afd 1A+1F mb3 shm pinned": "--mode afd --dp-size 1 --micro-batches 3 --transport shm --pin-cores",
    "afd 1A+1F mb3 shm no spin": "--mode afd --dp-size 1 --micro-batches 3 --transport shm --comm-spin-us 0",
    "afd 1A+1F mb3 shm normal priority": "--mode afd --dp-size 1 --micro-batches 3 --transport shm "
    "--comm-spin-priority normal",
    "colocated dp2 shm": "--mode colocated --dp-size 2 --transport shm",
    "colocated dp2 shm no spin": "--mode colocated --dp-size 2 --transport shm --comm-spin-us 0",
    "colocated dp2 shm normal priority": "--mode colocated --dp-size 2 --transport shm --comm-spin-priority normal",
    "colocated dp2 shm pinned": "--mode colocated --dp-size 2 --transport shm --pin-cores",
    "colocated dp2 zmq": "--mode colocated --dp-size 2 --transport zmq",
}
QUICK = ("single 1 thread", "single 2 threads", "afd 1A+1F mb3 shm")  # a smoke run: two baselines, one deployment


def measure(args: argparse.Namespace) -> dict[str, list]:
    """Every deployment's bench_serving points, one per round; all servers run throughout."""
    point_args = argparse.Namespace(
        min_prompts=args.prompts, prompts_per_slot=1, input_len=args.input_len, output_len=args.output_len, workers=1
    )
    points: dict[str, list] = {name: [] for name in args.deployments}
    with contextlib.ExitStack() as running:
        servers = {}
        for name in args.deployments:
            print(f"starting {name}", file=sys.stderr, flush=True)
            servers[name] = running.enter_context(start_server(args.model_path, DEPLOYMENTS[name].split()))
        names = list(args.deployments)
        for i in range(args.repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                server = servers[name]
                if not server.alive():
                    raise RuntimeError(f"{name}: afd serve exited with {server.proc.returncode}")
                print(f"round {i + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                points[name].append(measure_point(server.url, 1, point_args))
    for name, pts in points.items():
        failed = [p for p in pts if p.failed]
        if failed:
            raise RuntimeError(f"{name}: {sum(p.failed for p in failed)} requests failed ({failed[0].error})")
    return points


def summarize(points: dict[str, list]) -> tuple[dict[str, dict], dict]:
    """Per deployment: the rounds' TPOT p50s, their median, the per-round ratios to the faster single
    run of that round and their median. Also the baseline: the single run with the lower median."""
    singles = [n for n in SINGLE if n in points]
    rounds = len(next(iter(points.values())))
    base_by_round = [min(points[n][i].tpot_p50_ms for n in singles) for i in range(rounds)]
    results = {}
    for name, pts in points.items():
        tpots = [p.tpot_p50_ms for p in pts]
        ratios = [t / b for t, b in zip(tpots, base_by_round)]
        results[name] = {
            "tpot_p50_ms": statistics.median(tpots),
            "repeats_ms": tpots,
            "ratios": ratios,
            "vs_single": statistics.median(ratios),
            "vs_single_95": median_interval(ratios),
            "ttft_p50_ms": statistics.median(p.ttft_p50_ms for p in pts),
        }
    base_name = min(singles, key=lambda n: results[n]["tpot_p50_ms"])
    return results, {"baseline": base_name, "baseline_tpot_ms": results[base_name]["tpot_p50_ms"]}


def median_interval(values: list[float], level: float = 0.95, draws: int = 2000, seed: int = 0) -> list[float]:
    """A bootstrap interval of the median of `values`: the middle `level` of the medians of `draws`
    resamplings (with replacement, same size), seeded so that a run's report is reproducible."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return [medians[cut], medians[draws - 1 - cut]]


def report(results: dict[str, dict], baseline: str) -> str:
    width = max(len("deployment"), *map(len, results))
    head = f"{'deployment':<{width}} {'TPOT p50 ms':>11} {'x single':>9} {'95% interval':>12} {'round ratios':>12}"
    lines = [f"{head}  TPOT per round (ms)"]
    for name, r in results.items():
        reps = " ".join(f"{t:.2f}" for t in r["repeats_ms"])
        spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}"
        lo, hi = r["vs_single_95"]
        mark = "  (baseline)" if name == baseline else ""
        row = (
            f"{name:<{width}} {r['tpot_p50_ms']:>11.2f} {r['vs_single']:>9.2f} {f'{lo:.2f}-{hi:.2f}':>12} {spread:>12}"
        )
        lines.append(f"{row}  {reps}{mark}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=None, help="default: all")
    p.add_argument("--prompts", type=int, default=1, help="requests per server and round, one at a time")
    p.add_argument("--repeats", type=int, default=40, help="rounds over all servers")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="two single baselines and AFD 1A+1F, small sizes (a smoke run)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.deployments = args.deployments or list(QUICK)
        args.prompts, args.repeats, args.input_len, args.output_len = 2, 2, 8, 16
    args.deployments = args.deployments or list(DEPLOYMENTS)
    if not any(n in SINGLE for n in args.deployments):
        p.error(f"--deployments needs a single-mode baseline: one of {', '.join(SINGLE)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results, summary = summarize(measure(args))
    print(report(results, summary["baseline"]))
    if args.json:
        write_json(args.json, {**summary, "deployments": results, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
