"""The GPU check's speculative-decoding part: TPOT with the MTP head's drafts against without.

On the device, the embedded model with its trained MTP head in single mode (bfloat16; speculative
steps run eagerly, speculation off keeps its decode graphs), greedy, prompts cut from its held-out
text, at concurrency 1, with 0, 1 and 3 draft steps: TPOT, tokens per second, the accepted
length and whether the outputs equal speculation off (bench_spec.py's method and code). On the CPU
machine a four-layer model's verify step costs about twice a plain one; this measures what it costs
where a decode step is memory-bound.
"""

from __future__ import annotations

from types import SimpleNamespace

from afd_engine.default_model import default_model_path

TARGET = 0.7  # TPOT with speculation over without, at concurrency 1 (the target on the CPU)


def spec_tpot(ctx) -> dict:
    from afd_engine import Engine
    from benchmarks.bench_spec import prompts, run_setting

    model = str(default_model_path())
    dry = ctx.dry_run
    args = SimpleNamespace(
        output_len=8 if dry else 64,
        repeats=1 if dry else 3,
        num_threads=2,
        device=str(ctx.device.type),
        dtype="float32" if dry else "bfloat16",
    )
    with Engine(model_path=model, device=args.device, num_threads=1) as probe:
        tokenizer = probe.tokenizer
    rows = []
    for concurrency in (1,):
        batch = prompts(tokenizer, model, concurrency, 16 if dry else 48)
        off = None
        for steps in (0, 1) if dry else (0, 1, 3):
            row = run_setting(args, model, "single", steps, concurrency, batch)
            if steps == 0:
                off = row
            else:
                row["exact"] = row["tokens"] == off["tokens"]
                row["tpot_vs_off"] = round(row["tpot_ms"] / off["tpot_ms"], 3)
            rows.append(row)
    for row in rows:
        row.pop("tokens")
    ratios = {r["steps"]: r["tpot_vs_off"] for r in rows if r["concurrency"] == 1 and r["steps"]}
    best = min(ratios.values())
    found = ", ".join(f"{s} drafts {x:.2f}x" for s, x in ratios.items())
    return {
        "rows": rows,
        "target": TARGET,
        "target_met": best <= TARGET,
        "all_exact": all(r.get("exact", True) for r in rows),
        "headline": f"spec TPOT / off at concurrency 1: {found}",
    }
