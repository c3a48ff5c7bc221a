"""The load of bench_vs_vllm.py: bench_serving's load at each concurrency level, repeated with fresh
prompts (levels interleaved), the fastest repeat reported with the share of the cores that other
work took during each."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from bench_serving import parse_args as serving_args
from bench_serving import run_benchmark
from peer_servers import SERVED_NAME, cpu_sample, other_work_share


def num_prompts(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_prompts, args.prompts_per_slot * concurrency)


def load_argv(base_url: str, concurrency: int, prompts: int, input_len: int, output_len: int, seed: int) -> list[str]:
    """bench_serving's arguments for one level: fixed lengths, greedy, seeded random token ids."""
    flags = {
        "--base-url": base_url,
        "--model": SERVED_NAME,
        "--backend": "completions",
        "--dataset-name": "random-ids",
        "--num-prompts": prompts,
        "--random-input-len": input_len,
        "--random-output-len": output_len,
        "--random-range-ratio": 1.0,
        "--max-concurrency": concurrency,
        "--temperature": 0.0,
        "--seed": seed,
        "--warmup-requests": 1,
    }
    return [item for flag, value in flags.items() for item in (flag, str(value))] + ["--disable-tqdm"]


def level_point(concurrency: int, m: dict) -> dict:
    return {
        "concurrency": concurrency,
        "completed": m["completed"],
        "failed": m["failed"],
        "output_tok_s": m["output_throughput"],
        "tpot_p50_ms": m["median_tpot_ms"],
        "tpot_p99_ms": m["p99_tpot_ms"],
        "ttft_p50_ms": m["median_ttft_ms"],
        "e2e_p50_ms": m["median_e2e_latency_ms"],
        "duration_s": m["duration"],
        "total_output_tokens": m["total_output_tokens"],
        "errors": m["errors"],
    }


def _bench(argv: list[str]) -> dict:
    # bench_serving prints its full table per run; it goes to stderr, so that stdout is the summary.
    with contextlib.redirect_stdout(sys.stderr):
        return asyncio.run(run_benchmark(serving_args(argv)))


def load_seed(args: argparse.Namespace, concurrency: int, repeat: int) -> int:
    """Seed of the requests of one level and repeat: the same for both engines, different between
    repeats, so that no repeat finds the previous one's prompts in the prefix cache."""
    return args.seed + concurrency + 1000 * repeat


def best_point(samples: list[dict]) -> dict:
    """The repeat with the highest output throughput (interference from other work only slows a
    run down), with every repeat's throughput beside it."""
    best = dict(max(samples, key=lambda p: p["output_tok_s"]))
    best["samples_tok_s"] = [p["output_tok_s"] for p in samples]
    best["samples_other_work_share"] = [p.get("other_work_share") for p in samples]
    best["failed"] = sum(p["failed"] for p in samples)
    return best


def run_load(base_url: str, args: argparse.Namespace, server_session: int | None = None) -> list[dict]:
    top = max(args.concurrency)
    # Untimed: every batch size up to the largest once, so no level pays for first-time work.
    _bench(load_argv(base_url, top, top, args.input_len, min(args.output_len, 8), seed=10_000 + args.seed))
    samples: dict[int, list[dict]] = {conc: [] for conc in args.concurrency}
    for repeat in range(args.repeats):  # levels interleaved, so a burst of other work hits one repeat
        for conc in args.concurrency:
            seed = load_seed(args, conc, repeat)
            argv = load_argv(base_url, conc, num_prompts(conc, args), args.input_len, args.output_len, seed)
            print(f"load: concurrency {conc}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
            before = cpu_sample(args.core_list, server_session)
            point = level_point(conc, _bench(argv))
            after = cpu_sample(args.core_list, server_session)
            point["other_work_share"] = other_work_share(before, after, len(args.core_list))
            samples[conc].append(point)
    return [best_point(samples[conc]) for conc in args.concurrency]
