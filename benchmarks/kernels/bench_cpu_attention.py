#!/usr/bin/env python3
"""Decode step time with the C MLA decode kernel (attention backend "cpu", the default) against the
torch reference ("torch"), in one process on the same checkpoint and requests.

Two single-mode engines, one per backend, each get the same N requests (fixed prompts, greedy,
ignore_eos) and are stepped in alternating blocks of `--block` steps, so that slow phases of the
machine fall on both; the first block of each (prefill and warm-up) is left out. It reports the
mean step time per block (the context grows by `--block` tokens per block), over the run, the
ratio torch / cpu, and whether both engines generated the same tokens (the kernel sums in another
order than the reference: a near-tie can flip, so this is reported, not assumed).

The default checkpoint has DeepSeek-V3's attention dimensions (latent 512, rope 64; see
benchmarks/dsv3_checkpoint.py), as bench_vs_vllm.py serves.

    python -m benchmarks.kernels.bench_cpu_attention [--running 32] [--output-len 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from afd_engine import Engine, SamplingParams
from benchmarks.dsv3_checkpoint import prepare_model
from benchmarks.lib.results import write_json

BACKENDS = ("torch", "cpu")


def make_engine(model: Path, backend: str, args: argparse.Namespace) -> Engine:
    engine = Engine(
        model_path=str(model),
        attention_backend=backend,
        num_threads=args.threads,
        max_running_requests=args.running,
        max_total_tokens=args.running * (args.input_len + args.output_len + 32),
        overlap_schedule="off",
    )
    if backend == "cpu":
        assert engine.model.model.layers[0].self_attn.kernels.native, "the C kernel is not built on this machine"
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.config.vocab_size
    for i in range(args.running):
        prompt = [(i * 7 + j * 3) % (vocab - 10) + 5 for j in range(args.input_len)]
        engine.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
    return engine


def run(model: Path, args: argparse.Namespace) -> dict:
    engines = {b: make_engine(model, b, args) for b in BACKENDS}
    tokens: dict[str, dict[str, list[int]]] = {b: {} for b in BACKENDS}
    blocks: list[dict] = []
    try:
        while any(e.has_unfinished() for e in engines.values()):
            row = {}
            for b, engine in engines.items():
                t0, steps = time.perf_counter(), 0
                while steps < args.block and engine.has_unfinished():
                    for u in engine.step_updates():
                        tokens[b].setdefault(u.request_id, []).extend(u.token_ids)
                    steps += 1
                row[b] = 1000 * (time.perf_counter() - t0) / max(steps, 1)
            blocks.append(row)
    finally:
        for engine in engines.values():
            engine.close()
    measured = blocks[1:] or blocks
    mean = {b: statistics.fmean(r[b] for r in measured) for b in BACKENDS}
    same = sum(tokens["torch"][rid] == tokens["cpu"][rid] for rid in tokens["torch"])
    return {
        "running": args.running,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "block": args.block,
        "blocks_ms": measured,
        "step_ms": mean,
        "torch_over_cpu": mean["torch"] / mean["cpu"],
        "identical_outputs": same,
        "requests": len(tokens["torch"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint (default: the DeepSeek-V3-attention tiny one)")
    p.add_argument("--running", type=int, default=32, help="requests decoding together")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block", type=int, default=8, help="steps per engine before switching to the other")
    p.add_argument("--threads", type=int, default=2, help="torch threads (both engines)")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="4 requests, 8 tokens in, 12 out, blocks of 4")
    args = p.parse_args(argv)
    if args.quick:
        args.running, args.input_len, args.output_len, args.block = 4, 8, 12, 4
    with tempfile.TemporaryDirectory() as tmp:
        res = run(prepare_model(args.model_path, Path(tmp)), args)
    print(f"{'context':>10} {'torch ms':>10} {'cpu ms':>10} {'torch/cpu':>10}")
    for i, r in enumerate(res["blocks_ms"], start=1):
        ctx = args.input_len + i * args.block
        print(f"{ctx:>10} {r['torch']:>10.2f} {r['cpu']:>10.2f} {r['torch'] / r['cpu']:>10.2f}")
    m = res["step_ms"]
    print(f"{'mean':>10} {m['torch']:>10.2f} {m['cpu']:>10.2f} {res['torch_over_cpu']:>10.2f}")
    print(f"identical greedy outputs: {res['identical_outputs']} of {res['requests']}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
