#!/usr/bin/env python3
"""Expert load balancing under skewed routing: imbalance and step time before and after, one run.

Imbalance is max over mean of the expert ranks' token load (received (token, expert) pairs).
Three parts:

- synthetic: DeepSeek-V3-shaped routing (256 experts in 8 groups, top-8 of the 4 best groups) with
  a Zipf-like tilt towards some experts, through the real comm library (two-stage dispatch,
  in-process transport) over 2 nodes x 8 FFN ranks. The placement is computed from one sample of
  routing and measured on a fresh one: in order (no balancing), then with one redundant expert per
  rank placed from the measured load.
- model: a tiny DeepSeek-V3-shaped checkpoint whose gate bias tilts routing the same way, served by
  AFD (1 attention rank, 1 node x 4 FFN ranks, direct dispatch, one redundant expert per rank),
  with --enable-eplb rebalancing once the first window is measured. FFN ranks get an injected
  delay per received pair (--ffn-us-per-pair), standing for expert compute that grows with tokens,
  as on a GPU; step time, decode throughput and imbalance come from the ranks' timelines before
  and after the switch.
- under load (--serve): `afd serve` with the same deployment rebalancing every few steps while
  bench_serving drives it; reports failed requests and the longest rebalance step against the
  median step.

    python -m benchmarks.bench_eplb [--quick] [--serve] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from afd_engine import SamplingParams, make_engine
from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.placement import imbalance
from afd_engine.tiny_model import make_tiny_model
from benchmarks.bench_afd_vs_colocated import start_server
from benchmarks.bench_pipeline import load
from benchmarks.bench_serving import parse_args as serving_args
from benchmarks.bench_serving import run_benchmark
from benchmarks.kernels.bench_comm import exchange
from benchmarks.lib.results import write_json
from comm.endpoint import CommConfig
from comm.topology import Topology

DEPLOYMENT = "afd 1A + 1x4 FFN, direct, 4 redundant experts"


def zipf_bias(num_experts: int, s: float, strength: float, seed: int) -> torch.Tensor:
    """strength / rank^s, the ranks a random permutation of the experts."""
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed)) + 1
    return strength / ranks.to(torch.float32) ** s


def grouped_topk(scores: torch.Tensor, k: int, groups: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's choice: the top `topk_group` groups by their two best scores, then top-k in them."""
    t, e = scores.shape
    grouped = scores.view(t, groups, e // groups)
    best = grouped.topk(2, dim=-1)[0].sum(-1).topk(topk_group, dim=-1)[1]
    keep = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e).topk(k, dim=-1)[1]


def synthetic(args) -> dict:
    experts, k, groups, nodes, per_node = 256, 8, 8, 2, 8
    senders, tokens, hidden = 8, args.synthetic_tokens, 16
    bias = zipf_bias(experts, args.zipf, args.tilt, seed=1)
    gen = torch.Generator().manual_seed(2)

    def sample():
        return [grouped_topk(torch.rand(tokens, experts, generator=gen) + bias, k, groups, 4) for _ in range(senders)]

    window, fresh = sample(), sample()
    load = torch.bincount(torch.cat(window).flatten(), minlength=experts)
    xs = [torch.ones(tokens, hidden) for _ in range(senders)]
    ws = [torch.ones(tokens, k) for _ in range(senders)]
    out = {}
    for name, redundant, balanced in (("in order", 0, False), ("balanced", nodes * per_node, True)):
        layout = ExpertLayout(experts, redundant, nodes, per_node, groups)
        emap = ExpertMap(layout, {0: layout.place(load.float())}) if balanced else ExpertMap.initial(layout, [0])
        ids = [emap.to_physical(0, i, salt=s) for s, i in enumerate(fresh)]
        topo = Topology(senders, nodes, per_node, layout.num_slots)
        copies = [0] * topo.num_ffn_ranks
        exchange(topo, CommConfig("two-stage"), xs, ids, ws, copies)
        out[name] = {"rank_pairs": copies, "imbalance": imbalance(torch.tensor(copies, dtype=torch.float64))}
    return {
        "shape": f"{senders} senders x {tokens} tokens, {experts} experts top-{k} ({groups} groups, 4 chosen), "
        f"{nodes} nodes x {per_node} ranks, Zipf s={args.zipf} tilt {args.tilt}",
        "imbalance_before": out["in order"]["imbalance"],
        "imbalance_after": out["balanced"]["imbalance"],
        "rank_pairs_before": out["in order"]["rank_pairs"],
        "rank_pairs_after": out["balanced"]["rank_pairs"],
    }


def skewed_model(out_dir: Path, args) -> str:
    """The tiny DeepSeek-V3 checkpoint with every MoE gate's bias tilted Zipf-like."""
    path = make_tiny_model(out_dir, arch="deepseek_v3", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = zipf_bias(weights[name].numel(), args.zipf, args.model_tilt, seed=3)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def load_events(prefix: str) -> dict[str, list[dict]]:
    """Timeline events per rank (a0, f0, f1, ...)."""
    out: dict[str, list[dict]] = {}
    for e in load(prefix):
        out.setdefault(f"{e['role']}{e['rank']}", []).append(e)
    return out


def step_times(events: list[dict]) -> dict[int, float]:
    """Wall time per step on an attention rank: the step itself, plus the placement computed in
    the agreement round before it, if any."""
    out: dict[int, float] = {}
    for e in events:
        if e["kind"] in ("step", "eplb_plan"):
            out[e["step"]] = out.get(e["step"], 0.0) + e["t1"] - e["t0"]
    return out


def window_stats(events: dict[str, list[dict]], steps: range, batch: int) -> dict:
    """Over `steps`: step times on the attention rank, pairs per FFN rank, and the FFN critical
    path (per MoE layer, the slowest FFN rank's expert time, summed over the layers of a step)."""
    times = step_times(events["a0"])
    secs = [times[s] for s in steps if s in times]
    ffn = [e for r, ev in events.items() if r.startswith("f") for e in ev if e["kind"] == "ffn" and e["step"] in steps]
    pairs = [sum(e["tokens"] for e in ffn if e["rank"] == r) for r in sorted({e["rank"] for e in ffn})]
    slowest: dict[tuple[int, int], float] = {}
    for e in ffn:
        slowest[e["step"], e["layer"]] = max(slowest.get((e["step"], e["layer"]), 0.0), e["t1"] - e["t0"])
    return {
        "steps": f"{steps.start}-{steps.stop - 1}",
        "median_step_ms": 1000 * statistics.median(secs),
        "step_ms": [round(1000 * x, 2) for x in secs],
        "ffn_critical_ms": 1000 * sum(slowest.values()) / len(secs),
        "decode_tok_s": batch / statistics.median(secs),  # at the median step
        "rank_pairs": pairs,
        "imbalance": imbalance(torch.tensor(pairs, dtype=torch.float64)),
    }


MAX_ROUNDS = 5  # of the batch's requests, waiting for the first switch


def model_run(args, workdir: Path) -> dict:
    path = skewed_model(workdir / "skewed", args)
    timeline = str(workdir / "timeline")
    every = args.rebalance_after
    flags = dict(
        mode="afd",
        dp_size=1,
        ffn_ranks_per_node=4,
        dispatch="direct",
        micro_batches=1,
        ep_num_redundant_experts=4,
        enable_eplb=True,
        eplb_rebalance_num_iterations=every,
        eplb_window_steps=every,
        inject_ffn_delay_us_per_token=args.ffn_us_per_pair,
        record_timeline=timeline,
        num_threads=1,
    )
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 500, (16,), generator=gen).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with make_engine(model_path=path, **flags) as engine:
        # Staging runs on a low-priority thread beside the steps: on a busy machine a round can end
        # before the first switch. Then rounds go on until one has switched, and one more runs
        # whole on the new placement (the "after" window).
        rounds = 0
        while rounds < MAX_ROUNDS:
            engine.generate(prompt_token_ids=prompts, sampling_params=params)
            report, rounds = engine.expert_load(), rounds + 1
            if report["placement"]["version"] >= 1:
                break
        if rounds > 1:
            engine.generate(prompt_token_ids=prompts, sampling_params=params)
            report, rounds = engine.expert_load(), rounds + 1
    events = load_events(timeline)
    switches = sorted({e["step"] for e in events["a0"] if e["kind"] == "eplb_switch"})
    if not switches:
        raise SystemExit(f"no placement was switched in within {rounds} rounds of {args.batch} requests")
    last = max(e["step"] for e in events["a0"])
    before = window_stats(events, range(2, every), args.batch)  # decode steps of the first placement
    after = window_stats(events, range(switches[0] + 1, last + 1), args.batch)
    return {
        "deployment": DEPLOYMENT,
        "batch": args.batch,
        "ffn_us_per_pair": args.ffn_us_per_pair,
        "switch_steps": switches,
        "placements": report["placement"]["version"],
        "rounds": rounds,
        "checkpoint": path,
        "before": before,
        "after": after,
    }


def under_load(args, workdir: Path, model_path: str) -> dict:
    """`afd serve` rebalancing every `--serve-every` steps while bench_serving drives it."""
    timeline = str(workdir / "serve")
    flags = "--mode afd --dp-size 1 --ffn-ranks-per-node 4 --dispatch direct --micro-batches 1"
    flags += f" --ep-num-redundant-experts 4 --enable-eplb --eplb-rebalance-num-iterations {args.serve_every}"
    flags += f" --inject-ffn-delay-us-per-token {args.ffn_us_per_pair} --record-timeline {timeline}"
    with start_server(model_path, flags.split()) as server:
        load = ["--base-url", server.url, "--backend", "completions", "--dataset-name", "random-ids"]
        load += ["--num-prompts", str(args.serve_prompts), "--max-concurrency", str(args.serve_concurrency)]
        load += ["--random-input-len", "32", "--random-output-len", "32", "--disable-tqdm"]
        m = asyncio.run(run_benchmark(serving_args(load)))
    events = load_events(timeline)["a0"]
    times, tokens = step_times(events), step_tokens(events)
    rebalance = sorted({e["step"] for e in events if e["kind"] in ("eplb_plan", "eplb_switch")})
    others = [s for s in times if s not in rebalance]
    ratios = {s: times[s] / statistics.median(times[p] for p in alike(s, others, tokens)) for s in rebalance}
    worst = max(ratios, key=ratios.get)
    median = statistics.median(times.values())
    return {
        "requests": m["completed"] + m["failed"],
        "failed": m["failed"],
        "concurrency": args.serve_concurrency,
        "steps": len(times),
        "rebalance_steps": len(rebalance),
        "switches": sum(e["kind"] == "eplb_switch" for e in events),
        "median_step_ms": 1000 * median,
        "worst_rebalance_step": worst,
        "worst_rebalance_step_ms": 1000 * times[worst],
        "worst_rebalance_ratio": ratios[worst],
        "worst_rebalance_over_median": times[worst] / median,
        "steps_over_2x_median": sum(t > 2 * median for t in times.values()),
        "output_tok_s": m["output_throughput"],
    }


def step_tokens(events: list[dict]) -> dict[int, int]:
    """Tokens forwarded per step."""
    return {e["step"]: e["tokens"] for e in events if e["kind"] == "step"}


def alike(step: int, others: list[int], tokens: dict[int, int], n: int = 5) -> list[int]:
    """The `n` steps of `others` whose token counts are nearest `step`'s (its yardstick: a
    rebalance step that also prefills is compared with prefill steps)."""
    return sorted(others, key=lambda s: (abs(tokens.get(s, 0) - tokens.get(step, 0)), abs(s - step)))[:n]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the routing tilt")
    p.add_argument("--tilt", type=float, default=0.5, help="synthetic: gate-score bias of the hottest expert")
    p.add_argument("--model-tilt", type=float, default=0.5, help="model: gate bias of the hottest expert")
    p.add_argument("--synthetic-tokens", type=int, default=512, help="synthetic: tokens per sender")
    p.add_argument("--batch", type=int, default=64, help="model: requests decoding together")
    p.add_argument("--tokens", type=int, default=48, help="model: tokens generated per request")
    p.add_argument("--rebalance-after", type=int, default=16, help="model: steps measured before rebalancing")
    p.add_argument("--ffn-us-per-pair", type=float, default=100.0, help="model: FFN delay per received pair")
    p.add_argument("--serve", action="store_true", help="also rebalance under load: afd serve + bench_serving")
    p.add_argument("--serve-every", type=int, default=8, help="under load: steps between rebalances")
    p.add_argument("--serve-prompts", type=int, default=128, help="under load: requests sent")
    p.add_argument("--serve-concurrency", type=int, default=16, help="under load: requests in flight")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", default=None, help="keep the checkpoint and timelines in this directory")
    args = p.parse_args(argv)
    if args.quick:
        args.synthetic_tokens, args.batch, args.tokens, args.rebalance_after = 128, 16, 24, 8
        args.serve_prompts, args.serve_concurrency = 24, 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    syn = synthetic(args)
    print(f"synthetic ({syn['shape']}): imbalance {syn['imbalance_before']:.3f} -> {syn['imbalance_after']:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep or tmp)
        model = model_run(args, workdir)
        load = under_load(args, workdir, model["checkpoint"]) if args.serve else None
    model.pop("checkpoint")
    b, a = model["before"], model["after"]
    print(
        f"model ({model['deployment']}, {model['batch']} requests x {model['rounds']} rounds), "
        f"switched at steps {model['switch_steps']}:"
    )
    for name, w in (("before", b), ("after", a)):
        print(
            f"  {name:6} steps {w['steps']:>7}: imbalance {w['imbalance']:.3f}, median step {w['median_step_ms']:.1f} "
            f"ms (slowest FFN rank {w['ffn_critical_ms']:.1f} ms of it), {w['decode_tok_s']:.0f} decode tok/s, "
            f"pairs per FFN rank {w['rank_pairs']}"
        )
    result = {
        "imbalance_before": b["imbalance"],
        "imbalance_after": a["imbalance"],
        "throughput_before": b["decode_tok_s"],
        "throughput_after": a["decode_tok_s"],
        "step_ms_before": b["median_step_ms"],
        "step_ms_after": a["median_step_ms"],
        "synthetic": syn,
        "model": model,
        "under_load": load,
    }
    if load is not None:
        print(
            f"under load ({load['requests']} requests, concurrency {load['concurrency']}): {load['failed']} failed, "
            f"{load['switches']} switches in {load['steps']} steps; median step {load['median_step_ms']:.1f} ms, "
            f"slowest rebalance step {load['worst_rebalance_step_ms']:.1f} ms = {load['worst_rebalance_ratio']:.2f}x "
            f"the median of steps with as many tokens ({load['worst_rebalance_over_median']:.2f}x the overall median); "
            f"steps over 2x the overall median: {load['steps_over_2x_median']}"
        )
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
