#!/usr/bin/env python3
"""Pipeline bubbles of the real AFD deployment: A-side busy fraction for 1..4 micro-batches.

Runs `make_engine(mode="afd")` (attention and FFN ranks as processes, ZeroMQ between them) with
injected per-(MoE layer, micro-batch) compute on A (attention) and on F, and a latency on every
data-plane message (link), so that the seed's conditions can be set at will:

    no bubble on A when  t_ffn <= t_attention  and  t_dispatch + t_combine <= t_attention

With N micro-batches A has (N-1) other micro-batches' attention to cover one round trip, so
2 micro-batches bubble once t_ffn + 2 t_link > t_attention, and 3 cover up to 2 t_attention.
A busy = 1 - (time A waits on combine) / (step wall time), over decode steps, from the
timeline that every rank records (`--record-timeline`); the same recording works on any run
of the engine.

Beside each measured value the planner's pipeline formula (`afd_engine.planner.deploy`:
period per layer, then L-1 periods plus the last layer's stages and round trip) predicts the busy
fraction over the MoE layers from stage times measured in the same run (A: attention spans, F:
expert spans) and the transport time of one round trip, measured once in the 1-micro-batch run
(its wait on combine, less F). The prediction leaves out the dense layers, embedding and sampling,
which the measurement counts as busy. Writes a table, JSON, and a timeline PNG (A compute, A waits, F compute, per
micro-batch) for one decode step.

    python -m benchmarks.bench_pipeline [--quick] [--json out.json] [--png timeline.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.lib.results import write_json

SCENARIOS = {  # name: (attention ms, ffn ms, link ms) per MoE layer and micro-batch
    "within (F<=A, comm<=A)": (20.0, 8.0, 4.0),
    "outside (F+comm>A)": (20.0, 16.0, 6.0),
}


def run(model_path: str, n: int, delays: tuple[float, float, float], timeline: str, requests: int, tokens: int):
    from afd_engine import SamplingParams, make_engine

    a, f, link = delays
    with make_engine(
        model_path=model_path,
        mode="afd",
        dp_size=1,
        micro_batches=n,
        num_threads=1,
        inject_attention_delay_ms=a,
        inject_ffn_delay_ms=f,
        inject_link_delay_ms=link,
        record_timeline=timeline,
    ) as engine:
        engine.generate(
            prompt_token_ids=[[5 + i, 6, 7] for i in range(requests)],
            sampling_params=SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True),
        )


def load(prefix: str) -> list[dict]:
    events = []
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    return events


def busy_fraction(events: list[dict]) -> tuple[float, int]:
    """Mean over decode steps (all but the first, the prefill) of 1 - wait / step span on A."""
    steps = defaultdict(list)
    for e in events:
        if e["role"] == "a" and e["kind"] in ("attention", "wait"):  # from the first layer to the last
            steps[e["step"]].append(e)
    fractions = []
    for step in sorted(steps)[1:]:
        ev = steps[step]
        span = max(e["t1"] for e in ev) - min(e["t0"] for e in ev)
        wait = sum(e["t1"] - e["t0"] for e in ev if e["kind"] == "wait")
        fractions.append(1 - wait / span)
    return sum(fractions) / len(fractions), len(fractions)


def stage_means(events: list[dict]) -> dict[str, float]:
    """Mean seconds of one attention stage, one expert stage and one combine wait, over decode steps,
    and the number of MoE layers."""
    out = {"moe_layers": len({e["layer"] for e in events if e["kind"] == "attention"})}
    for kind in ("attention", "ffn", "wait"):
        spans = [e["t1"] - e["t0"] for e in events if e["kind"] == kind and e["step"] >= 1]
        out[kind] = sum(spans) / len(spans) if spans else 0.0
    return out


def predicted_busy(n: int, means: dict[str, float], transit: float) -> float:
    """The planner's A busy fraction over the MoE layers for these measured stage times (links: latency only)."""
    from afd_engine.planner.deploy import moe_layers_time, pipeline_period

    a, f, layers = means["attention"], means["ffn"], means["moe_layers"]
    round_trip = a + transit + f
    period, _ = pipeline_period(n, a, f, 0.0, 0.0, round_trip)
    return layers * n * a / moe_layers_time(layers, n, period, a, round_trip)


def draw(timelines: dict[str, list[dict]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.2 * len(timelines)), squeeze=False)
    colors = {"attention": "tab:blue", "wait": "lightgrey", "ffn": "tab:orange", "recv": "whitesmoke"}
    for ax, (title, events) in zip(axes[:, 0], timelines.items()):
        step = sorted({e["step"] for e in events})[len({e["step"] for e in events}) // 2]
        ev = [e for e in events if e["step"] == step and e["kind"] in colors]  # the operations, not whole steps
        t0 = min(e["t0"] for e in ev)
        rows = sorted({(e["role"], e["mb"]) for e in ev})
        for e in ev:
            y = rows.index((e["role"], e["mb"]))
            ax.barh(
                y,
                (e["t1"] - e["t0"]) * 1000,
                left=(e["t0"] - t0) * 1000,
                color=colors[e["kind"]],
                edgecolor="black",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(rows)), [f"{'A' if r == 'a' else 'F'} mb{m}" for r, m in rows])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(
        handles,
        ["A compute", "A waits for combine", "F compute", "F waits for dispatch"],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="checkpoint (default: a tiny DeepSeek-V3 with --layers layers)")
    p.add_argument(
        "--layers",
        type=int,
        default=12,
        help="layers of the default model: the last MoE layer's "
        "round trip has nothing to hide behind, so few layers understate the busy fraction",
    )
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--png", default="bench_pipeline_timeline.png", help="timeline picture")
    p.add_argument("--quick", action="store_true", help="1 and 3 micro-batches, the 'within' case only, a small run")
    args = p.parse_args(argv)
    from afd_engine.tiny_model import make_tiny_model

    scenarios = dict(list(SCENARIOS.items())[:1]) if args.quick else SCENARIOS
    if args.quick:
        args.layers, args.requests, args.tokens = 4, 3, 3
    sizes = [1, 3] if args.quick else sorted(args.micro_batches)
    results, pictures, transit = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or str(make_tiny_model(f"{tmp}/model", overrides={"num_hidden_layers": args.layers}))
        for name, delays in scenarios.items():
            for n in sizes:
                prefix = f"{tmp}/{len(results)}"
                print(f"running {name}, {n} micro-batches ...", file=sys.stderr, flush=True)
                run(model, n, delays, prefix, args.requests, args.tokens)
                events = load(prefix)
                busy, steps = busy_fraction(events)
                means = stage_means(events)
                if n == 1:  # one micro-batch: A waits for exactly transport + F
                    transit[name] = max(0.0, means["wait"] - means["ffn"])
                predicted = predicted_busy(n, means, transit[name]) if name in transit else None
                results.append(
                    {
                        "scenario": name,
                        "attention_ms": delays[0],
                        "ffn_ms": delays[1],
                        "link_ms": delays[2],
                        "micro_batches": n,
                        "a_busy": busy,
                        "decode_steps": steps,
                        "measured_attention_ms": means["attention"] * 1e3,
                        "measured_ffn_ms": means["ffn"] * 1e3,
                        "predicted_a_busy": predicted,
                    }
                )
                if name == next(iter(scenarios)) and n in (2, 3):
                    pictures[f"{name}: {n} micro-batches (A busy {busy:.2f})"] = events
    print(
        f"{'scenario':<24} {'attn ms':>7} {'ffn ms':>7} {'link ms':>7} {'micro-batches':>13} {'A busy':>7} "
        f"{'planner':>7}"
    )
    for r in results:
        pred = "-" if r["predicted_a_busy"] is None else f"{r['predicted_a_busy']:.3f}"
        print(
            f"{r['scenario']:<24} {r['attention_ms']:>7.1f} {r['ffn_ms']:>7.1f} {r['link_ms']:>7.1f} "
            f"{r['micro_batches']:>13} {r['a_busy']:>7.3f} {pred:>7}"
        )
    print(
        "planner: busy fraction over the MoE layers predicted from the run's own stage times "
        "(needs the 1-micro-batch run)"
    )
    draw(pictures, args.png)
    print(f"timeline: {args.png}")
    if args.json:
        write_json(args.json, {"settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
