"""A step-time model fitted to this engine's own steps (`afd plan simulate --step-calibration FILE`).

`afd serve|generate ... --record-steps PATH` writes one JSON line per forward step of each rank:
its load as the simulator counts it (tokens, sequences, KV positions its decodes read, query-key
pairs of its prefill chunks) and the monotonic start `t0` and end `t1` of the forward. `fit_records`
turns them into (load, seconds) rows and fits

    step_s = c0 + c1 * tokens + c2 * seqs + c3 * kv_positions + c4 * pairs

by non-negative least squares, each row weighted by seconds^-power: power 0 fits the absolute
error (the long prefill steps dominate), power 1 the relative error (3 ms decode steps count as much
as 1 s prefill steps); benchmarks/validate_sim.py picks the power that best reproduces the
calibration run's latencies. A step's seconds are its forward plus
the gap since the previous forward ended, when that gap is short (the scheduling the engine did not
hide); a longer gap means the engine was idle and only the forward counts. For a deployment of
several attention ranks the i-th records of the ranks are the same lockstep step: the step's
seconds are the longest, its load the busiest rank's (most tokens). `FittedStepTime` applies the
fit to each rank's load in a simulated step and takes the slowest rank.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from afd_engine.errors import ConfigError
from afd_engine.planner.files import read_json

TERMS = ("fixed", "tokens", "seqs", "kv_positions", "pairs")
RECORD_FIELDS = ("step", "tokens", "seqs", "kv", "pairs", "t0", "t1")
GAP_CAP_S = 0.02  # a longer gap between two forwards is idle time, not part of the step


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best unconstrained fit over every subset
    of columns whose solution is non-negative (exact, and cheap for 5 terms)."""
    n = x.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                full = np.zeros(n)
                full[list(cols)] = coef
                best, best_err = full, err
    return best


def design(loads: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows (1, tokens, seqs, kv_positions, pairs) of the loads."""
    a = np.asarray(loads, dtype=float).reshape(-1, 4)
    return np.hstack([np.ones((a.shape[0], 1)), a])


@dataclass(frozen=True)
class StepCalibration:
    """Coefficients of `TERMS` (seconds, seconds per token, ...), with what they were fitted on."""

    coef: tuple[float, ...]
    source: str = ""
    steps: int = 0
    rms_s: float = 0.0
    power: float = 1.0  # rows weighted by seconds^-power in the fit

    def seconds(self, load: Sequence[float]) -> float:
        return self.coef[0] + sum(c * v for c, v in zip(self.coef[1:], load))

    def as_dict(self) -> dict:
        return {
            "model": "step_s = " + " + ".join(f"c_{t}*{t}" if t != "fixed" else "c_fixed" for t in TERMS),
            "coef": dict(zip(TERMS, self.coef)),
            "source": self.source,
            "steps": self.steps,
            "rms_s": self.rms_s,
            "weight_power": self.power,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCalibration:
        where = f"--step-calibration {path}"
        d = read_json(path, "--step-calibration")
        coef = d.get("coef") if isinstance(d, dict) else None
        if not isinstance(coef, dict) or set(coef) != set(TERMS):
            raise ConfigError(f'{where}: expected {{"coef": {{...}}}} with exactly the keys {", ".join(TERMS)}')
        values = tuple(coef[t] for t in TERMS)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ConfigError(f"{where}: every coefficient must be a finite number")
        if any(v < 0 for v in values):
            raise ConfigError(f"{where}: every coefficient must be >= 0 (a step cannot take negative time)")
        if not any(values):
            raise ConfigError(f"{where}: all coefficients are 0 (every step would take no time)")
        extra = (str(d.get("source", "")), int(d.get("steps", 0)), float(d.get("rms_s", 0.0)))
        return cls(values, *extra, float(d.get("weight_power", 1.0)))


def fit(
    loads: Sequence[Sequence[float]], seconds: Sequence[float], source: str = "", power: float = 1.0
) -> StepCalibration:
    """The non-negative least-squares fit of step seconds to the loads, rows weighted by
    seconds^-power (0: absolute error, 1: relative error)."""
    x, y = design(loads), np.asarray(seconds, dtype=float)
    if len(y) < len(TERMS):
        raise ConfigError(f"need at least {len(TERMS)} steps to fit {len(TERMS)} coefficients (got {len(y)})")
    if power and np.any(y <= 0):
        raise ConfigError("a weighted fit needs every step's seconds > 0")
    w = y**-power if power else np.ones_like(y)
    coef = nnls(x * w[:, None], y * w)
    rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return StepCalibration(tuple(float(c) for c in coef), source, len(y), rms, power)


def read_records(path: str | Path) -> list[dict]:
    """The records of one `--record-steps` file, checked."""
    out = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append({k: float(rec[k]) for k in RECORD_FIELDS})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{no}: expected a step record with {', '.join(RECORD_FIELDS)} ({exc})") from None
    return out


def step_rows(ranks: Sequence[Sequence[dict]], skip: int = 1) -> tuple[list[tuple], list[float]]:
    """(loads, seconds) of the lockstep steps of one run, from each rank's records (in step order);
    the first `skip` steps (warm-up) are left out."""
    n = min(len(r) for r in ranks)
    loads, seconds = [], []
    prev_end = None
    for i in range(n):
        recs = [r[i] for r in ranks]
        t0, t1 = min(x["t0"] for x in recs), max(x["t1"] for x in recs)
        s = t1 - t0
        if prev_end is not None and 0 <= t0 - prev_end < GAP_CAP_S:
            s = t1 - prev_end
        prev_end = t1
        busiest = max(recs, key=lambda x: x["tokens"])
        if i < skip or busiest["tokens"] <= 0:
            continue
        loads.append((busiest["tokens"], busiest["seqs"], busiest["kv"], busiest["pairs"]))
        seconds.append(s)
    return loads, seconds


def fit_records(runs: Iterable[Sequence[str | Path]], source: str = "", power: float = 1.0) -> StepCalibration:
    """The fit over several runs, each the `--record-steps` files of its ranks."""
    loads: list[tuple] = []
    seconds: list[float] = []
    for files in runs:
        ld, s = step_rows([read_records(f) for f in files])
        loads += ld
        seconds += s
    return fit(loads, seconds, source, power)


class FittedStepTime:
    """A StepTimeModel from a `StepCalibration`: each rank's time from its own load, the step the
    slowest rank's (lockstep); every role is busy for the whole step."""

    def __init__(self, cal: StepCalibration, roles: tuple[str, ...] = ("gpu",)) -> None:
        self.cal, self.roles = cal, roles

    def step(self, loads: Sequence[Sequence[float]]) -> tuple[float, tuple[float, ...]]:
        seconds = max(self.cal.seconds(ld) for ld in loads)
        return seconds, (seconds,) * len(self.roles)
