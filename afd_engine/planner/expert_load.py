"""The measured expert-rank load imbalance: max over mean of the token loads of the expert (FFN)
ranks, 1.0 being perfect balance.

With skewed routing the most loaded expert rank is the straggler of every MoE layer, so the planner
scales that rank's routed-expert work by this factor (see `StageModel.expert_imbalance`). The factor
comes from `--expert-imbalance` or from a JSON file (`--expert-load`) holding one of these keys:

    "imbalance_after"   benchmarks/bench_eplb.py --json (after rebalancing); read first if present
    "imbalance"         the engine's GET /expert_load admin route, or `afd expert-load`
"""

from __future__ import annotations

from math import isfinite
from pathlib import Path

from afd_engine.errors import ConfigError
from afd_engine.planner.files import read_json

BALANCED = 1.0
FILE_KEYS = ("imbalance_after", "imbalance")


def check_imbalance(value: object, what: str) -> float:
    """`value` as a float, or a ConfigError naming `what` (a flag, or a file and key)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isfinite(value) or value < BALANCED:
        raise ConfigError(
            f"{what} must be a number >= 1.0 (max over mean of the expert ranks' token loads; "
            f"1.0 is perfect balance), got {value!r}"
        )
    return float(value)


def load_expert_imbalance(path: str | Path) -> tuple[float, str]:
    """The factor in the JSON file at `path`, and the key it came from."""
    flag = f"--expert-load {path}"
    raw = read_json(path, "--expert-load")
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: expected a JSON object with key 'imbalance_after' or 'imbalance'")
    key = next((k for k in FILE_KEYS if k in raw), None)
    if key is None:
        raise ConfigError(
            f"{flag}: no key 'imbalance_after' or 'imbalance' (keys: {', '.join(raw) or 'none'}); "
            "write it with `benchmarks/bench_eplb.py --json` or `afd expert-load`"
        )
    return check_imbalance(raw[key], f"{flag}: '{key}'"), key
