#!/usr/bin/env python3
"""Where a decode step's time goes in the engine process: the forward, and each CPU part around it.

An in-process engine (single mode) decodes N requests together (64, 256, 1024 by default); for a
number of steps after all of them are decoding, each part is timed with perf_counter:

- forward: the model's forward (the runner's `run` minus building its batch tensors)
- build: ForwardBatch.build (page tables, slots, positions)
- sample+stop: sampling and stop checks of the step's tokens
- schedule: the scheduler's step planning and bookkeeping
- encode: the step's token updates as the control-plane message the engine loop sends (msgpack),
  beside what the JSON encoding with `dataclasses.asdict` that it replaced costs on the same updates

"outside" is the share of the step (engine step + encode) spent outside the forward: CPU work on
the critical path, which a GPU would spend idle. Overlapped scheduling is not built yet, so every
figure is without overlap.

    python benchmarks/bench_overhead.py [--running 64 256 1024] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from afd_engine import Engine, SamplingParams
from afd_engine.control import messages as msgs
from afd_engine.runtime.forward_batch import ForwardBatch


def timed(timers: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter() - t0

    return wrapper


def measure(model_path: str | None, running: int, steps: int, threads: int) -> dict:
    warmup = -(-running * 8 // 4096) + 3  # prefill of every 8-token prompt, then a few decodes
    params = SamplingParams(max_new_tokens=warmup + steps + 4, temperature=0.0, ignore_eos=True)
    engine = Engine(
        model_path=model_path,
        num_threads=threads,
        max_running_requests=running,
        max_num_batched_tokens=4096,
        max_total_tokens=running * (8 + params.max_new_tokens + 16),
    )
    vocab = engine.config.vocab_size
    for i in range(running):
        engine.add_request(prompt_token_ids=[(i * 7 + j) % (vocab - 10) + 5 for j in range(8)], params=params)
    for _ in range(warmup):
        engine.step_updates()
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == running, "not all decoding yet"

    timers: dict[str, float] = defaultdict(float)
    build = ForwardBatch.build
    ForwardBatch.build = staticmethod(timed(timers, "build", build))
    engine.runner.run = timed(timers, "run", engine.runner.run)
    engine._append_tokens = timed(timers, "sample+stop", engine._append_tokens)
    engine.scheduler.schedule = timed(timers, "schedule", engine.scheduler.schedule)
    engine.scheduler.step_done = timed(timers, "schedule", engine.scheduler.step_done)
    per_step = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            updates = engine.step_updates()
            t1 = time.perf_counter()
            msgs.encode_output(msgs.StepOutput(updates))
            t2 = time.perf_counter()
            json.dumps({"type": "StepOutput", "body": dataclasses.asdict(msgs.StepOutput(updates))}).encode()
            timers["encode"] += t2 - t1
            timers["encode (json)"] += time.perf_counter() - t2
            per_step.append(t2 - t0)
            assert len(updates) == running
    finally:
        ForwardBatch.build = build
        engine.close()
    ms = {k: 1000 * v / steps for k, v in timers.items()}
    ms["forward"] = ms.pop("run") - ms["build"]
    step = 1000 * statistics.mean(per_step)  # a mean, like the parts: they add up within it
    return {
        "running": running,
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
    rows = [measure(args.model_path, n, args.steps, args.threads) for n in args.running]
    cols = ["step", "forward", "build", "sample+stop", "schedule", "encode", "encode (json)"]
    print(f"{'running':>8} " + " ".join(f"{c + ' ms':>17}" for c in cols) + f" {'outside':>8}")
    for r in rows:
        cells = " ".join(f"{r[c + '_ms']:>17.2f}" for c in cols)
        print(f"{r['running']:>8} {cells} {100 * r['outside_forward']:>7.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
