#!/usr/bin/env python3
"""Prefix cache: what reusing cached prompt prefixes buys on a shared-system-prompt workload, one run.

Starts `afd serve` (the embedded tiny model unless --model-path) once per deployment and runs the
same generated-shared-prefix workload (bench_serving: every group of requests shares a long random
system prompt, groups interleaved, token-id prompts over /v1/completions) against each:

  (a) one rank, prefix cache on vs --disable-radix-cache: output throughput, median TTFT and the
      cache hit rate (cached / prompt tokens, from each response's usage), and the on / off ratios;
  (b) --mode colocated --dp-size 2, --load-balance-method cache_aware vs round_robin: hit rate and
      throughput.

Prints a markdown table; --json writes every figure, with the server's own prefix-cache counters
(warm-up request included) beside the client's. Every server is a fresh process, so no run sees
another's cache.

    python -m benchmarks.bench_prefix_cache [--json prefix_cache.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httpx

from benchmarks.bench_afd_vs_colocated import start_server
from benchmarks.bench_serving import parse_args as serving_args
from benchmarks.bench_serving import run_benchmark
from benchmarks.lib.results import write_json

SINGLE_ON, SINGLE_OFF = "1 rank, cache on", "1 rank, cache off"
DP_AWARE, DP_RR = "2 ranks, cache_aware", "2 ranks, round_robin"
DEPLOYMENTS = {
    SINGLE_ON: ["--mode", "single"],
    SINGLE_OFF: ["--mode", "single", "--disable-radix-cache"],
    DP_AWARE: ["--mode", "colocated", "--dp-size", "2", "--load-balance-method", "cache_aware"],
    DP_RR: ["--mode", "colocated", "--dp-size", "2", "--load-balance-method", "round_robin"],
}
# Figures copied from bench_serving's metrics into each run's record.
FIGURES = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "total_cached_tokens",
    "cache_hit_rate",
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_e2e_latency_ms",
)
SERVER_COUNTERS = ("afd_prefix_cache_hit_tokens_total", "afd_prefix_cache_queried_tokens_total")


def workload_flags(args: argparse.Namespace, url: str) -> list[str]:
    """bench_serving's command line for the workload every deployment gets."""
    return [
        "--base-url",
        url,
        "--backend",
        "completions",
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        str(args.num_groups),
        "--gsp-prompts-per-group",
        str(args.prompts_per_group),
        "--gsp-system-prompt-len",
        str(args.system_prompt_len),
        "--gsp-question-len",
        str(args.question_len),
        "--gsp-output-len",
        str(args.output_len),
        "--max-concurrency",
        str(args.max_concurrency),
        "--seed",
        str(args.seed),
        "--request-timeout",
        str(args.request_timeout),
        "--disable-tqdm",
    ]


def server_counters(url: str) -> dict[str, float]:
    """The server's prefix-cache counters from /metrics (summed over its attention ranks)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERVER_COUNTERS:
            found[name] = float(value)
    return found


def measure(name: str, args: argparse.Namespace) -> dict:
    """Serves one deployment, runs the workload against it, and returns its figures."""
    print(f"== {name}", file=sys.stderr, flush=True)
    with start_server(args.model_path, DEPLOYMENTS[name]) as server:
        metrics = asyncio.run(run_benchmark(serving_args(workload_flags(args, server.url))))
        counters = server_counters(server.url)
    if metrics["cache_hit_rate"] is None:
        raise RuntimeError(f"{name}: no response reported its cached prompt tokens; nothing to compare")
    return {"server_flags": DEPLOYMENTS[name], **{k: metrics[k] for k in FIGURES}, "server": counters}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def comparisons(runs: dict[str, dict]) -> dict:
    """The on / off and cache_aware / round_robin figures, and whether the targets were reached."""
    on, off, aware, rr = runs[SINGLE_ON], runs[SINGLE_OFF], runs[DP_AWARE], runs[DP_RR]
    c = {
        "throughput_on_over_off": _ratio(on["output_throughput"], off["output_throughput"]),
        "median_ttft_off_over_on": _ratio(off["median_ttft_ms"], on["median_ttft_ms"]),
        "hit_rate_cache_aware_minus_round_robin": aware["cache_hit_rate"] - rr["cache_hit_rate"],
        "throughput_cache_aware_over_round_robin": _ratio(aware["output_throughput"], rr["output_throughput"]),
    }
    c["target_cache_2x_throughput_or_3x_ttft"] = (c["throughput_on_over_off"] or 0) >= 2.0 or (
        c["median_ttft_off_over_on"] or 0
    ) >= 3.0
    c["target_cache_aware_hit_rate_above_round_robin"] = c["hit_rate_cache_aware_minus_round_robin"] > 0
    return c


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"x{value:.2f}"


def markdown(runs: dict[str, dict], c: dict) -> str:
    lines = [
        "| deployment | output tok/s | median TTFT ms | cache hit rate | requests ok / failed |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.1f} | {r['cache_hit_rate']:.3f} "
            f"| {r['completed']} / {r['failed']} |"
        )
    lines += [
        "",
        f"- cache on / off, 1 rank: output throughput {_x(c['throughput_on_over_off'])}, "
        f"median TTFT lower {_x(c['median_ttft_off_over_on'])} "
        f"(target >= 2x or >= 3x: {'met' if c['target_cache_2x_throughput_or_3x_ttft'] else 'not met'})",
        f"- 2 ranks, cache_aware vs round_robin: hit rate {c['hit_rate_cache_aware_minus_round_robin']:+.3f}, "
        f"output throughput {_x(c['throughput_cache_aware_over_round_robin'])} "
        f"(target: higher hit rate: {'met' if c['target_cache_aware_hit_rate_above_round_robin'] else 'not met'})",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="checkpoint (default: the embedded tiny model, context 512 tokens)")
    p.add_argument("--num-groups", type=int, default=64, help="system prompts")
    p.add_argument("--prompts-per-group", type=int, default=16, help="questions per system prompt")
    p.add_argument("--system-prompt-len", type=int, default=384, help="tokens")
    p.add_argument("--question-len", type=int, default=32, help="tokens")
    p.add_argument("--output-len", type=int, default=32, help="tokens")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds; a request past it counts as failed")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--quick", action="store_true", help="a tiny workload (2 groups of 4 short requests)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_groups, args.prompts_per_group, args.max_concurrency, args.request_timeout = 2, 4, 4, 20.0
        args.system_prompt_len, args.question_len, args.output_len = 64, 8, 4
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit code 1 when any request failed (the figures are still printed and written)."""
    args = parse_args(argv)
    runs = {name: measure(name, args) for name in DEPLOYMENTS}
    c = comparisons(runs)
    print(markdown(runs, c), flush=True)
    if args.json:
        write_json(args.json, {"settings": vars(args), "runs": runs, "comparisons": c})
        print(f"wrote {args.json}")
    return 1 if any(r["failed"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
