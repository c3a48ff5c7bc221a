#!/usr/bin/env python
"""Speculative decoding with the MTP module: throughput and TPOT with speculation off and on.

For each mode (single process; AFD with one attention and one FFN rank), each setting (off, then
--speculative-num-steps 1, 2, 3) and each concurrency (1, 8, 32 requests at once), a fresh engine
runs the same greedy requests: prompts cut from the embedded model's held-out text (real prose,
so the acceptance is what a user sees), exactly --output-len new tokens each (ignore_eos).

Method (as bench_offline.py): "total" is the wall time of one generate call for the batch;
"prefill" the same call with max_new_tokens=1; decode = total - prefill of the same repeat;
TPOT = decode / (output_len - 1), output tok/s = concurrency x output_len / total. The fastest of
--repeats repeats is reported; each engine runs one untimed warmup call first. The accepted length
is the engine's own count over the timed calls: tokens per verification of a drafting request
(accepted drafts + the target's token). Every setting's outputs are checked equal to speculation
off (greedy speculation is exact).

Run from the repository root: ``python -m benchmarks.bench_spec [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.default_model import default_model_path
from benchmarks.lib.results import write_json

METHOD = (
    "greedy, ignore_eos, fresh engine per (mode, setting, concurrency); total = one generate call for the batch, "
    "prefill = same call with max_new_tokens=1, TPOT = (total - prefill) / (output_len - 1), "
    "tok/s = concurrency * output_len / total; fastest of the repeats; accepted length = 1 + accepted drafts per "
    "verification of a drafting request, over the timed calls"
)
MODES = {"single": dict(mode="single"), "afd": dict(mode="afd", dp_size=1, ffn_nodes=1, ffn_ranks_per_node=1)}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint with an MTP module (default: the embedded model)")
    p.add_argument("--modes", default="single,afd", help="comma-separated: single, afd")
    p.add_argument("--steps", default="0,1,2,3", help="draft steps per setting; 0 is speculation off")
    p.add_argument("--concurrency", default="1,8,32", help="requests at once, comma-separated")
    p.add_argument("--input-len", type=int, default=48, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--device", default=None, help="the engine's --device (default: its own default)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="single mode, steps 0 and 1, concurrency 1 and 2, short")
    args = p.parse_args(argv)
    if args.quick:
        args.modes, args.steps, args.concurrency = "single", "0,1", "1,2"
        args.input_len, args.output_len, args.repeats = 16, 12, 1
    return args


def prompts(tokenizer, model_path, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: the openings of the model's held-out paragraphs that are long
    enough, in order (repeated when there are fewer than n); a checkpoint without held-out text
    gets windows of its tokenizer's decoded vocabulary."""
    heldout = Path(model_path) / "heldout.txt"
    if heldout.exists():
        encoded = (tokenizer.encode(p, add_special_tokens=False) for p in heldout.read_text().split("\n\n"))
        openings = [ids[:length] for ids in encoded if len(ids) >= length]
    else:
        ids = tokenizer.encode(" ".join(tokenizer.decode([i]) for i in range(5, 400)), add_special_tokens=False)
        openings = [ids[i : i + length] for i in range(0, len(ids) - length, length)]
    return [openings[i % len(openings)] for i in range(n)]


def run_setting(args, model_path: str, mode: str, steps: int, concurrency: int, batch: list[list[int]]) -> dict:
    flags = dict(model_path=model_path, dtype=args.dtype, num_threads=args.num_threads, **MODES[mode])
    if getattr(args, "device", None):
        flags["device"] = args.device
    if steps:
        flags.update(speculative_algorithm="NEXTN", speculative_num_steps=steps)
    full = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    with Engine(**flags) if mode == "single" else make_engine(**flags) as engine:
        engine.generate(prompt_token_ids=batch, sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        before = _counters(engine)
        best = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(prompt_token_ids=batch, sampling_params=first)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = engine.generate(prompt_token_ids=batch, sampling_params=full)
            total = time.perf_counter() - t0
            if best is None or total < best[1]:
                best = (prefill, total, [o.token_ids for o in outs])
        after = _counters(engine)
    prefill, total, tokens = best
    verifies, accepted = after[0] - before[0], after[1] - before[1]
    return {
        "mode": mode,
        "steps": steps,
        "concurrency": concurrency,
        "total_s": round(total, 4),
        "prefill_s": round(prefill, 4),
        "tpot_ms": round(1000 * (total - prefill) / (args.output_len - 1), 3),
        "output_tokens_per_s": round(concurrency * args.output_len / total, 1),
        "accepted_length": round(1 + accepted / verifies, 3) if verifies else None,
        "tokens": tokens,
    }


def _counters(engine) -> tuple[int, int]:
    """(verifications, accepted drafts) since start."""
    if isinstance(engine, Engine):
        c = getattr(engine.stepper, "counters", None)
        return (c.verifies, c.accepted) if c is not None else (0, 0)
    time.sleep(0.6)  # the ranks' counters arrive with their next heartbeat
    s = engine.stats
    return s.spec_verifies, s.spec_accepted


def main(argv=None) -> int:
    args = parse_args(argv)
    model_path = args.model_path or str(default_model_path())
    steps = [int(s) for s in args.steps.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    with Engine(model_path=model_path, dtype="float32", num_threads=1) as probe:
        tokenizer = probe.tokenizer
    rows = []
    for mode in args.modes.split(","):
        for c in levels:
            batch = prompts(tokenizer, model_path, c, args.input_len)
            off = None
            for s in steps:
                log(f"{mode}: {s} draft steps, concurrency {c}")
                row = run_setting(args, model_path, mode, s, c, batch)
                if s == 0:
                    off = row
                else:
                    row["exact"] = off is None or row["tokens"] == off["tokens"]
                    if off is not None:
                        row["tpot_vs_off"] = round(row["tpot_ms"] / off["tpot_ms"], 3)
                        row["throughput_vs_off"] = round(row["output_tokens_per_s"] / off["output_tokens_per_s"], 3)
                rows.append(row)
    for row in rows:
        row.pop("tokens")
    _print(rows)
    if args.json:
        write_json(
            args.json,
            {
                "method": METHOD,
                "model_path": "embedded default model" if args.model_path is None else args.model_path,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "num_threads": args.num_threads,
                "results": rows,
            },
        )
    return 0 if all(r.get("exact", True) for r in rows) else 1


def _print(rows: list[dict]) -> None:
    line = "{:7} {:>5} {:>5} {:>9} {:>8} {:>10} {:>9} {:>6}"
    print(line.format("mode", "steps", "conc", "TPOT ms", "tok/s", "accept len", "TPOT/off", "exact"))
    for r in rows:
        acc = "-" if r["accepted_length"] is None else f"{r['accepted_length']:.2f}"
        ratio = f"{r['tpot_vs_off']:.2f}" if "tpot_vs_off" in r else "-"
        cells = (r["mode"], r["steps"], r["concurrency"], f"{r['tpot_ms']:.2f}", f"{r['output_tokens_per_s']:.1f}")
        print(line.format(*cells, acc, ratio, str(r.get("exact", "-"))))


if __name__ == "__main__":
    sys.exit(main())
