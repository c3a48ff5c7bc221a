#!/usr/bin/env python3
"""AFD against the colocated DP-attention + EP baseline, same number of worker processes, one run.

Starts each deployment with `afd serve` on this machine and loads it with the serving load
generator (bench_serving), raising client concurrency until the TPOT SLO binds:

    concurrency 1, 2, 4, ... (the last step clipped to the cap)
      stop at the first point whose p50 TPOT is over the SLO, or that has failed requests,
      or at the cap (--max-concurrency, and at most the server's --max-running-requests);
    then one point halfway between the last point that met the SLO and the first that missed it.

Each point sends max(--min-prompts, --prompts-per-slot x concurrency) requests, so most of them
run at the full concurrency. Per deployment it reports every point (output tokens/s per worker
process, TPOT p50 / p99, TTFT p50), the saturation point (the highest throughput per worker with
p50 TPOT within the SLO and no failed request) and whether the SLO bound, i.e. a point at a
higher concurrency exceeded it. When the cap is reached first the best point is only a lower
bound on the throughput at the SLO, and the report says so (`slo_bound: false`). Then the AFD /
colocated ratio of throughput per worker at saturation. `--concurrency` measures a given list
instead of searching. Writes JSON and a PNG (throughput per worker against TPOT p50, the SLO line,
saturation points marked). On a CPU the numbers say how this engine behaves here, not what GPUs
would do.

    python -m benchmarks.bench_afd_vs_colocated [--workers 2] [--slo-tpot-ms 100] [--quick]
    python -m benchmarks.bench_afd_vs_colocated --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from benchmarks.bench_serving import parse_args as serving_args
from benchmarks.bench_serving import run_benchmark
from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, afd_server

# Flags whose default depends on --quick: (full run, quick run).
SIZED_DEFAULTS = {
    "input_len": (32, 8),
    "output_len": (32, 8),
    "min_prompts": (16, 4),
    "prompts_per_slot": (3, 2),
    "max_concurrency": (512, 4),
}
REQUEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Point:
    """One client concurrency of one deployment, as the load generator measured it."""

    concurrency: int
    prompts: int
    failed: int
    output_tok_s_per_worker: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    error: str | None = None  # the first failed request's error

    def meets(self, slo_ms: float) -> bool:
        return self.failed == 0 and self.tpot_p50_ms <= slo_ms

    def exceeds(self, slo_ms: float) -> bool:
        """Over the SLO in a clean measurement (a point with failed requests says nothing about TPOT)."""
        return self.failed == 0 and self.tpot_p50_ms > slo_ms


@dataclass(frozen=True)
class Sweep:
    """The points of one deployment, in order of concurrency, and why measuring stopped:
    "slo" (a point over the SLO), "failed" (failed requests), "cap", or "list" (--concurrency)."""

    points: tuple[Point, ...]
    slo_ms: float
    stopped_by: str

    @property
    def saturation(self) -> Point | None:
        """The highest throughput per worker among the points that meet the SLO."""
        ok = [p for p in self.points if p.meets(self.slo_ms)]
        return max(ok, key=lambda p: p.output_tok_s_per_worker, default=None)

    @property
    def slo_bound(self) -> bool:
        """Whether a point above the saturation point's concurrency exceeded the SLO."""
        floor = self.saturation.concurrency if self.saturation else 0
        return any(p.exceeds(self.slo_ms) for p in self.points if p.concurrency > floor)

    def to_json(self) -> dict:
        sat = self.saturation
        return {
            "points": [asdict(p) for p in self.points],
            "stopped_by": self.stopped_by,
            "saturation": asdict(sat) if sat else None,
            "slo_bound": self.slo_bound,
        }


def search(measure: Callable[[int], Point], slo_ms: float, cap: int, bisect: bool = True) -> Sweep:
    """Doubles the concurrency from 1 until a point misses the SLO or `cap` is measured, then (with
    `bisect`) measures once between the last point that met the SLO and the first that missed it."""
    points = [measure(1)]
    while points[-1].meets(slo_ms) and points[-1].concurrency < cap:
        points.append(measure(min(2 * points[-1].concurrency, cap)))
    last = points[-1]
    if last.meets(slo_ms):
        return Sweep(tuple(points), slo_ms, "cap")
    if bisect and len(points) > 1 and last.concurrency - points[-2].concurrency > 1:
        points.insert(-1, measure((points[-2].concurrency + last.concurrency) // 2))
    return Sweep(tuple(points), slo_ms, "failed" if last.failed else "slo")


def measure_list(measure: Callable[[int], Point], slo_ms: float, concurrencies: list[int]) -> Sweep:
    return Sweep(tuple(measure(c) for c in concurrencies), slo_ms, "list")


def ratio(afd: Sweep, colocated: Sweep) -> float | None:
    """AFD / colocated throughput per worker at saturation; None when either met the SLO nowhere."""
    a, c = afd.saturation, colocated.saturation
    if a is None or c is None or c.output_tok_s_per_worker == 0:
        return None
    return a.output_tok_s_per_worker / c.output_tok_s_per_worker


# ---------------------------------------------------------------------------------------------
# Deployments and measuring
# ---------------------------------------------------------------------------------------------


def deployments(workers: int, micro_batches_afd: int) -> dict[str, list[str]]:
    """Colocated first: `workers` ranks. AFD: half of them attention ranks, the rest one FFN node."""
    a = max(1, workers // 2)
    afd = (
        f"--mode afd --dp-size {a} --ffn-nodes 1 --ffn-ranks-per-node {workers - a} --micro-batches {micro_batches_afd}"
    )
    return {
        f"colocated dp{workers}": f"--mode colocated --dp-size {workers} --micro-batches 2".split(),
        f"afd {a}A + {workers - a}F": afd.split(),
    }


def start_server(model: str | None, flags: list[str]) -> Server:
    """`afd serve FLAGS` on a free port, healthy: served as "bench", one torch thread per rank
    unless FLAGS say otherwise, the embedded tiny model unless `model`."""
    args = ["serve", "--served-model-name", "bench", "--num-threads", "1", *flags]
    return afd_server(*args, *(["--model-path", model] if model else []))


def num_prompts(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_prompts, args.prompts_per_slot * concurrency)


def measure_point(base_url: str, concurrency: int, args: argparse.Namespace) -> Point:
    prompts = num_prompts(concurrency, args)
    flags = ["--base-url", base_url, "--backend", "completions", "--dataset-name", "random-ids"]
    flags += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--disable-tqdm"]
    flags += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    flags += ["--request-timeout", str(REQUEST_TIMEOUT_S)]
    try:
        # bench_serving's own table goes to stderr, beside the progress lines; stdout is the report.
        with contextlib.redirect_stdout(sys.stderr):
            m = asyncio.run(run_benchmark(serving_args(flags)))
    except RuntimeError as exc:  # the warm-up request failed: nothing of this point was served
        return Point(concurrency, prompts, prompts, 0.0, 0.0, 0.0, 0.0, error=str(exc))
    return Point(
        concurrency,
        prompts,
        m["failed"],
        m["output_throughput"] / args.workers,
        m["median_tpot_ms"],
        m["p99_tpot_ms"],
        m["median_ttft_ms"],
        error=m["errors"][0] if m["errors"] else None,
    )


def sweep(name: str, flags: list[str], args: argparse.Namespace) -> Sweep:
    server_flags = [*flags, "--max-running-requests", str(args.max_running_requests)]
    with start_server(args.model_path, server_flags) as server:

        def measure(concurrency: int) -> Point:
            if not server.alive():
                raise RuntimeError(f"{name}: afd serve exited with {server.proc.returncode}")
            print(f"{name}: concurrency {concurrency}", file=sys.stderr, flush=True)
            return measure_point(server.url, concurrency, args)

        if args.concurrency:
            return measure_list(measure, args.slo_tpot_ms, args.concurrency)
        return search(measure, args.slo_tpot_ms, args.cap, bisect=not args.no_bisect)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def verdict(name: str, s: Sweep, cap: int) -> str:
    """One line: where the deployment saturates, and whether the SLO bound there."""
    sat, slo = s.saturation, f"{s.slo_ms:g} ms"
    if s.slo_bound:
        over = next(p for p in s.points if p.exceeds(s.slo_ms) and p.concurrency > (sat.concurrency if sat else 0))
        bound = f"the SLO bound (concurrency {over.concurrency}: TPOT p50 {over.tpot_p50_ms:.1f} ms)"
        if sat is None:
            return f"{name}: no point meets TPOT p50 <= {slo}; {bound}"
        return (
            f"{name}: saturation at concurrency {sat.concurrency}: {sat.output_tok_s_per_worker:.1f} tok/s per "
            f"worker, TPOT p50 {sat.tpot_p50_ms:.1f} ms <= {slo}; {bound}"
        )
    last = s.points[-1]
    why = {
        "cap": f"the cap (concurrency {cap}) was reached with TPOT p50 {last.tpot_p50_ms:.1f} ms",
        "failed": f"requests failed at concurrency {last.concurrency} ({last.error})",
        "list": "no listed concurrency above the best point exceeded it",
    }[s.stopped_by]
    if sat is None:
        return f"{name}: the SLO did not bind: {why}; no point meets it without failed requests"
    return (
        f"{name}: the SLO did not bind: {why}; best {sat.output_tok_s_per_worker:.1f} tok/s per worker at "
        f"concurrency {sat.concurrency} is only a lower bound on the throughput at TPOT p50 <= {slo}"
    )


def ratio_line(sweeps: dict[str, Sweep]) -> str:
    (colo_name, colo), (afd_name, afd) = sweeps.items()
    r = ratio(afd, colo)
    head = f"ratio {afd_name} / {colo_name} of throughput per worker at saturation: "
    if r is None:
        return head + "n/a (a deployment meets the SLO at no point)"
    unbound = [name for name, s in sweeps.items() if not s.slo_bound]
    if unbound:
        return head + f"{r:.3f} (not at saturation: the SLO did not bind for {' and '.join(unbound)})"
    return head + f"{r:.3f}"


def report(sweeps: dict[str, Sweep], cap: int) -> str:
    lines = [
        f"{'deployment':<16} {'conc':>5} {'prompts':>7} {'tok/s/worker':>12} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'TTFT p50':>9}  (ms)"
    ]
    for name, s in sweeps.items():
        for p in s.points:
            best = "saturation" if s.slo_bound else "best, SLO not bound"
            note = best if p == s.saturation else "over SLO" if p.exceeds(s.slo_ms) else ""
            note = f"{p.failed} failed" if p.failed else note
            lines.append(
                f"{name:<16} {p.concurrency:>5} {p.prompts:>7} {p.output_tok_s_per_worker:>12.1f} "
                f"{p.tpot_p50_ms:>9.1f} {p.tpot_p99_ms:>9.1f} {p.ttft_p50_ms:>9.1f}  {note}".rstrip()
            )
    lines += [verdict(name, s, cap) for name, s in sweeps.items()]
    lines.append(ratio_line(sweeps))
    return "\n".join(lines)


def draw(sweeps: dict[str, Sweep], slo_ms: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, s in sweeps.items():
        served = [p for p in s.points if not p.failed]
        (line,) = ax.plot(
            [p.tpot_p50_ms for p in served], [p.output_tok_s_per_worker for p in served], marker="o", label=name
        )
        for p in served:
            xy = (p.tpot_p50_ms, p.output_tok_s_per_worker)
            ax.annotate(str(p.concurrency), xy, fontsize=7, textcoords="offset points", xytext=(3, 3))
        if s.saturation:
            sat = s.saturation
            label = "saturation" if s.slo_bound else "best, SLO not bound"
            ax.plot(
                sat.tpot_p50_ms,
                sat.output_tok_s_per_worker,
                marker="*",
                markersize=15,
                color=line.get_color(),
                linestyle="none",
                label=f"{name}: {label}",
            )
    ax.axvline(slo_ms, color="grey", linestyle="--", linewidth=0.8, label=f"TPOT SLO {slo_ms:g} ms")
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("output tokens/s per worker process")
    ax.set_title("AFD vs colocated (labels: client concurrency)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--workers", type=int, default=2, help="worker processes per deployment")
    p.add_argument("--afd-micro-batches", type=int, default=2)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="the p50 TPOT SLO")
    p.add_argument("--concurrency", type=int, nargs="+", help="measure these client concurrencies, no search")
    p.add_argument("--max-concurrency", type=int, help="the search's cap (default 512; --quick: 4)")
    p.add_argument(
        "--max-running-requests",
        type=int,
        help="passed to afd serve, and a cap of the search too (default: the largest concurrency measured)",
    )
    p.add_argument(
        "--no-bisect", action="store_true", help="no point between the last under the SLO and the first over"
    )
    p.add_argument("--input-len", type=int, help="prompt tokens (default 32; --quick: 8)")
    p.add_argument("--output-len", type=int, help="output tokens (default 32; --quick: 8)")
    p.add_argument("--min-prompts", type=int, help="fewest requests per point (default 16; --quick: 4)")
    p.add_argument("--prompts-per-slot", type=int, help="requests per unit of concurrency (default 3; --quick: 2)")
    p.add_argument("--json", default="bench_afd_vs_colocated.json")
    p.add_argument("--png", default="bench_afd_vs_colocated.png")
    p.add_argument("--quick", action="store_true", help="short requests, concurrency at most 4")
    args = p.parse_args(argv)
    sized = {
        k: both[args.quick] if getattr(args, k) is None else getattr(args, k) for k, both in SIZED_DEFAULTS.items()
    }
    for name, value in sized.items():
        if value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.workers < 2:
        p.error("--workers must be at least 2: AFD needs an attention rank and an FFN rank")
    if args.concurrency and min(args.concurrency) < 1:
        p.error("--concurrency values must be at least 1")
    if args.max_running_requests is not None and args.max_running_requests < 1:
        p.error("--max-running-requests must be at least 1")
    concurrency = sorted(set(args.concurrency)) if args.concurrency else None
    running = args.max_running_requests or (concurrency[-1] if concurrency else sized["max_concurrency"])
    # A server admits at most --max-running-requests per attention rank; past that, requests queue
    # and TPOT stops rising, so the search must not go beyond it.
    cap = min(sized["max_concurrency"], running)
    return argparse.Namespace(
        **{**vars(args), **sized, "concurrency": concurrency, "max_running_requests": running, "cap": cap}
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    flags = deployments(args.workers, args.afd_micro_batches)
    sweeps = {name: sweep(name, f, args) for name, f in flags.items()}
    wall_s = time.monotonic() - start
    print(report(sweeps, args.cap))
    print(f"wall time {wall_s:.0f} s")
    draw(sweeps, args.slo_tpot_ms, args.png)
    (colo_name, colo), (afd_name, afd) = sweeps.items()
    r = ratio(afd, colo)
    record = {
        "settings": vars(args),
        "slo_tpot_ms": args.slo_tpot_ms,
        "deployments": {name: {"flags": flags[name], **s.to_json()} for name, s in sweeps.items()},
        "ratio_afd_over_colocated": r,
        "ratio_at_saturation": r is not None and afd.slo_bound and colo.slo_bound,
        "wall_s": wall_s,
    }
    write_json(args.json, record)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
