"""Measured stage times instead of the roofline: fitted from this engine's own timeline.

A profiling run (`afd serve|generate ... --record-timeline PREFIX`) writes one JSONL file per rank.
`afd plan calibrate --timeline PREFIX` fits, by least squares over every recorded operation,

    attention stage (one MoE layer, one micro-batch, on an attention rank) = fixed + per_token * tokens
    expert stage    (one MoE layer, one micro-batch, on an FFN rank)    = fixed + per_row * rows

and writes them as JSON. `afd plan deploy --calibration FILE` then uses these two lines for the
attention and expert stages (network, pipeline and memory stay modelled). A calibration holds for
the model, hardware and context it was measured with; the file records them so a mismatch shows.
"""

from __future__ import annotations

import glob
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from afd_engine.errors import ConfigError


@dataclass(frozen=True)
class LinearFit:
    fixed_us: float
    per_unit_us: float
    samples: int

    def __call__(self, units: float) -> float:
        return self.fixed_us + self.per_unit_us * units if units > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    attention: LinearFit  # per token on one attention rank
    ffn: LinearFit  # per received row (token copy) on one FFN rank
    source: str = ""  # what was measured: model, hardware, context

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(LinearFit(**raw["attention"]), LinearFit(**raw["ffn"]), raw.get("source", ""))
        except FileNotFoundError:
            raise ConfigError(f"--calibration {path}: no such file") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"--calibration {path}: not a calibration file ({exc})") from None


def fit_line(points: list[tuple[float, float]]) -> LinearFit:
    """Least-squares fixed + slope * x (slope >= 0; one distinct x gives a flat line through the mean)."""
    n = len(points)
    if n == 0:
        raise ConfigError("no timed operations to fit")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var > 0 else 0.0
    return LinearFit(max(0.0, my - slope * mx), slope, n)


def read_timeline(prefix: str) -> list[dict]:
    files = sorted(glob.glob(f"{prefix}.*.jsonl"))
    if not files:
        raise ConfigError(
            f"--timeline {prefix}: no files {prefix}.<role><rank>.jsonl (record them with --record-timeline)"
        )
    events = []
    for f in files:
        with open(f) as fh:
            events += [json.loads(line) for line in fh if line.strip()]
    return events


def calibrate(prefix: str, source: str = "", skip_steps: int = 1) -> Calibration:
    """Fit both stages from a recorded timeline; the first `skip_steps` steps (warm-up) are left out."""
    events = [e for e in read_timeline(prefix) if e.get("step", 0) >= skip_steps and e.get("tokens", -1) > 0]

    def points(kind: str) -> list[tuple[float, float]]:
        return [(e["tokens"], (e["t1"] - e["t0"]) * 1e6) for e in events if e["kind"] == kind]

    attn, ffn = points("attention"), points("ffn")
    if not attn or not ffn:
        raise ConfigError(
            f"--timeline {prefix}: needs 'attention' and 'ffn' events with token counts from an "
            "AFD run past its first step (found "
            f"{len(attn)} and {len(ffn)})"
        )
    return Calibration(fit_line(attn), fit_line(ffn), source)
