#!/usr/bin/env python
"""Offline decode throughput: this engine vs Hugging Face transformers' `generate`, same checkpoint.

Both sides get the same random prompts (equal length, token ids drawn with a fixed seed, never the
special ids 0..4), greedy decoding, exactly --output-len new tokens per sequence (ours with
ignore_eos, transformers with min_new_tokens == max_new_tokens), the same dtype and the same number
of torch threads. Model loading is not timed.

Method:
  * "total" is the wall time of one whole generate call for the batch: prefill + all decode steps.
    output tok/s = batch * output_len / total.
  * "prefill" is the wall time of the same call with max_new_tokens=1 (the batch's time to first
    token: prefill plus one sampled token). decode = total - prefill of the SAME repeat (the two
    calls run back to back), and decode tok/s = batch * (output_len - 1) / decode, i.e. the
    throughput of the remaining decode steps alone.
  * Each repeat runs prefill then total for ours, then the same for transformers (interleaved, so
    background load hits both sides alike). The reported repeat is the BEST one, the one with the
    smallest total; its prefill and decode are reported with it, so seconds = prefill + decode
    (a prefill from one repeat is never subtracted from another repeat's total). All samples are in
    the --json output.
  * Before timing, each side runs --warmup untimed generate calls with a short output.

Run from the repository root: ``python -m benchmarks.bench_offline [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.lib.results import write_json

NUM_SPECIAL_IDS = 5  # ids 0..4 are bos, eos, pad, User, Assistant in the tiny tokenizer
WARMUP_OUTPUT_LEN = 4
METHOD = (
    "wall time of whole generate calls (model load excluded); total = prefill + all decode steps; "
    "prefill = same call with max_new_tokens=1 (batch time to first token); "
    "decode = total - prefill of the same repeat, decode tok/s = B*(OUT-1)/decode; "
    "reported repeat = the one with the smallest total (its own prefill and decode), repeats interleaved between sides"
)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="HF checkpoint directory (default: a tiny DeepSeek-V3, seed 0, made in a temp dir)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2, help="torch threads, the same for both sides")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--warmup", type=int, default=1, help="untimed warmup generate calls per side")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats; the fastest is reported (default 3, --quick 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--quick", action="store_true", help="batch 4, input 8, output 8, repeats 1 unless --repeats (smoke test)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.input_len, args.output_len = 4, 8, 8
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    for name in ("batch_size", "input_len", "output_len", "num_threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def make_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(length)] for _ in range(batch)]


class AfdSide:
    name = "afd"

    def __init__(self, path: str, dtype: str, threads: int) -> None:
        from afd_engine import Engine, SamplingParams

        self._params = SamplingParams
        self.engine = Engine(model_path=path, dtype=dtype, num_threads=threads)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        params = self._params(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        outs = self.engine.generate(prompt_token_ids=prompts, sampling_params=params)
        return [list(o.token_ids) for o in outs]


class HFSide:
    name = "transformers"

    def __init__(self, path: str, dtype: str, threads: int) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        if self.pad is None:
            self.pad = 0

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.int64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
                use_cache=True,
            )
        return out[:, ids.shape[1] :].tolist()


def timed(side, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    tokens = side.generate(prompts, n)
    dt = time.perf_counter() - t0
    got = sum(len(t) for t in tokens)
    assert len(tokens) == len(prompts) and got == len(prompts) * n, (
        f"{side.name}: {got} tokens in {len(tokens)} sequences, expected {len(prompts)} x {n}"
    )
    return dt, tokens


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    tmp = None
    path = args.model_path
    if path is None:
        from afd_engine.tiny_model import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="afd-bench-")
        log("making a tiny deepseek_v3 checkpoint (seed 0)")
        path = str(make_tiny_model(tmp.name, arch="deepseek_v3", seed=0))
    try:
        return _run(args, path)
    finally:
        if tmp is not None:
            tmp.cleanup()


def fastest_repeat(samples: dict) -> tuple[int, float, float, float]:
    """(index, total, prefill, decode) of the repeat with the smallest total: all three from that one
    repeat, so decode = total - prefill of calls that ran back to back."""
    best = min(range(len(samples["total_s"])), key=lambda i: samples["total_s"][i])
    return best, samples["total_s"][best], samples["prefill_s"][best], samples["decode_s"][best]


def _run(args: argparse.Namespace, path: str) -> dict:
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    B, L, OUT = args.batch_size, args.input_len, args.output_len
    prompts = make_prompts(B, L, vocab, args.seed)

    log(f"loading both models from {path}")
    sides = [AfdSide(path, args.dtype, args.num_threads), HFSide(path, args.dtype, args.num_threads)]
    torch.set_num_threads(args.num_threads)  # the engine sets it too; make both sides equal for sure

    for side in sides:
        for i in range(args.warmup):
            log(f"{side.name}: warmup {i + 1}/{args.warmup}")
            side.generate(prompts, min(WARMUP_OUTPUT_LEN, OUT))

    samples = {s.name: {"prefill_s": [], "total_s": [], "decode_s": []} for s in sides}
    tokens = {}
    same_every_repeat = {s.name: True for s in sides}
    for r in range(args.repeats):
        for side in sides:
            t_pre, _ = timed(side, prompts, 1)
            t_tot, got = timed(side, prompts, OUT)
            if side.name in tokens and got != tokens[side.name]:
                same_every_repeat[side.name] = False
            tokens[side.name] = got
            samples[side.name]["prefill_s"].append(t_pre)
            samples[side.name]["total_s"].append(t_tot)
            samples[side.name]["decode_s"].append(t_tot - t_pre)  # paired: same repeat, back to back
            log(f"{side.name}: repeat {r + 1}/{args.repeats}: prefill {t_pre:.3f} s, total {t_tot:.3f} s")

    results = {}
    for side in sides:
        s = samples[side.name]
        best, tot, pre, decode_s = fastest_repeat(s)
        out_tokens = sum(len(t) for t in tokens[side.name])
        assert out_tokens == B * OUT
        results[side.name] = {
            "best_repeat": best,
            "seconds": tot,
            "prefill_seconds": pre,
            "decode_seconds": decode_s,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / tot,
            "decode_tokens": B * (OUT - 1),
            # None when there are no decode steps to measure (OUT == 1) or noise swamps them.
            "decode_tok_s": B * (OUT - 1) / decode_s if OUT > 1 and decode_s > 0 else None,
            "samples": s,
            "same_tokens_every_repeat": same_every_repeat[side.name],
        }

    afd, hf = results["afd"], results["transformers"]
    eos = _eos_ids(path)
    divergences = []
    for i, (a, b) in enumerate(zip(tokens["afd"], tokens["transformers"])):
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is not None:
            divergences.append(
                {"sequence": i, "position": pos, "afd": a[pos], "transformers": b[pos], "afd_is_eos": a[pos] in eos}
            )
    return {
        "config": {
            "model_path": args.model_path or "tiny deepseek_v3 seed 0 (temp dir)",
            "batch_size": B,
            "input_len": L,
            "output_len": OUT,
            "num_threads": args.num_threads,
            "dtype": args.dtype,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
            "torch": torch.__version__,
            "transformers": _hf_version(),
        },
        "method": METHOD,
        "statistic": "fastest repeat by total (prefill and decode from the same repeat)",
        "results": results,
        "ratio_output_tok_s": afd["output_tok_s"] / hf["output_tok_s"],
        "ratio_decode_tok_s": (
            afd["decode_tok_s"] / hf["decode_tok_s"] if afd["decode_tok_s"] and hf["decode_tok_s"] else None
        ),
        "greedy_match": {
            "identical_sequences": B - len(divergences),
            "sequences": B,
            # transformers' min_new_tokens masks EOS out, our ignore_eos only keeps going: where EOS
            # is the argmax we emit it and transformers takes the runner-up, so the rest differs.
            "diverged_at_eos": sum(d["afd_is_eos"] for d in divergences),
            "divergences": divergences,
        },
        "noisy": any(max(r["samples"]["total_s"]) > 1.5 * min(r["samples"]["total_s"]) for r in results.values()),
    }


def _eos_ids(path: str) -> set[int]:
    eos = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} - {None})


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def report(res: dict) -> str:
    c = res["config"]
    lines = [
        (
            f"batch {c['batch_size']}, input {c['input_len']}, output {c['output_len']}, "
            f"{c['dtype']}, {c['num_threads']} threads, best of {c['repeats']} by total (warmup {c['warmup']})"
        ),
        f"{'side':<14}{'seconds':>10}{'prefill s':>11}{'output tok/s':>14}{'decode tok/s':>14}",
    ]
    for name, r in res["results"].items():
        dec = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "n/a"
        lines.append(f"{name:<14}{r['seconds']:>10.3f}{r['prefill_seconds']:>11.3f}{r['output_tok_s']:>14.1f}{dec:>14}")
    lines.append(f"ratio (afd / transformers) output tok/s: {res['ratio_output_tok_s']:.2f}x")
    if res["ratio_decode_tok_s"] is not None:
        lines.append(f"ratio (afd / transformers) decode tok/s: {res['ratio_decode_tok_s']:.2f}x")
    g = res["greedy_match"]
    lines.append(
        f"identical greedy sequences: {g['identical_sequences']}/{g['sequences']} "
        f"({g['diverged_at_eos']} of the {g['sequences'] - g['identical_sequences']} divergences are where "
        f"ours emitted EOS, which transformers' min_new_tokens forbids)"
    )
    if res["noisy"]:
        lines.append("warning: repeats differ by more than 1.5x (machine busy?); rerun for stable numbers")
    lines.append(f"method: {res['method']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    print(report(res))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
