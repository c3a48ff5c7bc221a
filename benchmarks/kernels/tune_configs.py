"""The tile sweep's choices (benchmarks.kernels.tune_kernels) as the config files the kernels read
(kernels/triton/tuned.py): for each MLA model its fastest tiles at each batch, for each fused-MoE
weight kind its fastest tiles at each rows per expert, named for the GPU the sweep ran on."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from kernels.triton import mla, moe, tuned

MOE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
MLA_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
MOE_KINDS = {"moe_bf16": "bf16", "moe_fp8": "fp8"}


def fastest_mla_tiles(rows: list[dict]) -> dict[int, list[int]]:
    """batch -> the tiles with the least time summed over the contexts measured at that batch
    (each context at the tiles' best split count), among tiles measured at all of them."""
    times = defaultdict(dict)  # batch -> {(context, tiles): best us}
    for r in rows:
        if "us" in r:
            key = (r["context"], tuple(r["tiles"]))
            times[r["batch"]][key] = min(r["us"], times[r["batch"]].get(key, float("inf")))
    best = {}
    for batch, by_key in times.items():
        contexts = {c for c, _ in by_key}
        totals = {
            tiles: sum(by_key[(c, tiles)] for c in contexts)
            for tiles in {t for _, t in by_key}
            if all((c, tiles) in by_key for c in contexts)
        }
        best[batch] = list(min(totals, key=totals.get))
    return dict(sorted(best.items()))


def write_configs(report: dict, folder: str | Path) -> list[Path]:
    """Writes a file per MLA model (bf16, the sweep's dtype) and per MoE kind swept in `report`
    (tune_kernels' JSON report) for report["device"] into `folder`. Returns their paths."""
    stamp = {"date": report["date"], "torch": report["torch"], "triton": report["triton"]}
    stamp["by"] = "python -m benchmarks.kernels.tune_kernels"
    written = []
    sweep = report["sections"].get("mla", {})
    for model, (heads, latent, rope) in sweep.get("shapes", {}).items():
        chosen = fastest_mla_tiles([r for r in sweep["rows"] if r["model"] == model])
        if chosen:
            configs = {batch: dict(zip(MLA_FIELDS, tiles)) for batch, tiles in chosen.items()}
            shape = mla.tuned_shape(heads, latent, rope, torch.bfloat16)
            size = {"size": "batch (sequences per decode step)"}
            written.append(tuned.write(mla.KERNEL, shape, report["device"], configs, stamp | size, folder))
    for section, kind in MOE_KINDS.items():
        sweep = report["sections"].get(section, {})
        if sweep.get("best"):
            configs = {r["tokens_per_expert"]: dict(zip(MOE_FIELDS, r["blocks"])) for r in sweep["best"]}
            shape = moe.tuned_shape(kind, sweep["shape"]["H"], sweep["shape"]["I"])
            size = {"size": "rows per expert (tokens x top-k / experts)"}
            written.append(tuned.write(moe.KERNEL, shape, report["device"], configs, stamp | size, folder))
    return written
