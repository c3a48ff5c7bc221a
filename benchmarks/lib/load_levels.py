"""The load of bench_vs_vllm: bench_serving's load at each concurrency level on each server,
repeated with fresh prompts, the servers taking turns at every level (and the levels interleaved),
the fastest repeat reported with the share of the cores that other work took during each."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from benchmarks.bench_serving import parse_args as serving_args
from benchmarks.bench_serving import run_benchmark
from benchmarks.lib.peer_servers import SERVED_NAME, cpu_sample, idle_check, other_work_share

QUIET_SHARE = 0.02  # a run starts once other work takes less than this share of the cores ...
QUIET_SAMPLE_S = 0.5  # ... over this long
QUIET_MAX_S = 15.0  # or after this long, whatever the cores do


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


def settle(cores: list[int]) -> None:
    """Waits until the cores are quiet: a server just measured keeps some of its threads busy for a
    while after its last request (vLLM's OpenMP threads, seen taking 6% of the cores during the
    next server's run), and that would count against the next one."""
    waited = 0.0
    while waited < QUIET_MAX_S:
        share = idle_check(cores, QUIET_SAMPLE_S)
        waited += QUIET_SAMPLE_S
        if share is None or share < QUIET_SHARE:
            return


def run_levels(servers: dict[str, tuple[str, int | None]], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Per server (name -> (base URL, its process session)), the best repeat of each level.

    Every server stays up throughout and they take turns: each repeat runs every level, and each
    level on every server, one after the other (the first server alternates between repeats).
    This machine's speed drifts by tens of percent within minutes; taking turns lets that drift
    fall on all servers alike instead of on whichever ran in a slow stretch. While one server is
    measured the others idle, and what they use counts as other work; each run starts once the
    cores are quiet (`settle`)."""
    top = max(args.concurrency)
    for base_url, _ in servers.values():
        # Untimed: every batch size up to the largest once, so no level pays for first-time work.
        _bench(load_argv(base_url, top, top, args.input_len, min(args.output_len, 8), seed=10_000 + args.seed))
    samples = {name: {conc: [] for conc in args.concurrency} for name in servers}
    names = list(servers)
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for conc in args.concurrency:
            seed = load_seed(args, conc, repeat)
            for name in order:
                base_url, session = servers[name]
                argv = load_argv(base_url, conc, num_prompts(conc, args), args.input_len, args.output_len, seed)
                print(f"load: {name}, concurrency {conc}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
                settle(args.core_list)
                before = cpu_sample(args.core_list, session)
                point = level_point(conc, _bench(argv))
                after = cpu_sample(args.core_list, session)
                point["other_work_share"] = other_work_share(before, after, len(args.core_list))
                samples[name][conc].append(point)
    return {name: [best_point(samples[name][conc]) for conc in args.concurrency] for name in names}
