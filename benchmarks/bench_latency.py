#!/usr/bin/env python3
"""TPOT at concurrency 1: the single-process engine against AFD (1 attention + 1 FFN rank) and
colocated (2 ranks) deployments on this machine, over the shared-memory and ZeroMQ transports.

At concurrency 1 a deployment has nothing to batch: what it adds to single mode's step is pure
overhead (the agreement round, a descriptor, per layer a dispatch and a combine message per
micro-batch, Python per message). This measures that overhead as a ratio to single mode, in one
run, with every server started by `afd serve` and driven by the serving load generator
(bench_serving, streaming completions, one request at a time). "pinned" runs add --pin-cores.

Single mode runs twice, with 1 and with 2 torch threads (a deployment's ranks get 1 each); the
faster is the baseline. Each deployment is measured `--repeats` times (each a fresh load of
`--prompts` requests on the same server), and the median of the TPOT p50s is reported.

    python benchmarks/bench_latency.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from afd_engine.distributed.rendezvous import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_afd_vs_colocated import measure_point, start_server  # noqa: E402

SINGLE = ("single 1 thread", "single 2 threads")
DEPLOYMENTS = {  # name -> afd serve flags (--num-threads 1 is start_server's; the single runs override it)
    "single 1 thread": "--mode single",
    "single 2 threads": "--mode single --num-threads 2",
    "afd 1A+1F mb3 shm": "--mode afd --dp-size 1 --micro-batches 3 --transport shm",
    "afd 1A+1F mb1 shm": "--mode afd --dp-size 1 --micro-batches 1 --transport shm",
    "afd 1A+1F mb3 zmq": "--mode afd --dp-size 1 --micro-batches 3 --transport zmq",
    "afd 1A+1F mb3 shm pinned": "--mode afd --dp-size 1 --micro-batches 3 --transport shm --pin-cores",
    "colocated dp2 shm": "--mode colocated --dp-size 2 --transport shm",
    "colocated dp2 shm pinned": "--mode colocated --dp-size 2 --transport shm --pin-cores",
    "colocated dp2 zmq": "--mode colocated --dp-size 2 --transport zmq",
}
QUICK = ("single 1 thread", "single 2 threads", "afd 1A+1F mb3 shm", "colocated dp2 shm")


def measure(name: str, args: argparse.Namespace) -> dict:
    """TPOT p50 of each repeat, and their median, of one deployment."""
    port = free_port("127.0.0.1")
    proc = start_server(args.model_path, DEPLOYMENTS[name].split(), port)
    point_args = argparse.Namespace(
        min_prompts=args.prompts, prompts_per_slot=1, input_len=args.input_len, output_len=args.output_len, workers=1
    )
    try:
        points = []
        for i in range(args.repeats):
            print(f"{name}: repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            points.append(measure_point(f"http://127.0.0.1:{port}", 1, point_args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    failed = sum(p.failed for p in points)
    if failed:
        raise RuntimeError(f"{name}: {failed} requests failed ({next(p.error for p in points if p.failed)})")
    tpots = [p.tpot_p50_ms for p in points]
    return {"tpot_p50_ms": statistics.median(tpots), "repeats_ms": tpots, "ttft_p50_ms": points[-1].ttft_p50_ms}


def summarize(results: dict[str, dict]) -> dict:
    """Adds each deployment's ratio to the faster single run; returns the baseline."""
    base_name = min((n for n in SINGLE if n in results), key=lambda n: results[n]["tpot_p50_ms"])
    base = results[base_name]["tpot_p50_ms"]
    for r in results.values():
        r["vs_single"] = r["tpot_p50_ms"] / base
    return {"baseline": base_name, "baseline_tpot_ms": base}


def report(results: dict[str, dict], baseline: str) -> str:
    lines = [f"{'deployment':<26} {'TPOT p50 ms':>11} {'x single':>9}  repeats (ms)"]
    for name, r in results.items():
        reps = " ".join(f"{t:.2f}" for t in r["repeats_ms"])
        mark = "  (baseline)" if name == baseline else ""
        lines.append(f"{name:<26} {r['tpot_p50_ms']:>11.2f} {r['vs_single']:>9.2f}  {reps}{mark}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=None, help="default: all")
    p.add_argument("--prompts", type=int, default=8, help="requests per repeat, one at a time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="four deployments, small sizes (a smoke run)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.deployments = args.deployments or list(QUICK)
        args.prompts, args.repeats, args.input_len, args.output_len = 2, 1, 8, 16
    args.deployments = args.deployments or list(DEPLOYMENTS)
    if not any(n in SINGLE for n in args.deployments):
        p.error(f"--deployments needs a single-mode baseline: one of {', '.join(SINGLE)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results = {name: measure(name, args) for name in args.deployments}
    summary = summarize(results)
    print(report(results, summary["baseline"]))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "deployments": results, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
