#!/usr/bin/env python3
"""Where a decode step's time goes in the engine process: the forward, and each CPU part around it.

An in-process engine (single mode) decodes N requests together (64, 256, 1024 by default); for a
number of steps after all of them are decoding, each part is timed with perf_counter, with the
overlap scheduler on (the default) and off (--disable-overlap-schedule):

- forward: the model's forward (on the forward thread when overlapping)
- sample: sampling the step's tokens (forward thread)
- build: the runner's step preparation (StepInputs, ForwardBatch.build: page tables, slots, positions)
- schedule: the scheduler's step planning and bookkeeping
- finish: appending the tokens, stop checks, logprobs
- encode: the step's token updates as the control-plane message the engine loop sends (msgpack),
  beside what the JSON encoding with `dataclasses.asdict` that it replaced costs on the same updates

"step" is the wall time per step in the steady state (engine step + encode); "outside" is the share
of it in which no forward runs: the CPU work left on the critical path. Without overlap every
part adds to it; with overlap build, schedule, finish and encode run while the next forward does,
and what is left is sampling, the hand-over between threads and contention for the cores.

    python -m benchmarks.bench_overhead [--running 64 256 1024] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections import defaultdict

import msgspec

from afd_engine import Engine, SamplingParams
from afd_engine.control import messages as msgs
from benchmarks.lib.results import write_json


def busy(intervals: list, fn):
    """fn, recording the (start, end) of every call: the forward thread's busy time."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            intervals.append((t0, time.perf_counter()))

    return wrapper


def overlap_with(intervals: list, start: float, end: float) -> float:
    """Seconds of [start, end] covered by the (disjoint) intervals."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def timed(timers: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter() - t0

    return wrapper


def measure(model_path: str | None, running: int, steps: int, threads: int, overlap: bool) -> dict:
    warmup = -(-running * 8 // 4096) + 3  # prefill of every 8-token prompt, then a few decodes
    params = SamplingParams(max_new_tokens=warmup + steps + 4, temperature=0.0, ignore_eos=True)
    engine = Engine(
        model_path=model_path,
        num_threads=threads,
        max_running_requests=running,
        max_num_batched_tokens=4096,
        max_total_tokens=running * (8 + params.max_new_tokens + 16),
        overlap_schedule="on" if overlap else "off",
    )
    # as an engine process does once loaded (control/loop.py): the objects alive now (modules, the
    # model, ~340,000 of them) leave the garbage collector's reach; otherwise a full collection
    # scans them all (160 ms here), and one landing in the measured steps is no cost of serving
    gc.collect()
    gc.freeze()
    vocab = engine.config.vocab_size
    for i in range(running):
        engine.add_request(prompt_token_ids=[(i * 7 + j) % (vocab - 10) + 5 for j in range(8)], params=params)
    for _ in range(warmup):
        engine.step_updates()
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == running, "not all decoding yet"

    timers: dict[str, float] = defaultdict(float)
    stepper, runner = engine.stepper, engine.runner
    forwards: list[tuple[float, float]] = []
    runner.execute = busy(forwards, runner.execute)
    runner.prepare = timed(timers, "build", runner.prepare)
    stepper.sampler = timed(timers, "sample", stepper.sampler)
    stepper._append_tokens = timed(timers, "finish", stepper._append_tokens)
    engine.scheduler.schedule = timed(timers, "schedule", engine.scheduler.schedule)
    engine.scheduler.step_done = timed(timers, "schedule", engine.scheduler.step_done)
    sent = []
    try:
        start = time.perf_counter()
        for _ in range(steps):
            updates = engine.step_updates()
            t1 = time.perf_counter()
            msgs.encode_output(msgs.StepOutput(updates))
            timers["encode"] += time.perf_counter() - t1
            sent.append(updates)
            assert len(updates) == running
        end = time.perf_counter()
        engine.stepper.drain()
    finally:
        engine.close()
    t0 = time.perf_counter()  # what the JSON encoding the engine loop used before would cost
    for updates in sent:
        stats = msgspec.structs.asdict(msgs.EngineStats())
        body = {"updates": [dataclasses.asdict(u) for u in updates], "stats": stats, "rank": 0}
        json.dumps({"type": "StepOutput", "body": body}).encode()
    timers["encode (json)"] = time.perf_counter() - t0
    ms = {k: 1000 * v / steps for k, v in timers.items()}
    # forward time inside the measured window: with overlap, forwards cross the calls' boundaries
    ms["forward"] = 1000 * overlap_with(forwards, start, end) / steps
    step = 1000 * (end - start) / steps
    return {
        "running": running,
        "overlap": overlap,
        "step_ms": step,
        **{f"{k}_ms": v for k, v in ms.items()},
        "outside_forward": 1 - ms["forward"] / step,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [measure(args.model_path, n, args.steps, args.threads, o) for n in args.running for o in (False, True)]
    cols = ["step", "forward", "sample", "build", "schedule", "finish", "encode", "encode (json)"]
    print(f"{'running':>8} {'overlap':>8} " + " ".join(f"{c + ' ms':>16}" for c in cols) + f" {'outside':>8}")
    for r in rows:
        cells = " ".join(f"{r[c + '_ms']:>16.2f}" for c in cols)
        print(f"{r['running']:>8} {'on' if r['overlap'] else 'off':>8} {cells} {100 * r['outside_forward']:>7.1f}%")
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
