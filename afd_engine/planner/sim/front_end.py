"""How requests reach the instances: the API server hands them over one at a time.

A request that finds the front end idle reaches its instance `first_s` after it arrived and can
start a step alone; the one queued behind it follows `lead_s` later, and every other queued request
`next_s` after the one before (a burst of arrivals at one instant reaches the engine spread out,
and how much of it the step after the first request's takes depends on that spread). With a
`seed`, each gap is drawn from measured ones instead (`lead_bins`, `next_bins`: the means of equal bins
of the sorted gaps, each bin as likely), so that a simulation has the engine's run-to-run mix of
bursts taken whole and bursts split.

`benchmarks/validate_sim.py` measures them from `--record-steps`' front-end record
(`PATH.frontend.jsonl`: when the API server handed each request over) against the benchmark's
schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from afd_engine.errors import ConfigError

BINS = 100  # measured gaps are kept as the means of this many equal bins


def equal_bins(values: Sequence[float], bins: int = BINS) -> tuple[float, ...]:
    """The means of `bins` equal bins of the sorted values (fewer when there are fewer values)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    return tuple(float(b.mean()) for b in np.array_split(ordered, min(bins, len(ordered))) if len(b))


@dataclass(frozen=True)
class FrontEnd:
    first_s: float = 0.0
    lead_s: float = 0.0
    next_s: float = 0.0
    lead_bins: tuple[float, ...] = ()
    next_bins: tuple[float, ...] = ()
    seed: int | None = None

    @classmethod
    def per_request(cls, seconds: float) -> FrontEnd:
        """Every request this long after it arrived or after the one before, whichever is later."""
        return cls(seconds, seconds, seconds)

    @classmethod
    def measured(cls, first_s: float, lead: Sequence[float], after: Sequence[float]) -> FrontEnd:
        """From measured gaps: behind a request that found the front end idle (`lead`), and
        between later queued requests (`after`); their medians where nothing is drawn."""
        lead_s = float(np.median(lead)) if len(lead) else 0.0
        next_s = float(np.median(after)) if len(after) else lead_s
        return cls(first_s, lead_s, next_s, equal_bins(lead), equal_bins(after))

    def validate(self, name: str) -> None:
        times = (self.first_s, self.lead_s, self.next_s, *self.lead_bins, *self.next_bins)
        if not all(t >= 0 for t in times):
            raise ConfigError(f"{name}: the front end's times must be >= 0 (got {self!r})")

    def scaled(self, factor: float) -> FrontEnd:
        """This front end with the gaps between queued requests `factor` times as long."""
        return replace(
            self,
            lead_s=self.lead_s * factor,
            next_s=self.next_s * factor,
            lead_bins=tuple(g * factor for g in self.lead_bins),
            next_bins=tuple(g * factor for g in self.next_bins),
        )

    def drawn(self, seed: int | None) -> FrontEnd:
        """This front end with its gaps drawn with `seed` (None: the medians)."""
        return replace(self, seed=seed)

    def deliveries(self, arrivals: Sequence[float]) -> list[float]:
        """When each request (arrivals in order) reaches an instance; with a seed, each gap drawn
        from the measured ones (where there are some)."""
        rng = None if self.seed is None else np.random.default_rng(self.seed)
        lead = self._gaps(self.lead_s, self.lead_bins, len(arrivals), rng)
        after = self._gaps(self.next_s, self.next_bins, len(arrivals), rng)
        out, at, behind_first = [], -np.inf, False
        for k, arrival in enumerate(arrivals):
            if arrival > at:  # the front end is idle
                at, behind_first = arrival + self.first_s, True
            else:
                at += lead[k] if behind_first else after[k]
                behind_first = False
            out.append(float(at))
        return out

    @staticmethod
    def _gaps(median: float, bins: tuple[float, ...], n: int, rng: np.random.Generator | None) -> np.ndarray:
        if rng is None or not bins:
            return np.full(n, median)
        return np.asarray(bins)[rng.integers(len(bins), size=n)]
