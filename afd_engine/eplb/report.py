"""Expert load reports: what `GET /expert_load`, `afd expert-load` and `engine.expert_load()` give.

Each attention rank reports its own window (`rank_report`); the front end sums them
(`merge_reports`). `imbalance` is max over mean of the expert ranks' token loads under the
current placement (1.0: perfect balance).
"""

from __future__ import annotations

import torch

from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.placement import imbalance
from afd_engine.eplb.recorder import ExpertLoadRecorder


def rank_report(recorder: ExpertLoadRecorder, expert_map: ExpertMap) -> dict:
    window = recorder.window()
    return {
        "moe_layers": list(recorder.layers),
        "num_experts": recorder.num_experts,
        "window_steps": recorder.window_steps,
        "steps": recorder.steps,
        "load": window.tolist(),
        "placement": expert_map.describe(),
        "expert_rank_load": expert_map.rank_loads(window).tolist(),
    }


def merge_reports(reports: list[dict]) -> dict:
    """One deployment's report from its attention ranks' (loads summed, placement rank 0's)."""
    first = reports[0]
    load = torch.tensor([r["load"] for r in reports], dtype=torch.int64).sum(dim=0)
    rank_load = torch.tensor([r["expert_rank_load"] for r in reports], dtype=torch.float64).sum(dim=0)
    return {
        "moe_layers": first["moe_layers"],
        "num_experts": first["num_experts"],
        "window_steps": first["window_steps"],
        "steps": max(r["steps"] for r in reports),
        "attention_ranks": len(reports),
        "load": load.tolist(),
        "placement": first["placement"],
        "expert_rank_load": rank_load.tolist(),
        "imbalance": imbalance(rank_load),
    }
