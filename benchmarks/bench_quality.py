#!/usr/bin/env python
"""Output quality: perplexity of one checkpoint on held-out text, transformers against the engine.

The text (default: the shipped model's `heldout.txt`) is tokenized once with the checkpoint's
tokenizer (bos first) and cut into consecutive windows of --window-len + 1 tokens; the first token
of a window is context only, so each window scores --window-len next-token predictions, as the
training script's held-out perplexity does. Perplexity = exp(sum of -logprob / scored tokens).

  * reference: transformers' AutoModelForCausalLM in float32, log-softmax of its own logits.
  * engine: prompt logprobs (`SamplingParams(max_new_tokens=0, prompt_logprobs=0)`) of every window,
    in each configuration of CONFIGS (single, colocated, AFD with each wire format, Triton kernels).

Triton on a CPU runs under Triton's interpreter, far slower than torch, so the `triton-*`
configurations score only --triton-windows windows of --triton-window-len tokens; their reference is
transformers on those same windows. Nothing here asserts quality: the table reports it.

Run from the repository root: ``python -m benchmarks.bench_quality [--windows N] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first import of a Triton kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

from afd_engine.default_model import default_model_path  # noqa: E402  (after TRITON_INTERPRET is set)
from benchmarks.lib.results import write_json  # noqa: E402

AFD = dict(mode="afd", dp_size=1, ffn_nodes=2, ffn_ranks_per_node=1)  # 1 attention rank, 2 FFN ranks
TRITON = dict(mode="single", attention_backend="triton", moe_backend="triton")
REFERENCE = {"torch": "transformers-fp32", "triton": "transformers-fp32 (triton windows)"}  # row names

# name -> EngineArgs keywords; afd-<dispatch>-<combine> names the two wire formats
CONFIGS: dict[str, dict] = {
    "single-fp32": dict(mode="single", dtype="float32"),
    "single-bf16": dict(mode="single", dtype="bfloat16"),
    "colocated-dp2-fp32": dict(mode="colocated", dp_size=2, dtype="float32"),
    **{
        f"afd-{d}-{c}": dict(AFD, dtype="float32", dispatch_dtype=d, combine_dtype=c)
        for d in ("fp32", "bf16", "fp8")
        for c in ("fp32", "bf16")
    },
    "triton-fp32": dict(TRITON, dtype="float32"),
    "triton-bf16": dict(TRITON, dtype="bfloat16"),
}


@dataclass(frozen=True)
class Score:
    """Negative log-likelihood of a set of windows, and how far it is from the reference per token."""

    windows: int
    tokens: int
    nll: float
    max_abs_logprob_diff: float | None = None  # against the reference, per token
    mean_abs_logprob_diff: float | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=str(default_model_path()), help="HF checkpoint (default: the shipped one)")
    p.add_argument("--text", default=None, help="held-out text file (default: MODEL_PATH/heldout.txt)")
    p.add_argument("--window-len", type=int, default=256, help="scored tokens per window (+1 context token)")
    p.add_argument(
        "--windows", type=int, default=43, help="windows scored by the torch configurations (43: all of heldout.txt)"
    )
    p.add_argument("--triton-window-len", type=int, default=128, help="scored tokens per triton window")
    p.add_argument("--triton-windows", type=int, default=16, help="windows scored by the triton configurations")
    p.add_argument("--batch-windows", type=int, default=8, help="windows per generate call (progress granularity)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of this process and of every rank")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    context = json.loads((Path(args.model_path) / "config.json").read_text())["max_position_embeddings"]
    for flag in ("window_len", "triton_window_len"):
        if not 1 <= getattr(args, flag) < context:
            p.error(f"--{flag.replace('_', '-')}: must be in [1, {context - 1}] (the model's context is {context})")
    torch_configs = sum(not c.startswith("triton") for c in args.configs)
    for flag, needed in (("windows", torch_configs), ("triton_windows", len(args.configs) - torch_configs)):
        if needed and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be at least 1 for the chosen --configs")
    return args


def make_windows(ids: list[int], window_len: int, count: int) -> list[list[int]]:
    """The first `count` consecutive windows of window_len + 1 tokens; window k starts where
    window k-1's last scored token is, so every token after the first is scored once."""
    starts = range(0, len(ids) - window_len, window_len)
    windows = [ids[s : s + window_len + 1] for s in starts][:count]
    if len(windows) < count:
        log(f"the text holds only {len(windows)} windows of {window_len + 1} tokens (asked for {count})")
    return windows


def score(logprobs: list[torch.Tensor], ref: list[torch.Tensor] | None = None) -> Score:
    """logprobs[i]: [len(window i) - 1] float64, the logprob of tokens 1.. of window i."""
    flat = torch.cat(logprobs)  # [scored tokens]
    assert torch.isfinite(flat).all() and (flat <= 0).all(), "logprobs must be finite and <= 0"
    extra = {}
    if ref is not None:
        diff = (flat - torch.cat(ref)).abs()
        extra = dict(max_abs_logprob_diff=diff.max().item(), mean_abs_logprob_diff=diff.mean().item())
    return Score(windows=len(logprobs), tokens=flat.numel(), nll=-flat.sum().item(), **extra)


@torch.inference_mode()
def transformers_logprobs(model_path: str, windows: list[list[int]]) -> list[torch.Tensor]:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for window in tqdm(windows, desc="transformers-fp32", unit="window", file=sys.stderr):
        ids = torch.tensor([window])  # [1, T]
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V]
        # position t predicts token t + 1
        out.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0].double())  # [T - 1]
    return out


def engine_logprobs(model_path: str, flags: dict, windows: list[list[int]], args, name: str) -> list[torch.Tensor]:
    from tqdm import tqdm

    from afd_engine import SamplingParams, make_engine

    params = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
    out = []
    with make_engine(model_path=model_path, num_threads=args.num_threads, comm_timeout=120, **flags) as engine:
        bar = tqdm(total=len(windows), desc=name, unit="window", file=sys.stderr)
        for i in range(0, len(windows), args.batch_windows):
            batch = windows[i : i + args.batch_windows]
            for window, res in zip(batch, engine.generate(prompt_token_ids=batch, sampling_params=params)):
                entries = res.prompt_logprobs
                assert len(entries) == len(window) and entries[0] is None, f"{name}: {len(entries)} prompt logprobs"
                out.append(torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float64))
            bar.update(len(batch))
        bar.close()
    return out


def run(args) -> dict:
    from transformers import AutoTokenizer

    text_path = Path(args.text) if args.text else Path(args.model_path) / "heldout.txt"
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.model_max_length = sys.maxsize  # the whole text is tokenized once, then cut into windows
    ids = tokenizer(text_path.read_text(encoding="utf-8"))["input_ids"]
    sets = {
        "torch": make_windows(ids, args.window_len, args.windows),
        "triton": make_windows(ids, args.triton_window_len, args.triton_windows),
    }
    wanted = {"triton" if name.startswith("triton") else "torch" for name in args.configs}
    log(f"{text_path}: {len(ids)} tokens; windows: " + ", ".join(f"{k} {len(sets[k])}" for k in sorted(wanted)))

    refs, results = {}, {}
    for kind in sorted(wanted):
        start = time.perf_counter()
        refs[kind] = transformers_logprobs(args.model_path, sets[kind])
        results[REFERENCE[kind]] = dict(reference=None, seconds=time.perf_counter() - start, **_row(score(refs[kind])))
    for name in args.configs:
        kind = "triton" if name.startswith("triton") else "torch"
        start = time.perf_counter()
        got = engine_logprobs(args.model_path, CONFIGS[name], sets[kind], args, name)
        s, ref = score(got, refs[kind]), score(refs[kind])
        results[name] = dict(
            reference=REFERENCE[kind],
            flags=CONFIGS[name],
            seconds=time.perf_counter() - start,
            rel_change=s.perplexity / ref.perplexity - 1.0,
            **_row(s),
        )
    return dict(
        config=dict(vars(args), text=str(text_path), text_tokens=len(ids)),
        method=(
            "perplexity = exp(-sum logprob / scored tokens) over consecutive windows of window_len + 1 tokens, "
            "the first token of each context only; rel_change = ppl / ppl(transformers fp32, same windows) - 1; "
            "seconds include loading the model and starting the engine's ranks"
        ),
        results=results,
    )


def _row(s: Score) -> dict:
    return dict(asdict(s), perplexity=s.perplexity)


def print_table(res: dict) -> None:
    head = ("configuration", "windows x tokens", "perplexity", "vs transformers", "mean |dlogp|", "max |dlogp|")
    print(f"{head[0]:34} {head[1]:>16} {head[2]:>11} {head[3]:>16} {head[4]:>12} {head[5]:>12}")
    for name, r in res["results"].items():
        shape = f"{r['windows']} x {r['tokens'] // max(r['windows'], 1)}"
        rel = "(reference)" if r["reference"] is None else f"{r['rel_change']:+.3e}"
        diffs = [r[k] for k in ("mean_abs_logprob_diff", "max_abs_logprob_diff")]
        mean, top = ("", "") if diffs[0] is None else (f"{d:.2e}" for d in diffs)
        print(f"{name:34} {shape:>16} {r['perplexity']:>11.4f} {rel:>16} {mean:>12} {top:>12}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    res = run(args)
    print_table(res)
    if args.json:
        write_json(args.json, res)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
