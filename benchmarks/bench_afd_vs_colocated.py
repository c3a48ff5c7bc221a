#!/usr/bin/env python3
"""AFD against the colocated DP-attention + EP baseline, same number of worker processes, one run.

Starts each deployment with `afd serve` on this machine, sweeps client concurrency with the
serving load generator (bench_serving), and reports per deployment and concurrency: output
tokens/s per worker process, TPOT p50 / p99, and the best throughput per worker whose p50 TPOT
meets the SLO. Writes JSON and a PNG (throughput per worker against TPOT, one curve per
deployment). On a CPU the numbers say how this engine behaves here, not what GPUs would do.

    python benchmarks/bench_afd_vs_colocated.py [--workers 2] [--concurrency 1 4 16] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from afd_engine.distributed.rendezvous import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import parse_args as serving_args  # noqa: E402
from bench_serving import run_benchmark  # noqa: E402


def deployments(workers: int, micro_batches_afd: int) -> dict[str, list[str]]:
    """Colocated: `workers` ranks. AFD: half of them attention ranks, the rest one FFN node."""
    a = max(1, workers // 2)
    return {
        f"colocated dp{workers}": ["--mode", "colocated", "--dp-size", str(workers), "--micro-batches", "2"],
        f"afd {a}A + {workers - a}F": [
            "--mode",
            "afd",
            "--dp-size",
            str(a),
            "--ffn-nodes",
            "1",
            "--ffn-ranks-per-node",
            str(workers - a),
            "--micro-batches",
            str(micro_batches_afd),
        ],
    }


def start_server(model: str | None, flags: list[str], port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "afd_engine.cli",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--num-threads",
        "1",
        *flags,
    ] + (["--model-path", model] if model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"afd serve {' '.join(flags)} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy within 300 s")


def sweep(name: str, flags: list[str], args) -> list[dict]:
    port = free_port("127.0.0.1")
    proc = start_server(args.model_path, flags, port)
    points = []
    try:
        for conc in args.concurrency:
            print(f"{name}: concurrency {conc}", file=sys.stderr, flush=True)
            m = asyncio.run(
                run_benchmark(
                    serving_args(
                        [
                            "--base-url",
                            f"http://127.0.0.1:{port}",
                            "--backend",
                            "completions",
                            "--dataset-name",
                            "random-ids",
                            "--num-prompts",
                            str(max(args.min_prompts, 2 * conc)),
                            "--random-input-len",
                            str(args.input_len),
                            "--random-output-len",
                            str(args.output_len),
                            "--max-concurrency",
                            str(conc),
                            "--disable-tqdm",
                        ]
                    )
                )
            )
            points.append(
                {
                    "concurrency": conc,
                    "failed": m["failed"],
                    "output_tok_s_per_worker": m["output_throughput"] / args.workers,
                    "tpot_p50_ms": m["median_tpot_ms"],
                    "tpot_p99_ms": m["p99_tpot_ms"],
                    "ttft_p50_ms": m["median_ttft_ms"],
                }
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return points


def at_slo(points: list[dict], slo_ms: float) -> float:
    ok = [p["output_tok_s_per_worker"] for p in points if p["tpot_p50_ms"] <= slo_ms and not p["failed"]]
    return max(ok, default=0.0)


def draw(results: dict[str, list[dict]], slo_ms: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, points in results.items():
        ax.plot(
            [p["tpot_p50_ms"] for p in points], [p["output_tok_s_per_worker"] for p in points], marker="o", label=name
        )
        for p in points:
            ax.annotate(
                str(p["concurrency"]),
                (p["tpot_p50_ms"], p["output_tok_s_per_worker"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 3),
            )
    ax.axvline(slo_ms, color="grey", linestyle="--", linewidth=0.8, label=f"TPOT SLO {slo_ms:g} ms")
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("output tokens/s per worker process")
    ax.set_title("AFD vs colocated (labels: client concurrency)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--workers", type=int, default=2, help="worker processes per deployment")
    p.add_argument("--afd-micro-batches", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--json", default="bench_afd_vs_colocated.json")
    p.add_argument("--png", default="bench_afd_vs_colocated.png")
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, short requests")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.input_len, args.output_len, args.min_prompts = [1, 4], 8, 4, 4
    results = {
        name: sweep(name, flags, args) for name, flags in deployments(args.workers, args.afd_micro_batches).items()
    }
    print(f"{'deployment':<22} {'conc':>5} {'tok/s/worker':>13} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12}")
    for name, points in results.items():
        for pt in points:
            print(
                f"{name:<22} {pt['concurrency']:>5} {pt['output_tok_s_per_worker']:>13.1f} "
                f"{pt['tpot_p50_ms']:>12.1f} {pt['tpot_p99_ms']:>12.1f}"
            )
    best = {name: at_slo(points, args.slo_tpot_ms) for name, points in results.items()}
    names = list(best)
    ratio = best[names[1]] / best[names[0]] if best[names[0]] else float("nan")
    for name, value in best.items():
        print(f"throughput per worker at TPOT p50 <= {args.slo_tpot_ms:g} ms, {name}: {value:.1f} tok/s")
    print(f"ratio {names[1]} / {names[0]} at the SLO: {ratio:.3f}")
    draw(results, args.slo_tpot_ms, args.png)
    Path(args.json).write_text(
        json.dumps(
            {"settings": vars(args), "results": results, "at_slo": best, "ratio_afd_over_colocated": ratio}, indent=2
        )
    )
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
